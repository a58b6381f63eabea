"""kvxfer backends driven exactly the way Megatron's disaggregation engine drives its own.

The driver (``megatron_driver``) builds backends with Megatron's constructor arguments,
wraps per-request metas the way its prefill side does and pulls with its decode side's
calls. For ``nixl`` and ``ucx`` the prefill ranks live in another process; every request
crosses to the decode as JSON, as a pickle, and as the msgpack frame Megatron's coordinator
sends the decode engine after the meta's four msgpack hops (for ``local``, in-process).
Every case checks every decode pool byte for byte against the global tensors it was cut from.

The last tests drive Megatron's decode failure path (``MegatronImport``): the KV pull is
posted before the SSM pulls, so a refused SSM meta leaves posted reads behind, and the
storage must be released only when no byte of them can land.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from kvxfer.backends import construct_kv_transfer_backend_class
from tests.support.proc_state import stop as stop_process
from kvxfer.backends.base import TransferStartError
from kvxfer.errors import PeerMetadataError, TransferError
from kvxfer.meta.geometry import LAYOUT_FIELDS, export_geometry_meta, kv_layout_from_meta
from kvxfer.plan.geometry import compute_buffer_geometry
from kvxfer.meta.records import drop_transfer_prefix_blocks, transfer_peer_records
from megatron_driver import (
    WIRES, Case, Side, decode_import, decode_request, expected_decode, global_tensors, poll_all, pools, rank_specs,
    serve_prefill, setup_rank, start_import,
)

DRIVER = (Path(__file__).resolve().parents[3] / "tests/support/megatron_driver.py")
SSM = (4, 3, 5, 2, 4)  # nheads, headdim, d_state, ngroups, d_conv

CASES = [
    Case("flat_tp1_ssm", Side(1), Side(1, rank_base=10), ssm_dims=SSM),
    Case("tp2_to_1", Side(2), Side(1, rank_base=10), ssm_dims=SSM, seed=2),
    Case("tp1_to_2", Side(1), Side(2, rank_base=10), ssm_dims=SSM, seed=3),
    Case("pp2_to_1", Side(1, pp=2), Side(1, rank_base=10), ssm_dims=SSM, seed=4),
    Case("tp2pp2_to_tp1", Side(2, pp=2), Side(1, rank_base=10), seed=5),
    Case("cached_prefix", Side(2), Side(1, rank_base=10), cached_prefix=3, seed=6),
    Case("cached_prefix_pp", Side(1, pp=2), Side(2, rank_base=10), cached_prefix=4, seed=7),
    Case("uneven_pp", Side(1, pp=2, windows=((0, 3), (3, 4))), Side(1, pp=2, windows=((0, 1), (1, 4)), rank_base=10), seed=8),
    Case("kv_head_replicas", Side(4), Side(1, rank_base=10), num_heads=2, seed=9),
    Case("empty", Side(2), Side(1, rank_base=10), request_blocks=0, seed=10),
]


def _read_metas(proc: subprocess.Popen, timeout_s: float) -> dict[str, Any]:
    """The driver's ``METAS {json}`` line (NIXL may log to stdout before it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            proc.kill()
            raise TimeoutError(f"the prefill process printed no metas within {timeout_s}s")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the prefill process exited (rc={proc.wait()}) before printing its metas")
        if line.startswith("METAS "):
            return json.loads(line.removeprefix("METAS "))


def _start_prefill(backend: str, cases: list[Case], **env: str) -> tuple[subprocess.Popen, dict[str, Any]]:
    proc = subprocess.Popen([sys.executable, str(DRIVER), backend, json.dumps([c.to_json() for c in cases])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "NIXL_LOG_LEVEL": "WARN", **env})
    try:
        return proc, _read_metas(proc, 120)
    except BaseException:
        proc.kill()
        raise


def _stop(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
        proc.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()


@pytest.fixture(scope="module", params=["local", "nixl", "ucx"])
def prefill(request) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each case's prefill-side ``kv_meta``/``block_ids``: another process for network backends."""
    backend = request.param
    if backend == "local":
        metas, ranks = serve_prefill(backend, CASES)
        yield backend, pickle.loads(pickle.dumps(json.loads(json.dumps(metas))))
        for rank in ranks:
            rank.close()
        return
    proc, metas = _start_prefill(backend, CASES)
    try:
        yield backend, metas
    finally:
        _stop(proc)


def _typed(value: Any) -> Any:
    """``value`` with each leaf's type kept (``1``, ``1.0``, ``True`` and ``b"1"`` all differ);
    lists and tuples alike (JSON and msgpack both make lists of tuples, which the seal allows)."""
    if isinstance(value, dict):
        return {(type(k).__name__, k): _typed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_typed(v) for v in value]
    return type(value).__name__, value


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_megatron_call_shapes_move_exact_bytes(prefill, case, wire):
    backend, metas = prefill
    kv_meta, block_ids = decode_request(wire, metas[case.name])
    assert _typed((kv_meta, block_ids)) == _typed(decode_request("json", metas[case.name])), \
        f"{wire} changed a value's type somewhere in the request"
    truth = global_tensors(case)
    ranks = [setup_rank(backend, "decode", case, case.decode, spec, None) for spec in rank_specs(case.decode, case.num_layers)]
    try:
        for rank in ranks:
            poll_all(decode_import(rank, case, kv_meta, block_ids), 30)
            want = expected_decode(case, truth, rank)
            for name, pool in pools(rank).items():
                assert _same_bytes(pool, want[name]), f"{case.name} over {wire}: decode rank {rank.spec.global_rank} {name} pool differs"
    finally:
        for rank in ranks:
            rank.close()


@pytest.mark.parametrize("backend", ["nixl", "ucx"])
def test_killed_source_fails_the_wrapped_pull_once_and_loudly(backend):
    """TP 2 -> 1 from a prefill process killed right after the decode posted, then pulled again.

    The first pull either fails (one handle, one ``TransferError``, storage safe) or, if
    every read landed before the kill, holds exact bytes; the second, from the dead
    process, must fail within the handle timeout, never hang or report success.
    """
    case = Case("kill", Side(2), Side(1, rank_base=10), num_layers=4, num_heads=4, head_dim=64, tokens_per_block=16,
                pool_blocks=1031, request_blocks=1024, seed=11)
    proc, metas = _start_prefill(backend, [case])
    rank = setup_rank(backend, "decode", case, case.decode, rank_specs(case.decode, case.num_layers)[0], None, timeout_s=8)
    kv_meta, src_ids = metas["kill"]["kv_meta"], metas["kill"]["block_ids"]
    dst_ids = list(range(case.request_blocks))
    try:
        handle = rank.kv.begin_pull_blocks(kv_meta, src_ids, dst_ids)
        proc.kill()
        proc.wait(timeout=30)
        try:
            poll_all([handle], 20)
            landed = rank.kv.memory_buffer[:, :, dst_ids]
            full = global_tensors(case)["kv"][:, :, src_ids]  # decode TP 1 holds every layer and head
            assert torch.equal(landed.view(torch.uint8), full.view(torch.uint8)), "a pull reported done with wrong bytes"
        except TransferError:
            assert handle.storage_safe, "after the abort no byte can land, yet storage_safe is False"
            with pytest.raises(TransferError):  # final: the same error again
                handle.poll()
        started = time.monotonic()
        with pytest.raises(TransferError) as failure:
            poll_all([rank.kv.begin_pull_blocks(kv_meta, src_ids, dst_ids)], 30)
        elapsed = time.monotonic() - started
        assert elapsed < 10, f"a pull from a dead source took {elapsed:.1f}s to fail (handle timeout 8 s): {failure.value}"
        assert getattr(failure.value, "transfer_destinations_safe", True) or isinstance(failure.value, TransferStartError)
    finally:
        rank.close()
        _stop(proc)


# --- the seal, the seed's export, start failures, siblings: in-process, on the local backend --------
def _local_pair(case: Case):
    truth = global_tensors(case)
    src = [setup_rank("local", "prefill", case, case.prefill, s, truth) for s in rank_specs(case.prefill, case.num_layers)]
    dst = setup_rank("local", "decode", case, case.decode, rank_specs(case.decode, case.num_layers)[0], None)
    return src, dst


def test_sealed_fields_are_protected_inside_wrappers_and_added_keys_are_not():
    case = CASES[1]
    src, dst = _local_pair(case)
    try:
        metas = [r.kv.export_meta() for r in src]
        ok = {"tp_metas": [{**m, "note": "added by a router", "block_ids": [1, 2]} for m in metas], "resume_tokens": [3]}
        poll_all([dst.kv.begin_pull_blocks(ok, [], [4, 5])], 5)
        before = dst.kv.memory_buffer.clone()
        for field, value in (("base_addr", metas[1]["base_addr"] + 64), ("tp_rank", 0), ("num_blocks", 10**6)):
            bad = {"tp_metas": [metas[0], {**metas[1], field: value}]}
            with pytest.raises(PeerMetadataError, match="integrity check"):
                dst.kv.begin_pull_blocks(bad, [1], [6])
        lost = {"tp_metas": [metas[0], {k: v for k, v in metas[1].items() if k != "base_addr"}]}
        with pytest.raises(PeerMetadataError, match="lost sealed fields"):
            dst.kv.begin_pull_blocks(lost, [1], [6])
        assert torch.equal(dst.kv.memory_buffer, before), "a refused pull moved bytes"
    finally:
        for r in (*src, dst):
            r.close()


def test_wrapped_request_that_misses_a_source_is_refused_before_moving():
    case = CASES[1]
    src, dst = _local_pair(case)
    try:
        with pytest.raises(Exception, match="pull from every prefill rank"):
            dst.kv.begin_pull_blocks({"tp_metas": [src[0].kv.export_meta()]}, [1], [2])
        assert not dst.kv.memory_buffer.any()
    finally:
        for r in (*src, dst):
            r.close()


def test_seed_export_passes_a_megatron_style_registration_check():
    case = CASES[4]
    truth = global_tensors(case)
    rank = setup_rank("local", "prefill", case, case.prefill, rank_specs(case.prefill, case.num_layers)[3], truth)
    try:
        plain = export_geometry_meta(rank.kv.geometry)  # the seed's call: no dtype
        assert "base_addr" in plain and "dtype" not in plain and "ssm_layout" not in plain
        for meta in (plain, rank.kv.export_meta()):
            # written like Megatron's layout-from-meta check: every flat field present, shapes agree
            assert [k for k in LAYOUT_FIELDS if meta.get(k) is None] == []
            layout = kv_layout_from_meta(meta)
            assert meta["heads_per_partition"] == layout.local_num_heads()
            assert meta["num_outer"] % layout.local_num_layers() == 0
            assert (layout.kv_shard_key(), layout.layer_range(), layout.head_range()) == ((1, 1), (2, 4), (2, 4))
        no_layout = compute_buffer_geometry(torch.zeros(2, 1, 5, 2, 1, 3), 5, backend_name="t")
        assert not set(LAYOUT_FIELDS) & set(export_geometry_meta(no_layout))
    finally:
        rank.close()


def test_start_failure_after_a_posted_part_raises_transfer_start_error():
    """Part 1 posts (and lands), part 2 names a closed registration: TransferStartError, storage safe."""
    case = CASES[1]
    src, dst = _local_pair(case)
    try:
        metas = [r.kv.export_meta() for r in src]
        src[1].close()
        with pytest.raises(TransferStartError) as err:
            dst.kv.begin_pull_blocks({"tp_metas": metas}, [1], [2])
        assert err.value.storage_safe and err.value.transfer_destinations_safe
        assert len(err.value.cleanup_handles) == 1
        with pytest.raises(PeerMetadataError) as before_posting:  # nothing posted: a plain error, plainly safe
            dst.kv.begin_pull_blocks({"tp_metas": metas[::-1]}, [1], [2])
        assert getattr(before_posting.value, "transfer_destinations_safe", True)
    finally:
        for r in (*src, dst):
            r.close()


def test_peer_records_and_prefix_trimming_follow_megatron():
    flat = {"base_addr": 1, "resume_tokens": [1]}
    assert transfer_peer_records(flat, [4, 5]) == [(flat, [4, 5])]
    a, b = {"x": 1}, {"x": 2, "block_ids": [9]}
    assert transfer_peer_records({"tp_metas": [a, b]}, [4]) == [(a, [4]), (b, [9])]
    assert transfer_peer_records([a, b], [4]) == [(a, [4]), (b, [9])]
    pp = {"pp_metas": [{"tp_metas": a, "block_ids": [1, 2]}, {"tp_metas": [a, b], "block_ids": [3]}]}
    assert transfer_peer_records(pp, [7]) == [(a, [1, 2]), (a, [3]), (b, [9])]
    ssm = {"ssm": {"conv": {"block_ids": [5]}}}
    trimmed, src = drop_transfer_prefix_blocks({**pp, **ssm}, [1, 2, 3], 1)
    assert src == [2, 3] and trimmed["pp_metas"][0]["block_ids"] == [2] and trimmed["pp_metas"][1]["block_ids"] == []
    assert trimmed["ssm"] == ssm["ssm"], "SSM slots are not a sequence prefix"
    with pytest.raises(PeerMetadataError, match="cached prefix"):
        drop_transfer_prefix_blocks(pp, [1, 2, 3], 2)
    with pytest.raises(PeerMetadataError, match="must be a dict"):
        transfer_peer_records({"tp_metas": [a, 3]}, [])


def test_nixl_siblings_share_the_ranks_agent():
    case = CASES[0]
    truth = global_tensors(case)
    rank = setup_rank("nixl", "prefill", case, case.prefill, rank_specs(case.prefill, case.num_layers)[0], truth)
    try:
        for kind, backend in rank.ssm.items():
            assert backend.agent_name == f"prefill-ssm-{kind}-rank0"
            assert backend._share is rank.kv._share
            assert backend.export_meta()["nixl_agent_name"] == rank.kv.export_meta()["nixl_agent_name"] == "prefill-rank0"
    finally:
        rank.close()


def test_nccl_is_megatrons_push_backend():
    cls = construct_kv_transfer_backend_class("nccl")
    assert cls.is_push and cls.name == "nccl" and hasattr(cls, "begin_push_blocks")


def test_install_points_megatrons_lookup_at_kvxfer():
    """Megatron is not installed here: a module with its one attribute stands in for the handoff module."""
    import types

    import kvxfer.megatron

    handoff = types.ModuleType("inference_state_handoff")
    handoff.construct_kv_transfer_backend_class = lambda name: "megatron's own"
    previous = kvxfer.megatron.install(handoff)
    assert previous("nixl") == "megatron's own"
    assert handoff.construct_kv_transfer_backend_class("ucx").name == "ucx"
    with pytest.raises(ImportError, match="Megatron-LM"):
        kvxfer.megatron.install()


# --- Megatron posts the KV pull before the SSM pulls: a refused SSM meta behind posted reads -------------
#: (backend, decode keyword arguments), as in tests/backends/test_storage_safety.py: nixl (which cannot cancel
#: an active READ); ucx with UCX's peer failure mode (over TCP it has it); ucx without it (its gets
#: end only when the source does)
STALL_MODES = {"nixl": ("nixl", {}), "ucx": ("ucx", {}), "ucx-no-peer-mode": ("ucx", {"peer_error_handling": False})}
TAMPER_CASE = Case("tamper", Side(1), Side(1, rank_base=10), ssm_dims=SSM, seed=12)
REUSE_CASE = dataclasses.replace(TAMPER_CASE, name="reuse", data_seed=13)  # the same blocks and slot, other bytes
STALL_TIMEOUT_S = 5.0  # the decode handles' own timeout: Megatron's waiter calls wait() without one
SETTLE_S = 15.0  # a resumed source must end its late reads within this


@pytest.fixture(scope="module")
def tcp_prefills() -> Iterator[Any]:
    """Per backend, two prefill processes on UCX's TCP transport only, where a read needs the source's
    CPU, so that a SIGSTOPped source really stalls it: the request's, and the one whose bytes reuse
    its blocks. Started on first use; resumed and stopped at the end of the module."""
    started: dict[str, tuple[tuple[subprocess.Popen, dict[str, Any]], ...]] = {}

    def get(backend: str) -> tuple[tuple[subprocess.Popen, dict[str, Any]], ...]:
        if backend not in started:
            started[backend] = tuple(_start_prefill(backend, [case], UCX_TLS="tcp") for case in (TAMPER_CASE, REUSE_CASE))
        return started[backend]

    yield get
    for pair in started.values():
        for proc, _ in pair:
            _resume(proc)
            _stop(proc)


def _resume(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("mode", list(STALL_MODES))
def test_refused_ssm_meta_refuses_the_kv_call_before_any_read_is_posted(mode, tcp_prefills, monkeypatch):
    """Megatron's ``_try_start_kv_handoff_import`` posts the KV pull, then conv, then recurrent, and the
    KV call's meta carries the SSM metas under ``"ssm"`` (``drop_transfer_prefix_blocks`` keeps them).
    kvxfer checks them in the KV call against its SSM siblings, so a tampered recurrent meta refuses
    the KV call itself: nothing is posted (KV, conv or recurrent), the error is a plain
    ``PeerMetadataError`` Megatron reads as safe, and the blocks and slot are reused at once, exact,
    even with the source stopped (no read of it was ever in flight)."""
    backend, decode_kwargs = STALL_MODES[mode]
    monkeypatch.setenv("UCX_TLS", "tcp")  # read when the decode's UCX context is made
    (source, metas), (_, reuse_metas) = tcp_prefills(backend)
    kv_meta, src_ids = decode_request("msgpack", metas[TAMPER_CASE.name])
    reuse_meta, reuse_src = decode_request("msgpack", reuse_metas[REUSE_CASE.name])
    spec = rank_specs(TAMPER_CASE.decode, TAMPER_CASE.num_layers)[0]
    rank = setup_rank(backend, "decode", TAMPER_CASE, TAMPER_CASE.decode, spec, None, timeout_s=STALL_TIMEOUT_S,
                      **decode_kwargs)
    try:
        for meta, ids in ((kv_meta, src_ids), (reuse_meta, reuse_src)):  # connected: a read would go at once
            poll_all(decode_import(rank, TAMPER_CASE, meta, ids), 30)
        for pool in pools(rank).values():
            pool.zero_()
        ssm = kv_meta["ssm"]
        tampered = {**kv_meta, "ssm": {**ssm, "recurrent": {**ssm["recurrent"], "num_blocks": ssm["recurrent"]["num_blocks"] + 1}}}
        stop_process(source.pid)
        before = rank.kv.stats()["transfers_started"]
        started = start_import(rank, TAMPER_CASE, tampered, src_ids)
        assert isinstance(started.start_error, PeerMetadataError), started.start_error
        assert "recurrent" in str(started.start_error) and "integrity check" in str(started.start_error)
        assert started.kv_handle is None and not started.ssm_handles, "a read was posted before the refusal"
        assert rank.kv.stats()["transfers_started"] == before
        assert started.report() is True  # Megatron reports the start error as the failure, polling nothing
        assert started.destinations_safe and started.may_release_after_failure()
        for name, pool in pools(rank).items():
            assert not pool.any(), f"{name}: the refused request moved bytes"
        _resume(source)
        poll_all(decode_import(rank, TAMPER_CASE, reuse_meta, reuse_src), 30)  # reused at once
        time.sleep(0.5)
        want = expected_decode(REUSE_CASE, global_tensors(REUSE_CASE), rank)
        for name, pool in pools(rank).items():
            assert _same_bytes(pool, want[name]), f"{name}: the reused storage is not the next request's"
    finally:
        _resume(source)
        rank.close()
