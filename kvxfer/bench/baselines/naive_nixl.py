"""The naive-NIXL baseline: the reference implementation's way of pulling KV blocks.

Per request it builds, in Python, one descriptor per (block, layer plane) on each
side, turns both lists into NIXL descriptor lists and calls ``initialize_xfer``
(which prepares them again, every request), posts, and polls. It uses the raw
``nixl._api.nixl_agent`` directly, in two OS processes, with the same pools, ids
and verification as the kvxfer sweep, so the difference between the two is the
descriptor work, not the setup.
"""

from __future__ import annotations

import gc
import itertools
import time
from typing import Any, Iterable, Optional

import numpy as np
import torch

from kvxfer.bench.config import BenchConfig, Point
from kvxfer.bench.results import PointResult, Unavailable
from kvxfer.bench.source import READ_DONE_POLL_S, ChildSource, agent_name
from kvxfer.bench.sweep import POLL_S, OnPoint
from kvxfer.harness.loopback import SENTINEL, LoopbackConfig, blocks_digest, make_pool, untouched

NAME = "naive-nixl"


def availability() -> Optional[Unavailable]:
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as exc:  # any import failure means "cannot run here"
        return Unavailable(NAME, f"nixl is not importable: {type(exc).__name__}: {exc} (pip install 'kvxfer[nixl]')")
    return None


def _new_agent(name: str) -> Any:
    from nixl._api import nixl_agent

    return nixl_agent(name)


def _geometry(cfg: LoopbackConfig, pool: torch.Tensor) -> dict[str, int]:
    slice_bytes = cfg.tokens_per_block * cfg.num_heads * cfg.head_dim * pool.element_size()
    return {"base": pool.data_ptr(), "planes": 2 * cfg.num_layers, "slice": slice_bytes,
            "plane_stride": cfg.pool_blocks * slice_bytes}


class NaiveNixlSourceRole:
    """Source process: a raw agent, one registered pool, notifications as read-done."""

    def __init__(self) -> None:
        self.agent: Any = None
        self.pool: Optional[torch.Tensor] = None
        self.cfg: Optional[LoopbackConfig] = None
        self.reg: Any = None

    def setup(self, cfg: LoopbackConfig, name: str, src_tp: int = 1) -> dict[str, Any]:
        if src_tp != 1:
            raise ValueError("the naive-NIXL baseline measures plain (non-reshard) pulls only")
        self.release()
        self.cfg, self.pool = cfg, make_pool(cfg, random_seed=cfg.seed + 1)
        self.agent = _new_agent(name)
        self.reg = self.agent.register_memory(self.pool)
        return {"agent_metadata": self.agent.get_agent_metadata(), "name": name, **_geometry(cfg, self.pool)}

    def digest(self, ids: list[int]) -> str:
        assert self.cfg is not None and self.pool is not None
        return blocks_digest(self.pool, self.cfg.pool_blocks, np.asarray(ids, dtype=np.int64))

    def await_read_done(self, request_id: Any, timeout_s: float) -> float:
        want = str(request_id).encode()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for messages in self.agent.get_new_notifs().values():
                if want in messages:
                    return time.monotonic()
            time.sleep(READ_DONE_POLL_S)
        raise TimeoutError(f"no NIXL notification for request {request_id!r} within {timeout_s}s")

    def stats(self) -> dict[str, int]:
        return {}

    def release(self) -> None:
        if self.agent is not None and self.reg is not None:
            self.agent.deregister_memory(self.reg)
        self.agent = self.reg = self.pool = self.cfg = None


def naive_descriptors(geo: dict[str, int], ids: np.ndarray) -> list[tuple[int, int, int]]:
    """One ``(addr, len, dev)`` per (block, plane), in Python, as the reference builds them."""
    out = []
    for block in ids.tolist():
        for plane in range(geo["planes"]):
            out.append((geo["base"] + plane * geo["plane_stride"] + block * geo["slice"], geo["slice"], 0))
    return out


def run(cfg: BenchConfig, points: Iterable[Point], on_point: Optional[OnPoint] = None) -> list[PointResult]:
    """Measure every point with the naive path; per-point errors are recorded, not raised."""
    results: list[PointResult] = []
    source = ChildSource(timeout_s=max(cfg.timeout_s, 60.0), role_cls=NaiveNixlSourceRole)
    request_ids = itertools.count(1)
    try:
        plain = [p for p in points if not p.reshard]
        for size, group in itertools.groupby(plain, key=lambda p: p.slice_bytes):
            pool_cfg = cfg.pool_config("local", size)
            agent = reg = peer = None
            try:
                remote = source.setup(pool_cfg, agent_name("naive-src", str(size)))
                pool = make_pool(pool_cfg, random_seed=None)
                agent = _new_agent(agent_name("naive-dst", str(size)))
                reg = agent.register_memory(pool)
                peer = agent.add_remote_agent(remote["agent_metadata"])
                local_geo = _geometry(pool_cfg, pool)
                for point in group:
                    res = _measure(cfg, point, pool_cfg, source, agent, peer, remote, local_geo, pool, request_ids)
                    results.append(res)
                    if on_point:
                        on_point(res)
            except Exception as exc:
                for point in group:
                    res = PointResult(NAME, "baseline", point.slice_bytes, point.num_blocks, point.pattern)
                    res.error = f"setup: {type(exc).__name__}: {exc}"
                    results.append(res)
                    if on_point:
                        on_point(res)
            finally:
                _teardown(agent, reg, peer)
    finally:
        source.close()
    return results


def _teardown(agent: Any, reg: Any, peer: Optional[str]) -> None:
    """Release the agent now, while the interpreter is whole: a NIXL agent left to
    interpreter shutdown can crash the process on exit."""
    if agent is None:
        return
    try:
        if peer is not None:
            agent.remove_remote_agent(peer)
        if reg is not None:
            agent.deregister_memory(reg)
    finally:
        del agent
        gc.collect()


def _measure(cfg: BenchConfig, point: Point, pool_cfg: LoopbackConfig, source: ChildSource, agent: Any, peer: str,
             remote: dict[str, Any], local_geo: dict[str, int], pool: torch.Tensor, request_ids: Iterable[int]) -> PointResult:
    res = PointResult(NAME, "baseline", point.slice_bytes, point.num_blocks, point.pattern)
    res.extra["two_process"] = True
    ids = iter(request_ids)
    try:
        for repeat in range(cfg.warmup + cfg.repeats):
            measured, verify = repeat >= cfg.warmup, repeat == cfg.warmup
            src_ids, dst_ids = cfg.request_config(pool_cfg, point, repeat).block_ids()
            digest = None
            if verify:
                pool.view(torch.uint8).view(-1).fill_(SENTINEL)
                digest = source.digest(src_ids)
            request_id = next(ids)
            source.expect(request_id, cfg.timeout_s)
            t0 = time.perf_counter()
            remote_descs = agent.get_xfer_descs(naive_descriptors(remote, src_ids), "DRAM")
            local_descs = agent.get_xfer_descs(naive_descriptors(local_geo, dst_ids), "DRAM")
            handle = agent.initialize_xfer("READ", local_descs, remote_descs, peer, str(request_id).encode())
            t1 = time.perf_counter()
            state = agent.transfer(handle)
            t2 = time.perf_counter()
            deadline = time.monotonic() + cfg.timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"naive NIXL read not done within {cfg.timeout_s}s")
                time.sleep(POLL_S)  # the same polling as the kvxfer backends get
                state = agent.check_xfer_state(handle)
            t3 = time.perf_counter()
            landed_at = time.monotonic()
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer state {state}")
            seen_at = source.read_done_at(request_id, cfg.timeout_s)
            res.bytes = int(src_ids.size) * local_geo["planes"] * local_geo["slice"]
            res.raw_descriptors = res.descriptors = int(src_ids.size) * local_geo["planes"]
            if verify:
                same = blocks_digest(pool, pool_cfg.pool_blocks, dst_ids) == digest
                res.verified = same and untouched(pool, pool_cfg.pool_blocks, dst_ids)
                if not res.verified:
                    raise RuntimeError("verification failed: naive NIXL read the wrong bytes")
            if measured:
                res.samples.add(build_ms=(t1 - t0) * 1e3, post_ms=(t2 - t1) * 1e3, transfer_ms=(t3 - t0) * 1e3,
                                read_done_ms=(seen_at - landed_at) * 1e3)
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res.summarize()


__all__ = ["NAME", "availability", "run", "naive_descriptors", "NaiveNixlSourceRole"]
