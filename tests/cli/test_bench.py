"""``kvxfer bench``: a seconds-long smoke of the real command, and its pieces.

Nothing here asserts a timing: the figures depend on the machine. What must hold
is that every field is there, every transfer was verified, and a wrong transfer
is reported as a failure rather than as a fast result.
"""

from __future__ import annotations

import json

import pytest

from kvxfer.bench.baselines import naive_nixl, ucp_get_cold, ucx_perftest
from kvxfer.bench.config import KiB, MiB, BenchConfig, Point, parse_size, tiny_config
from kvxfer.bench.results import POINT_FIELDS, PointResult
from kvxfer.bench.targets import large_reads_vs_perftest, reshard_vs_plain, scattered_32k_vs_naive
from kvxfer.bench.worker import run_in_worker
from kvxfer.cli import main

MACHINE_FIELDS = ("cpu_model", "logical_cores", "memory_bytes", "kernel", "versions", "load_average_start",
                  "load_average_end")


def _perftest_available() -> bool:
    return not isinstance(ucx_perftest.find_binary(), ucx_perftest.Unavailable)


def test_bench_smoke_writes_every_field_and_verifies_every_transfer(tmp_path):
    out = tmp_path / "bench.json"
    # whatever is available quickly: memcpy always, ucx_perftest where installed (naive NIXL: its own test)
    baselines = "memcpy,ucx-perftest" if _perftest_available() else "memcpy"
    if ucp_get_cold.availability() is None:
        baselines += ",ucp-get-cold"
    rc = main(["bench", "--tiny", "--backends", "local", "--baselines", baselines, "--json", str(out),
               "--plot", str(tmp_path / "bench.png"), "--markdown", str(tmp_path / "benchmarks.md")])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["schema_version"] == 1 and report["runtime_s"] > 0
    assert report["command"].startswith("kvxfer bench --backends local")
    assert all(report["machine"][f] is not None for f in MACHINE_FIELDS)
    assert {"torch", "nixl", "ucx"} <= set(report["machine"]["versions"])
    assert set(report["targets"]) == {"large_reads_vs_ucx_perftest", "reshard_vs_plain", "scattered_32k_vs_naive_nixl",
                                      "reshard_descriptor_build"}
    assert report["machine"]["llc_bytes"] is None or report["machine"]["llc_bytes"] > 0
    sources = {p["source"] for p in report["points"]}
    assert {"local", "memcpy"} <= sources
    for point in report["points"]:
        assert set(POINT_FIELDS) <= set(point), set(POINT_FIELDS) - set(point)
        assert point["ok"] and point["verified"] and point["error"] is None
        assert point["bytes"] > 0 and point["gbps"] > 0
        assert point["repeats"] == 1 or point["source"] == "ucp-get-cold"  # it samples per batch of gets
    local = [p for p in report["points"] if p["source"] == "local"]
    assert {p["pattern"] for p in local} == {"contiguous", "scattered"}
    assert {p["reshard"] for p in local} == {False, True}  # TP 2 -> 1 points, verified like the others
    assert report["targets"]["reshard_descriptor_build"]["strided"]["descriptors"] > 0
    for p in local:
        assert p["descriptors"] <= p["raw_descriptors"] and p["build_ms"] is not None and p["read_done_ms_p50"] is not None
        assert p["bytes"] == p["num_blocks"] * 2 * 2 * p["slice_bytes"]  # tiny: 2 layers -> 4 planes
        # per-request latency and the point's own gather ceiling (same ids, same run), plain and reshard alike
        assert 0 < p["transfer_ms_p50"] <= p["transfer_ms_p99"]
        assert p["gather_gbps"] > 0 and 0 < p["gather_ms_p50"] <= p["gather_ms_p99"]
        assert p["vs_gather"] == pytest.approx(p["gbps"] / p["gather_gbps"])
        assert "gather_error" not in p["extra"]
    md = (tmp_path / "benchmarks.md").read_text()
    assert report["command"] in md and "bench.png" in md
    assert "x gather" in md and "Against the ceilings (same run)" in md
    if "ucx-perftest" in baselines:
        assert any(p["source"] == "ucx-perftest" for p in report["points"])
    if "ucp-get-cold" in baselines:  # the inter-process ceiling at every coalesced size, compared per point
        gets = [p for p in report["points"] if p["source"] == "ucp-get-cold"]
        assert {p["slice_bytes"] for p in gets} == {4 * KiB, 8 * 4 * KiB}  # a slice, and 8 contiguous blocks' run
        for g in gets:
            assert g["verified"] and g["gbps"] > 0 and 0 < g["transfer_ms_p50"] <= g["transfer_ms_p99"]
            assert g["extra"]["region_bytes"] >= 32 * MiB and g["extra"]["measured_gets"] > 0
        for p in local:
            assert p["get_gbps"] > 0 and p["get_size"] in {g["slice_bytes"] for g in gets}
            assert p["get_size"] <= max(p["mean_descriptor_bytes"], 4 * KiB)



def test_bench_nccl_pushes_and_verifies_every_point(tmp_path):
    """The push backend's axis: worker and source in one Gloo group, plain and TP 2 -> 1 points, all verified."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "--tiny", "--backends", "nccl", "--baselines", "none", "--json", str(out),
               "--markdown", str(tmp_path / "benchmarks.md")])
    assert rc == 0
    report = json.loads(out.read_text())
    points = [p for p in report["points"] if p["source"] == "nccl"]
    assert report["ok"] and {(p["pattern"], p["reshard"]) for p in points} == {
        (pattern, reshard) for pattern in ("contiguous", "scattered") for reshard in (False, True)}
    for p in points:
        assert p["ok"] and p["verified"] and p["extra"] == {"two_process": True, "direction": "push"}
        assert p["bytes"] == p["num_blocks"] * 2 * 2 * p["slice_bytes"] and p["read_done_ms_p50"] is not None
    assert "Push backends (*nccl*)" in (tmp_path / "benchmarks.md").read_text()


def test_a_wrong_transfer_is_a_failure_not_a_result():
    cfg = tiny_config(slice_sizes=(4 * KiB,))
    points = list(cfg.points())
    results = run_in_worker("tests.support.bench_support:run_backend_with_lying_source", (cfg, "local", points), points,
                            "local", "backend")
    assert len(results) == len(points)
    assert all(not r.ok and not r.verified and "verification failed" in r.error for r in results)


def test_naive_nixl_baseline_reads_the_right_bytes_across_processes():
    cfg = tiny_config(patterns=("scattered",))
    points = list(cfg.points())
    # in a worker, as the bench runs it: NIXL's UCX plugin may crash at interpreter exit
    results = run_in_worker("kvxfer.bench.baselines.naive_nixl:run", (cfg, points), points, "naive-nixl", "baseline")
    assert [r.ok for r in results] == [True], [r.error for r in results]
    (r,) = results
    assert r.extra["two_process"] and r.descriptors == r.raw_descriptors == r.num_blocks * cfg.planes


def test_a_worker_that_dies_fails_its_points_with_the_reason():
    cfg = tiny_config(slice_sizes=(4 * KiB,))
    points = list(cfg.points())
    results = run_in_worker("os:abort", (), points, "crashy", "backend", silence_s=60)
    assert len(results) == len(points) and all(not r.ok and "worker" in r.error for r in results)


def test_bench_help_lists_the_axes(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and all(f in out for f in ("--sizes", "--blocks", "--patterns", "--reshard", "--baselines"))


def test_unknown_backend_is_an_error_before_anything_runs(capsys):
    assert main(["bench", "--tiny", "--backends", "no-such-backend", "--baselines", "none"]) == 2
    out = capsys.readouterr()
    assert "unknown backend" in out.err and out.out == ""


def test_sizes_and_caps():
    assert [parse_size(s) for s in ("4K", "32KiB", "1M", "4096")] == [4096, 32768, 1 << 20, 4096]
    cfg = BenchConfig(slice_sizes=(4 * MiB,), block_counts=(16, 128), max_request_bytes=64 * MiB, num_layers=4)
    points = list(cfg.points())
    assert points == [Point(4 * MiB, 2, "contiguous"), Point(4 * MiB, 2, "scattered")]  # capped and de-duplicated
    pool = cfg.pool_config("local", 4 * MiB)
    assert pool.pool_blocks >= 4 and pool.head_dim * 16 * 8 * 2 == 4 * MiB
    with pytest.raises(ValueError):
        BenchConfig(baselines=("nope",))


def test_perftest_output_is_parsed():
    line = "Final:                   200    141.154   894.669   894.669     1117.73    1117.73        1118        1118"
    final = ucx_perftest.parse_final("header\n" + line + "\n")
    assert final == {"iterations": 200.0, "latency_us_p50": 141.154, "latency_us_avg": 894.669,
                     "latency_us_overall": 894.669, "bandwidth_mbps_avg": 1117.73, "bandwidth_mbps_overall": 1117.73}
    assert ucx_perftest.parse_final("no final line") is None
    proto = ("[1.2] [vm:1:0] | remote memory read by ucp_get*(multi) into host memory from host |\n"
             "[1.2] [vm:1:0]   | 0..4434 | short       | sysv/memory    |\n"
             "[1.2] [vm:1:0]   | 4435..inf | zero-copy   | cma/memory   |\n"
             "[1.2] [vm:1:0] +-------+\n")
    assert ucx_perftest.parse_get_protocols(proto) == ["0..4434 short sysv/memory", "4435..inf zero-copy cma/memory"]


def _point(source, kind, size, blocks, pattern, gbps, ms, descriptors, two_process=True):
    r = PointResult(source, kind, size, blocks, pattern, bytes=size * blocks * 8, descriptors=descriptors,
                    raw_descriptors=blocks * 8, verified=True, repeats=1, gbps=gbps, transfer_ms_p50=ms)
    r.extra["two_process"] = two_process
    return r


def test_targets_compare_like_with_like():
    results = [
        _point("ucx-perftest", "baseline", 1 * MiB, 1, "contiguous", 10.0, 0.1, 1),
        _point("nixl", "backend", 1 * MiB, 8, "contiguous", 9.5, 1.0, 8),  # 8 MiB runs -> perftest at 1 MiB
        _point("nixl", "backend", 32 * KiB, 16, "scattered", 1.0, 2.0, 128),
        _point("naive-nixl", "baseline", 32 * KiB, 16, "scattered", 0.4, 5.0, 128),
        _point("local", "backend", 32 * KiB, 16, "scattered", 0.1, 50.0, 128, two_process=False),  # not a transport
    ]
    reshard = _point("nixl", "backend", 32 * KiB, 16, "scattered", 0.1, 50.0, 4096)
    reshard.reshard = True  # a TP change moves other bytes: not compared with a plain naive pull
    results.append(reshard)
    large = large_reads_vs_perftest(results)["backends"]["nixl"]
    assert large["median_ratio"] == pytest.approx(0.95) and large["met"]
    # with the over-the-LLC get in the run, it (not the cache-warm perftest) is the reference
    cold = _point("ucp-get-cold", "baseline", 1 * MiB, 1, "contiguous", 19.0, 0.05, 1)
    large = large_reads_vs_perftest(results + [cold])
    assert large["reference"] == "ucp-get-cold" and large["backends"]["nixl"]["median_ratio"] == pytest.approx(0.5)
    scattered = scattered_32k_vs_naive(results)["backends"]
    assert set(scattered) == {"nixl"} and len(scattered["nixl"]["points"]) == 1
    assert scattered["nixl"]["min_speedup"] == pytest.approx(2.5) and scattered["nixl"]["met"]


def test_reshard_is_compared_with_the_same_backends_plain_pull():
    plain = _point("ucx", "backend", 32 * KiB, 16, "scattered", 2.0, 2.0, 128)
    tp = _point("ucx", "backend", 32 * KiB, 16, "scattered", 1.0, 4.0, 128)
    tp.reshard = True
    other = _point("nixl", "backend", 32 * KiB, 16, "scattered", 9.0, 0.5, 128)  # another backend: never compared
    entry = reshard_vs_plain([plain, tp, other])["backends"]
    assert set(entry) == {"ucx"} and entry["ucx"]["min_ratio"] == pytest.approx(0.5) and not entry["ucx"]["met"]


def test_gather_ceiling_copies_exactly_the_points_slices():
    """The same-process ceiling lands the source's bytes at the point's ids, plain and TP 2 -> 1, and nothing else."""
    import numpy as np
    import torch

    from kvxfer.bench.ceiling import GatherCeiling
    from kvxfer.harness.loopback import SENTINEL, make_pool, untouched

    cfg = tiny_config(slice_sizes=(4 * KiB,), repeats=2, warmup=0)
    for point in cfg.points(reshard=True):
        pool_cfg = cfg.pool_config("local", point.slice_bytes)
        ceiling = GatherCeiling(pool_cfg, point.reshard)
        dst = make_pool(pool_cfg, random_seed=None)
        times, why = ceiling.measure(cfg, point, dst)
        assert why is None and len(times) == 2 and all(t > 0 for t in times)
        src_ids, dst_ids = (np.asarray(a) for a in cfg.request_config(pool_cfg, point, 1).block_ids())
        joined = torch.cat(ceiling.sources, dim=4)  # TP ranks' heads side by side = the decode's layout
        as_bytes = lambda t: t.contiguous().view(torch.uint8)  # random bytes hold NaNs: compare bits
        assert torch.equal(as_bytes(dst[:, :, torch.from_numpy(dst_ids)]), as_bytes(joined[:, :, torch.from_numpy(src_ids)]))
        if point.pattern == "contiguous":  # one repeat's ids: every other block still holds the sentinel
            assert untouched(dst, pool_cfg.pool_blocks, dst_ids) and int(dst.view(torch.uint8).view(-1)[-1]) == SENTINEL


def test_device_config_refuses_host_only_baselines_and_defaults_to_the_device_copy():
    with pytest.raises(ValueError, match="measure host memory only.*use memcpy"):
        BenchConfig(device="cuda", baselines=("memcpy", "ucx-perftest"))
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        BenchConfig(device="tpu")
    from kvxfer.cli.bench import add_arguments, config_from_args
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--tiny", "--backends", "local"])
    args.device = "cuda"  # past the parser's check, which needs a GPU: the defaults it then chooses
    cfg = config_from_args(args)
    assert cfg.baselines == ("memcpy",) and cfg.pool_config("local", 4 * KiB).device == "cuda"
    assert config_from_args(parser.parse_args(["--tiny", "--backends", "local"])).baselines[0] == "memcpy"


@pytest.mark.gpu
def test_bench_on_vram_pools_verifies_every_pull_against_a_device_copy(tmp_path):
    """``kvxfer bench --device cuda``: both pools in VRAM, two processes, every first pull verified, and
    the memcpy row is the GPU's own device-to-device copy."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "--tiny", "--device", "cuda", "--backends", "nixl,ucx", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert "--device cuda" in report["command"]
    rows = report["points"]
    assert {"nixl", "ucx", "memcpy"} <= {p["source"] for p in rows}
    for point in rows:
        assert point["ok"] and point["verified"] and point["gbps"] > 0, point
    assert all(p["extra"]["copy"].startswith("device to device") for p in rows if p["source"] == "memcpy")
