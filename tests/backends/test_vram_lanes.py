"""``kvxfer info``'s verdict on the lanes a VRAM pool takes: device to device, or a host bounce said loudly."""

from __future__ import annotations

from kvxfer.backends.ucx_tls import parse_ucx_tls
from kvxfer.backends.vram_lanes import judge_vram_lanes, vram_lane_lines

CUDA_BUILD = ("cma", "cuda", "ib")


def test_cuda_ipc_is_the_same_host_lane_when_permitted():
    lanes = judge_vram_lanes(CUDA_BUILD, parse_ucx_tls(None), cuda_device=True, rdma_devices=())
    assert lanes.same_host.startswith("cuda_ipc") and not lanes.defect
    assert "HOST BOUNCE" in lanes.other_host and "no RDMA NIC" in lanes.other_host


def test_ucx_tls_without_cuda_ipc_is_a_host_bounce_reported_as_a_defect():
    lanes = judge_vram_lanes(CUDA_BUILD, parse_ucx_tls("tcp,cuda_copy"), cuda_device=True, rdma_devices=())
    assert lanes.defect and "HOST BOUNCE" in lanes.same_host and "then tcp" in lanes.same_host
    assert lanes.line("nixl").startswith("nixl: VRAM pools DEFECT:")


def test_no_cuda_module_or_no_cuda_transport_allowed_names_the_cause():
    no_module = judge_vram_lanes(("cma",), parse_ucx_tls(None), cuda_device=True, rdma_devices=())
    assert no_module.defect and "no CUDA module" in no_module.same_host
    excluded = judge_vram_lanes(CUDA_BUILD, parse_ucx_tls("^cuda_copy,cuda_ipc"), cuda_device=True, rdma_devices=())
    assert excluded.defect and "allows none of cuda_copy, cuda_ipc" in excluded.same_host


def test_rdma_nic_is_the_other_host_lane():
    lanes = judge_vram_lanes(CUDA_BUILD, parse_ucx_tls(None), cuda_device=True, rdma_devices=("mlx5_0",))
    assert lanes.other_host.startswith("RDMA (mlx5_0)")


def test_this_machine_reports_the_cuda_lanes_its_ucx_builds_carry():
    lines = vram_lane_lines(environ={}, cuda_device=False)
    assert lines == [lines[0]] and "no CUDA device here" in lines[0]
    assert "ucx (cuda_copy/cuda_ipc)" in lines[0], lines  # libucx-cu12 ships libuct_cuda
