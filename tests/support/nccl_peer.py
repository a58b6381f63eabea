"""Child processes for ``test_nccl_backend.py``: one rank each of a real ``torch.distributed`` world.

``run_world`` spawns ``world_size`` processes (file:// rendezvous, so no rank hosts
the store and killing one leaves the others' store working), each runs
``rank_main``, which plays every named scenario in order and puts
``(scenario, rank, result)`` on a queue. Each scenario builds its pools from one
seeded global tensor, moves blocks with ``NcclBackend`` and checks on the decode
ranks, byte for byte, that the destination blocks hold the global tensor's slice
and every other block is unchanged. Ranks not in a scenario only join its
metadata exchange (``all_gather_object``), which also keeps scenarios apart.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvxfer.backends.base import CompletedHandle
from kvxfer.backends.nccl import NcclBackend
from kvxfer.errors import TransferCancelledError, TransferError
from kvxfer.plan.ssm_layout import SSMStateDims
from reshard_support import (
    POOL_BLOCKS, conv_shard, kv_layouts, kv_shard, random_tensor, recurrent_shard, ssm_layouts,
)

LAYERS, HEADS, TOKENS, HEAD_DIM = 4, 4, 4, 8
DIMS = SSMStateDims(nheads=8, headdim=3, d_state=5, ngroups=4, d_conv=4)
SRC_IDS = [3, 4, 5, 9, 20, 21]
DST_IDS = [30, 31, 2, 7, 8, 0]  # other runs than the source: the message must not depend on them
SRC_IDS_B = [10, 11, 12, 13, 14, 15]
DST_IDS_B = [16, 17, 18, 19, 22, 23]
TIMEOUT_S = 20.0
DEVICE = torch.device("cpu")  # set per rank by rank_main: the GPU of this rank in an NCCL world


# --- pools and backends -------------------------------------------------------------------------------
def kv_backend(layout, pool: torch.Tensor, name: str, **kw: Any) -> NcclBackend:
    l0, l1 = layout.local_layer_range()
    return NcclBackend(
        name, pool, POOL_BLOCKS, tp_size=layout.tp_size, tp_rank=layout.tp_rank, num_kv_heads_global=layout.num_heads,
        global_rank=layout.global_rank, pp_size=layout.pp_size, pp_rank=layout.pp_rank,
        num_layers_global=layout.num_layers, layer_start=l0, layer_end=l1, timeout_s=kw.pop("timeout_s", TIMEOUT_S), **kw,
    )


def global_kv(seed: int, heads: int = HEADS, dtype=torch.bfloat16) -> torch.Tensor:
    return random_tensor((2, LAYERS, POOL_BLOCKS, TOKENS, heads, HEAD_DIM), dtype, seed)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check_kv(pool: torch.Tensor, garbage: torch.Tensor, expected_pool: torch.Tensor, src_ids, dst_ids) -> dict[str, bool]:
    """Destination blocks hold the source blocks of the expected (global-sliced) pool; the rest is unchanged."""
    want = garbage.clone()
    want[:, :, torch.tensor(dst_ids)] = expected_pool[:, :, torch.tensor(src_ids)]
    other = [b for b in range(POOL_BLOCKS) if b not in set(dst_ids)]
    return {"bytes_ok": same(pool[:, :, torch.tensor(dst_ids)], want[:, :, torch.tensor(dst_ids)]),
            "untouched_ok": same(pool[:, :, torch.tensor(other)], garbage[:, :, torch.tensor(other)])}


def exchange(meta: Any) -> list[Any]:
    """Every rank's object (None where a rank has nothing to share)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, meta)
    return out


def wait_all(handles) -> None:
    for handle in handles:
        handle.wait()


# --- KV scenarios --------------------------------------------------------------------------------------
def kv_reshard(rank: int, prefill: dict[int, tuple[int, int]], decode: dict[int, tuple[int, int]], *,
               heads: int = HEADS, pp_wrap: bool = False, two_requests: bool = False) -> Optional[dict]:
    """Prefill ranks {rank: (tp, pp)} push to decode ranks {rank: (tp, pp)}; decode checks the bytes.

    Layouts are built per instance with global ranks = the real ranks of the world.
    """
    def layouts(spec: dict[int, tuple[int, int]]):
        ranks = sorted(spec)
        tp, pp = spec[ranks[0]]
        return dict(zip(ranks, kv_layouts(tp, pp, LAYERS, heads, rank_base=ranks[0])))

    g = global_kv(seed=7 + heads, heads=heads)
    pre, dec = layouts(prefill), layouts(decode)
    backend = garbage = None
    if rank in pre:
        backend = kv_backend(pre[rank], kv_shard(g, pre[rank]).to(DEVICE), f"prefill{rank}")
    elif rank in dec:
        shape = kv_shard(g, dec[rank]).shape
        garbage = random_tensor(shape, g.dtype, seed=100 + rank)
        backend = kv_backend(dec[rank], garbage.clone().to(DEVICE), f"decode{rank}")
    metas = exchange(None if backend is None else backend.export_meta())
    result: Optional[dict] = None
    try:
        if rank in pre:
            decode_metas = {"tp_metas": [metas[r] for r in sorted(dec)]}
            handles = [backend.begin_push_blocks(decode_metas, SRC_IDS)]
            if two_requests:
                handles.append(backend.begin_push_blocks(decode_metas, SRC_IDS_B))
            wait_all(handles)
            result = {"sent": [not isinstance(h, CompletedHandle) for h in handles]}
        elif rank in dec:
            if pp_wrap:
                stages = sorted({l.pp_rank for l in pre.values()})
                source = {"pp_metas": [{"tp_metas": [metas[r] for r in sorted(pre) if pre[r].pp_rank == s],
                                        "block_ids": SRC_IDS} for s in stages]}
                handles = [backend.begin_pull_blocks(source, [], DST_IDS)]
            else:
                source = {"tp_metas": [metas[r] for r in sorted(pre)]}
                handles = [backend.begin_pull_blocks(source, SRC_IDS, DST_IDS)]
                if two_requests:
                    handles.append(backend.begin_pull_blocks(source, SRC_IDS_B, DST_IDS_B))
            wait_all(handles)
            expected = kv_shard(g, dec[rank])
            if two_requests:  # both requests' blocks hold their bytes, every other block is unchanged
                result = check_kv(backend.memory_buffer.cpu(), garbage, expected, SRC_IDS + SRC_IDS_B, DST_IDS + DST_IDS_B)
            else:
                result = check_kv(backend.memory_buffer.cpu(), garbage, expected, SRC_IDS, DST_IDS)
            result["staging_allocations"] = backend._staging.allocations
    finally:
        exchange(None)  # nobody closes while a peer still transfers
        if backend is not None:
            backend.close()
    return result


def scenario_matched(rank: int) -> Optional[dict]:
    """TP1 -> TP1, two requests in flight at once (posted back to back, then waited)."""
    return kv_reshard(rank, {0: (1, 1)}, {1: (1, 1)}, two_requests=True)


def scenario_tp2to1(rank: int) -> Optional[dict]:
    return kv_reshard(rank, {0: (2, 1), 1: (2, 1)}, {2: (1, 1)})


def scenario_tp1to2(rank: int) -> Optional[dict]:
    return kv_reshard(rank, {0: (1, 1)}, {2: (2, 1), 3: (2, 1)})


def scenario_pp2to1(rank: int) -> Optional[dict]:
    return kv_reshard(rank, {0: (1, 2), 1: (1, 2)}, {2: (1, 1)}, pp_wrap=True)


def scenario_replicas(rank: int) -> Optional[dict]:
    """TP2 over 1 KV head (both ranks hold it) -> TP1: only the first replica sends."""
    return kv_reshard(rank, {0: (2, 1), 1: (2, 1)}, {2: (1, 1)}, heads=1)


# --- SSM -----------------------------------------------------------------------------------------------
def scenario_ssm(rank: int) -> Optional[dict]:
    """Conv then recurrent state of one slot, TP2 -> TP1 (ranks 0,1 -> 2) and TP1 -> TP2 (rank 3 -> 0,1)...

    ...in Megatron's shapes: the decode pulls ``{"tp_metas": [meta + block_ids=[slot]]}`` with no source
    ids into ``[live_slot]``; the prefill pushes ``{"tp_metas": decode metas}`` with ``[slot]``.
    """
    result: dict[str, Any] = {}
    for kind in ("conv", "recurrent"):
        for case, pre_ranks, dec_ranks in (("tp2to1", [0, 1], [2]), ("tp1to2", [3], [0, 1])):
            shape = ((LAYERS, POOL_BLOCKS, DIMS.conv_channels, DIMS.d_conv) if kind == "conv"
                     else (LAYERS, POOL_BLOCKS, DIMS.nheads, DIMS.headdim, DIMS.d_state))
            g = random_tensor(shape, torch.float32, seed=11 if kind == "conv" else 12)
            cut = conv_shard if kind == "conv" else recurrent_shard

            def layout_of(ranks: list[int], r: int):
                return ssm_layouts(len(ranks), 1, LAYERS, DIMS, rank_base=ranks[0])[ranks.index(r)]

            backend = garbage = None
            slot, live = 5, 17
            if rank in pre_ranks:
                lay = layout_of(pre_ranks, rank)
                backend = NcclBackend(f"p{rank}-{kind}", cut(g, lay), POOL_BLOCKS, ssm_layout=lay, ssm_state_kind=kind,
                                      timeout_s=TIMEOUT_S)
            elif rank in dec_ranks:
                lay = layout_of(dec_ranks, rank)
                garbage = random_tensor(cut(g, lay).shape, torch.float32, seed=200 + rank)
                backend = NcclBackend(f"d{rank}-{kind}", garbage.clone(), POOL_BLOCKS, ssm_layout=lay,
                                      ssm_state_kind=kind, timeout_s=TIMEOUT_S)
            metas = exchange(None if backend is None else backend.export_meta())
            try:
                if rank in pre_ranks:
                    backend.begin_push_blocks({"tp_metas": [metas[r] for r in dec_ranks]}, [slot]).wait()
                elif rank in dec_ranks:
                    source = {"tp_metas": [{**metas[r], "block_ids": [slot]} for r in pre_ranks]}
                    backend.begin_pull_blocks(source, [], [live]).wait()
                    want = cut(g, lay)
                    pool = backend.memory_buffer
                    others = [b for b in range(POOL_BLOCKS) if b != live]
                    result[f"{kind}_{case}_bytes_ok"] = same(pool[:, live], want[:, slot])
                    result[f"{kind}_{case}_untouched_ok"] = same(pool[:, others], garbage[:, others])
            finally:
                exchange(None)
                if backend is not None:
                    backend.close()
    return result or None


# --- empty, misordered, timed out ----------------------------------------------------------------------
def _pair(rank: int, seed: int, **kw: Any):
    """Rank 0 prefill, rank 1 decode, TP1 each; returns (backend, garbage, global, metas) (None off the pair)."""
    g = global_kv(seed)
    backend = garbage = None
    if rank == 0:
        backend = kv_backend(kv_layouts(1, 1, LAYERS, HEADS)[0], g.clone(), "p0", **kw)
    elif rank == 1:
        garbage = random_tensor(g.shape, g.dtype, seed=300)
        backend = kv_backend(kv_layouts(1, 1, LAYERS, HEADS, rank_base=1)[0], garbage.clone(), "d1", **kw)
    return backend, garbage, g, exchange(None if backend is None else backend.export_meta())


def scenario_empty(rank: int) -> Optional[dict]:
    """Empty requests complete at once with no operation posted (the next transfer still pairs)."""
    backend, garbage, g, metas = _pair(rank, seed=21)
    result = None
    try:
        if rank == 0:
            empty = backend.begin_push_blocks(metas[1], [])
            real = backend.begin_push_blocks(metas[1], SRC_IDS)
            real.wait()
            result = {"empty_completed": isinstance(empty, CompletedHandle) and empty.poll()}
        elif rank == 1:
            empty = backend.begin_pull_blocks(metas[0], [], [])
            real = backend.begin_pull_blocks(metas[0], SRC_IDS, DST_IDS)
            real.wait()
            sibling = backend.new_registered_buffer(memory_buffer=torch.zeros(3, POOL_BLOCKS, 5),
                                                    expected_num_blocks=POOL_BLOCKS)
            sibling_meta = sibling.export_meta()
            result = {"empty_completed": isinstance(empty, CompletedHandle) and empty.poll(),
                      "sibling_shares_transport": sibling._transport is backend._transport
                      and sibling._staging is backend._staging and sibling_meta["nccl_rank"] == 1
                      and sibling_meta["transport"] == "nccl",
                      **check_kv(backend.memory_buffer, garbage, g[:, :, :], SRC_IDS, DST_IDS)}
            sibling.close()
    finally:
        exchange(None)
        if backend is not None:
            backend.close()
    return result


def scenario_misorder(rank: int) -> Optional[dict]:
    """The prefill pushes B then A, the decode posted A then B: both receives fail, nothing is written."""
    backend, garbage, g, metas = _pair(rank, seed=22)
    result = None
    try:
        if rank == 0:
            wait_all([backend.begin_push_blocks(metas[1], SRC_IDS_B), backend.begin_push_blocks(metas[1], SRC_IDS)])
            result = {"sends_done": True}
        elif rank == 1:
            handles = [backend.begin_pull_blocks(metas[0], SRC_IDS, DST_IDS),
                       backend.begin_pull_blocks(metas[0], SRC_IDS_B, DST_IDS_B)]
            errors = []
            for h in handles:
                try:
                    h.wait()
                    errors.append(None)
                except TransferError as exc:
                    errors.append((str(exc), h.storage_safe))
            result = {"errors": errors, "pool_untouched": same(backend.memory_buffer, garbage)}
    finally:
        exchange(None)
        if backend is not None:
            backend.close()
    return result


def scenario_timeout_then_recover(rank: int) -> Optional[dict]:
    """The decode's receive times out (the prefill is late); the pair is refused while that receive is
    still posted; the late push lands in the set-aside staging; then the pair works again."""
    backend, garbage, g, metas = _pair(rank, seed=23, timeout_s=1.0)
    result: Optional[dict] = None
    try:
        if rank == 1:
            t0 = time.monotonic()
            handle = backend.begin_pull_blocks(metas[0], SRC_IDS, DST_IDS)
            try:
                handle.wait()
                timed_out = False
            except TransferCancelledError:  # safe: the receive lands in set-aside staging, never the pool
                timed_out = True
            result = {"timed_out": timed_out, "elapsed_s": time.monotonic() - t0, "storage_safe": handle.storage_safe,
                      "pool_untouched": same(backend.memory_buffer, garbage)}
            try:
                backend.begin_pull_blocks(metas[0], SRC_IDS_B, DST_IDS_B)
                result["refused_while_posted"] = None
            except TransferError as exc:
                result["refused_while_posted"] = str(exc)
        exchange(None)  # the decode has given up; now the prefill pushes the late request
        if rank == 0:
            backend.begin_push_blocks(metas[1], SRC_IDS).wait()
        exchange(None)
        if rank == 1:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the set-aside receive settles once its waiter saw the message
                try:
                    handle = backend.begin_pull_blocks(metas[0], SRC_IDS_B, DST_IDS_B)
                    break
                except TransferError:
                    time.sleep(0.05)
            handle.wait(5)
            result["late_push_not_written"] = same(backend.memory_buffer[:, :, torch.tensor(DST_IDS)],
                                                   garbage[:, :, torch.tensor(DST_IDS)])
            result.update({f"recovered_{k}": v for k, v in
                           check_kv(backend.memory_buffer, garbage, g, SRC_IDS_B, DST_IDS_B).items()})
        elif rank == 0:
            backend.begin_push_blocks(metas[1], SRC_IDS_B).wait(10)
    finally:
        exchange(None)
        if backend is not None:
            backend.close()
    return result


# --- a peer killed mid-transfer (its own world: the dead rank breaks collectives) ------------------------
def scenario_killed_peer(rank: int) -> Optional[dict]:
    """Rank 1 is SIGKILLed while rank 0 waits for its push and rank 2's push to it is in flight.

    Rank 1 posts nothing (a Gloo send completes only once its receive is posted, so
    rank 2's push is certainly in flight). Rank 0 (receiving from rank 1) and rank 2
    (pushing to rank 1) must each fail with a
    ``TransferError`` carrying Gloo's error, well within their timeout, pools untouched.
    """
    big = (2, 2, 64, 16, 4, 128)  # 33.5 MB of fp32 per pool
    pool = random_tensor(big, torch.float32, seed=400 + rank)
    backend = NcclBackend(f"r{rank}", pool.clone(), 64, timeout_s=TIMEOUT_S)
    metas = exchange(backend.export_meta())
    ids = list(range(64))
    if rank == 1:
        dist.barrier()
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    handle = backend.begin_pull_blocks(metas[1], ids, ids) if rank == 0 else backend.begin_push_blocks(metas[1], ids)
    dist.barrier()
    t0 = time.monotonic()
    try:
        handle.wait()
        error = None
    except TransferError as exc:
        error = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - t0
    try:  # the pair is dead for good: a new transfer is refused before anything is posted
        backend.begin_pull_blocks(metas[1], ids, ids) if rank == 0 else backend.begin_push_blocks(metas[1], ids)
        refused = None
    except TransferError as exc:
        refused = str(exc)
    return {"error": error, "elapsed_s": elapsed, "storage_safe": handle.storage_safe,
            "pool_untouched": same(backend.memory_buffer, pool), "refused_after": refused}


SCENARIOS: dict[str, Callable[[int], Optional[dict]]] = {
    name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")
}


# --- process plumbing --------------------------------------------------------------------------------
def rank_main(rank: int, world_size: int, init_file: str, names: list[str], out: Any, pg_backend: str = "gloo") -> None:
    global DEVICE
    torch.set_num_threads(1)
    if "nccl" in pg_backend:
        DEVICE = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(pg_backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    for name in names:
        try:
            out.put((name, rank, SCENARIOS[name](rank)))
        except BaseException:
            out.put((name, rank, {"exception": traceback.format_exc()}))
    out.put(("__exit__", rank, None))
    out.close()
    out.join_thread()  # flush the queue's feeder thread before leaving without teardown
    os._exit(0)  # no teardown: a dead peer must not make process-group shutdown hang


def run_world(world_size: int, names: list[str], timeout_s: float = 90.0,
              pg_backend: str = "gloo") -> dict[str, dict[int, Any]]:
    """Run ``names`` on a fresh world; ``{scenario: {rank: result}}``. Kills only the processes it started."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=rank_main, args=(r, world_size, init_file, names, out, pg_backend), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[str, dict[int, Any]] = {}
        exited: set[int] = set()
        deadline = time.monotonic() + timeout_s
        try:
            while len(exited) < world_size and time.monotonic() < deadline:
                try:
                    name, rank, value = out.get(timeout=0.2)
                except queue_mod.Empty:
                    dead = {i for i, p in enumerate(procs) if not p.is_alive()}
                    if dead - exited and out.empty():
                        exited |= dead  # killed on purpose (or crashed): it reports nothing more
                    continue
                if name == "__exit__":
                    exited.add(rank)
                else:
                    results.setdefault(name, {})[rank] = value
        finally:
            for p in procs:
                p.join(timeout=2)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=2)
    return results
