"""The prefill (source) side of a bench run, in a child process or in this one.

The decode side (the bench process) drives it through a small command set:
``setup`` (allocate a random pool, register it, return the meta), ``digest`` (a
SHA-256 of some blocks, to verify what the reader got), ``await`` (watch
``drain_read_done`` until a request id shows up and report *when*, on the shared
monotonic clock), ``close``. Network backends get a real second OS process
(``kvxfer.harness.child``, the harness loopback and soak use too); the in-process ``local`` backend
gets the same interface without the process.

A push backend (``nccl``) reverses who acts: the decode posts its receives and then
sends ``push`` (request id, source ids, its meta) -- Megatron's order --, the source
pushes with ``begin_push_blocks`` and answers, as ``await`` does, with the moment its
push completed (its read-done). Both processes are then one torch.distributed
process group (``kvxfer.backends.process_group.join_group``), joined before the first command.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import replace
from typing import Any, Optional

import numpy as np
import torch

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.backends.base import KVTransportBackend
from kvxfer.backends.process_group import DECODE_RANK, PREFILL_RANK, GroupSpec, host_group, join_group, leave_group
from kvxfer.harness.child import ERROR, Child, ChildFailure, Pipe
from kvxfer.harness.loopback import LoopbackConfig, make_backend, make_pool

CONTROL_TIMEOUT_S = 120.0
#: The source's read-done poll: fine enough for a 0.1 ms figure, coarse enough not to
#: take CPU from the transfer it is measuring.
READ_DONE_POLL_S = 100e-6


def shard_backend(cfg: LoopbackConfig, pool: torch.Tensor, agent_name: str, *, tp_size: int, tp_rank: int,
                  num_heads_global: int, global_rank: int) -> KVTransportBackend:
    """A backend whose pool is one TP rank's head slice of ``[2, L, B, T, H, d]`` (it exports a layout)."""
    cls = construct_kv_transfer_backend_class(cfg.backend)
    return cls(agent_name, pool, cfg.pool_blocks, tp_size=tp_size, tp_rank=tp_rank,
               num_kv_heads_global=num_heads_global, heads_per_partition=num_heads_global // tp_size,
               head_dim=cfg.head_dim, tokens_per_block=cfg.tokens_per_block, global_rank=global_rank, pp_size=1,
               pp_rank=0, num_layers_global=cfg.num_layers, timeout_s=cfg.timeout_s)


def request_digest(pools: list[torch.Tensor], ids: np.ndarray) -> str:
    """SHA-256 of the blocks ``ids`` of the whole KV (TP ranks' head slices joined), in pool byte order.

    For one pool this equals ``kvxfer.harness.loopback.blocks_digest``; for TP ranks it is the
    digest the decode rank holding every head must reproduce.
    """
    index = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    joined = torch.cat([pool[:, :, index] for pool in pools], dim=4).contiguous()
    return hashlib.sha256(joined.view(torch.uint8).numpy().data).hexdigest()


class SourceRole:
    """Owns the registered source pool(s) of one slice size; the same code runs in either process.

    ``src_tp == 1``: one plain pool. ``src_tp > 1``: one pool per TP rank, each holding
    ``H / src_tp`` heads and exporting a shard layout, so the reader reshards.
    """

    def __init__(self) -> None:
        self.cfg: Optional[LoopbackConfig] = None
        self.backends: list[KVTransportBackend] = []
        self.pools: list[torch.Tensor] = []

    def setup(self, cfg: LoopbackConfig, agent_name: str, src_tp: int = 1) -> list[dict[str, Any]]:
        self.release()
        self.cfg = cfg
        for rank in range(src_tp):
            if src_tp == 1:
                pool = make_pool(cfg, random_seed=cfg.seed + 1)
                backend = make_backend(cfg, "prefill", pool, agent_name=agent_name)
            else:
                rank_cfg = replace(cfg, num_heads=cfg.num_heads // src_tp)
                pool = make_pool(rank_cfg, random_seed=cfg.seed + 1 + rank)
                backend = shard_backend(rank_cfg, pool, f"{agent_name}-tp{rank}", tp_size=src_tp, tp_rank=rank,
                                        num_heads_global=cfg.num_heads, global_rank=rank)
            self.pools.append(pool)
            self.backends.append(backend)
        return [backend.export_meta() for backend in self.backends]

    def digest(self, ids: list[int]) -> str:
        assert self.pools, "setup() first"
        return request_digest(self.pools, np.asarray(ids, dtype=np.int64))

    def await_read_done(self, request_id: Any, timeout_s: float) -> float:
        """Poll every rank's read-done; return ``time.monotonic()`` when all have seen ``request_id``."""
        assert self.backends, "setup() first"
        deadline = time.monotonic() + timeout_s
        waiting = list(self.backends)
        while True:
            for backend in list(waiting):
                if request_id in backend.drain_read_done():
                    waiting.remove(backend)
                failed = [f for f in backend.drain_read_failed() if f.request_id == request_id]
                if failed:
                    raise RuntimeError(f"reader reported failure for request {request_id!r}: {failed[0].reason}")
            if not waiting:
                return time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no read-done for request {request_id!r} within {timeout_s}s")
            time.sleep(READ_DONE_POLL_S)

    def push(self, request_id: Any, ids: list[int], decode_meta: dict[str, Any], timeout_s: float) -> float:
        """A push backend: push blocks ``ids`` to the decode that sent ``decode_meta`` (it has posted
        its receives); return ``time.monotonic()`` when the push's read-done shows up."""
        assert self.backends, "setup() first"
        # TP ranks (reshard points: both in this process, so both at this process's rank of the group)
        # push in rank order, the order the decode posted its receives in; messages pair by post order
        handles = [backend.begin_push_blocks(decode_meta, ids, request_id=request_id) for backend in self.backends]
        deadline = time.monotonic() + timeout_s
        for handle in handles:
            while not handle.poll():
                if time.monotonic() > deadline:
                    handle.wait(0.0)  # raises the standard timeout
                time.sleep(READ_DONE_POLL_S)
        return self.await_read_done(request_id, max(deadline - time.monotonic(), 1.0))

    def stats(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for backend in self.backends:
            stats = getattr(backend, "stats", None)  # every backend on main has it; tolerate one that does not
            for key, value in (stats() if stats else {}).items():
                totals[key] = totals.get(key, 0) + value
        return totals

    def release(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends, self.pools, self.cfg = [], [], None


def _serve(pipe: Pipe, role_cls: type = SourceRole, group: Optional[GroupSpec] = None) -> None:
    """Child process body: execute commands on a ``role_cls()`` until ``close`` or the parent goes away.

    Any role with ``setup``/``digest``/``await_read_done``/``stats``/``release`` works
    (the naive-NIXL baseline brings its own). A failed command is answered with the
    harness's ``error`` message and the child goes on serving. With ``group`` (a push
    backend) the child first joins that process group as the prefill rank.
    """
    if group is not None:
        join_group(group, PREFILL_RANK)
    role = role_cls()
    try:
        while True:
            if not pipe.poll(CONTROL_TIMEOUT_S * 5):
                return  # the parent stopped talking to us: leave rather than linger
            command, args = pipe.recv()
            if command == "close":
                pipe.send("ok", role.stats())
                return
            try:
                if command == "setup":
                    value: Any = role.setup(*args)
                elif command == "digest":
                    value = role.digest(*args)
                elif command == "await":
                    value = role.await_read_done(*args)
                elif command == "push":
                    value = role.push(*args)
                else:
                    raise ValueError(f"unknown command {command!r}")
                pipe.send("ok", value)
            except Exception as exc:  # reported to the parent, which records it on the point
                pipe.send(ERROR, ChildFailure.from_exception("source", exc))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    finally:
        role.release()
        if group is not None:
            leave_group()


class SourceClient:
    """The source as the bench sees it. ``expect`` + ``read_done_at`` bracket one pull."""

    two_process = False

    def setup(self, cfg: LoopbackConfig, agent_name: str, src_tp: int = 1) -> list[dict[str, Any]]:
        raise NotImplementedError

    def digest(self, ids: np.ndarray) -> str:
        raise NotImplementedError

    def expect(self, request_id: int, timeout_s: float) -> None:
        """Start watching for ``request_id``'s read-done (call before posting the read)."""

    def read_done_at(self, request_id: int, timeout_s: float) -> float:
        raise NotImplementedError

    def push(self, request_id: int, ids: np.ndarray, decode_meta: dict[str, Any], timeout_s: float) -> None:
        """A push backend: ask the source to push (call after posting the receives); ``read_done_at`` answers."""
        raise NotImplementedError(f"{type(self).__name__} cannot push")

    def close(self) -> dict[str, int]:
        raise NotImplementedError


class InProcessSource(SourceClient):
    """For backends that cannot cross processes: the source role lives here."""

    def __init__(self) -> None:
        self.role = SourceRole()

    def setup(self, cfg: LoopbackConfig, agent_name: str, src_tp: int = 1) -> list[dict[str, Any]]:
        return self.role.setup(cfg, agent_name, src_tp)

    def digest(self, ids: np.ndarray) -> str:
        return self.role.digest(ids.tolist())

    def read_done_at(self, request_id: int, timeout_s: float) -> float:
        return self.role.await_read_done(request_id, timeout_s)

    def close(self) -> dict[str, int]:
        stats = self.role.stats()
        self.role.release()
        return stats


class ChildSource(SourceClient):
    """The source role in a spawned child process (``kvxfer.harness.child``); every call has a timeout."""

    two_process = True

    def __init__(self, timeout_s: float = CONTROL_TIMEOUT_S, role_cls: type = SourceRole, push: bool = False) -> None:
        store = group = None
        if push:  # the source joins as the prefill rank, this process as the decode rank
            store, group = host_group(timeout_s=timeout_s)
        self._child = Child("source", _serve, role_cls, group, join_timeout_s=10.0)
        self._timeout_s = timeout_s
        self.pid = self._child.pid
        self._pending_await: Optional[float] = None  # timeout of an ``await`` whose answer is unread
        self._in_group = False
        if group is not None:
            try:
                join_group(group, DECODE_RANK, store)
            except BaseException:
                self._child.close(timeout_s=0)
                raise
            self._in_group = True

    def _call(self, command: str, *args: Any, timeout_s: Optional[float] = None) -> Any:
        if self._pending_await is not None:  # a pull failed between expect and read_done_at: resync
            try:
                self.read_done_at(-1, self._pending_await)
            except (RuntimeError, TimeoutError):
                pass
        self._child.send(command, args)
        return self._reply(command, timeout_s)

    def _reply(self, command: str, timeout_s: Optional[float] = None) -> Any:
        """The child's answer; its failure raises ``ChildError`` (a ``RuntimeError``) with its own message."""
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        _, value = self._child.recv(timeout_s, expected="ok")
        return value

    def setup(self, cfg: LoopbackConfig, agent_name: str, src_tp: int = 1) -> Any:
        return self._call("setup", cfg, agent_name, src_tp)

    def digest(self, ids: np.ndarray) -> str:
        return self._call("digest", ids.tolist())

    def expect(self, request_id: int, timeout_s: float) -> None:
        self._child.send("await", (request_id, timeout_s))
        self._pending_await = timeout_s

    def read_done_at(self, request_id: int, timeout_s: float) -> float:
        self._pending_await = None
        return self._reply("await", timeout_s + 5.0)

    def push(self, request_id: int, ids: np.ndarray, decode_meta: dict[str, Any], timeout_s: float) -> None:
        self._child.send("push", (request_id, ids.tolist(), decode_meta, timeout_s))
        self._pending_await = timeout_s

    def close(self) -> dict[str, int]:
        stats: dict[str, int] = {}
        try:
            if self._child.is_alive():
                stats = self._call("close", timeout_s=10.0)
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        finally:
            self._child.close()
            if self._in_group:
                self._in_group = False
                leave_group()
        return stats


def open_source(backend: str, timeout_s: float) -> SourceClient:
    """A child-process source for network backends (in one process group with this one for a push
    backend), an in-process one for a backend that reads only its own process (``local``: the class's
    ``reads_other_processes``)."""
    cls = construct_kv_transfer_backend_class(backend)
    if not cls.reads_other_processes:
        return InProcessSource()
    return ChildSource(timeout_s=max(timeout_s, CONTROL_TIMEOUT_S), push=cls.is_push)


def agent_name(role: str, tag: str) -> str:
    """Agent names unique per process and pool (NIXL peers key on them)."""
    return f"kvxfer-bench-{role}-{os.getpid()}-{tag}"
