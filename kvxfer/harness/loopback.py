"""``kvxfer loopback``: a real prefill -> decode KV handoff on one machine.

Two OS processes (one for the ``local`` backend, which cannot cross processes):
the prefill side fills a KV pool ``[2, L, B, T, H, d]`` with random bytes and
exports its meta; the decode side pulls a request's blocks (scattered ids by
default) into its own pool, verifies every byte (a digest of the pulled slices,
plus a check that no other destination block changed), and the prefill side
waits for the read-done notification before it frees the blocks. Any mismatch
or missing notification makes the run fail.

A push backend (``nccl``) runs in Megatron's push order instead: both processes
join one Gloo process group (``kvxfer.backends.process_group.join_group``), the decode side
posts its receives (``begin_pull_blocks``) and sends its meta to the prefill, the
prefill pushes (``begin_push_blocks(decode_meta, src_ids, request_id=...)``), both
poll to completion; the prefill's read-done is its push completing
(``drain_read_done``). The decode verifies exactly as for a pull.

The two processes sign and check each other's metas with a key of their own: a fresh
0600 secret file per run (``kvxfer.security.auth.new_secret_file``), its path handed to
both, removed afterwards, unless ``$KVXFER_SECRET_FILE`` already names the cluster's. The
first command a new user runs must not warn that its own metas are UNAUTHENTICATED.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.backends.base import KVTransportBackend
from kvxfer.plan.descriptors import plan_block_copies
from kvxfer.errors import KVXferError, TransferError
from kvxfer.harness.loopback_config import LoopbackConfig
from kvxfer.backends.process_group import DECODE_RANK, PREFILL_RANK, GroupSpec, host_group, join_group, leave_group
from kvxfer.harness.child import Child, ChildError, Pipe
from kvxfer.meta.geometry import parse_geometry_meta
from kvxfer.plan.geometry import dtype_from_name
from kvxfer.security.auth import SECRET_FILE_ENV, load_secret, new_secret_file, remove_secret_file

SENTINEL = 0xA5  # what the decode pool holds before the pull
CONTROL_TIMEOUT_S = 120.0


@dataclass
class LoopbackResult:
    config: LoopbackConfig
    bytes_moved: int = 0
    raw_descriptors: int = 0
    descriptors: int = 0
    plan_ms: float = 0.0
    transfer_s: float = 0.0
    read_done_s: float = 0.0
    verified: bool = False
    untouched_ok: bool = False
    read_done_ok: bool = False
    freed_blocks: int = 0
    error: Optional[str] = None
    direction: str = "pull"  # "push": the prefill sent, the decode posted receives
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.transfer_s / 1e9 if self.transfer_s else 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.verified and self.untouched_ok and self.read_done_ok

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(gbps=self.gbps, ok=self.ok)
        return out


def make_pool(cfg: LoopbackConfig, random_seed: Optional[int]) -> torch.Tensor:
    """A pool of ``cfg.pool_shape``: random bytes from ``random_seed``, or all ``SENTINEL`` when None."""
    pool = torch.empty(cfg.pool_shape, dtype=dtype_from_name(cfg.dtype))
    raw = pool.view(torch.uint8).view(-1)
    if random_seed is None:
        raw.fill_(SENTINEL)
    else:
        rng = np.random.default_rng(random_seed)
        raw.copy_(torch.frombuffer(bytearray(rng.bytes(raw.numel())), dtype=torch.uint8))
    return pool if cfg.device == "cpu" else pool.to(cfg.device)


def _slices(pool: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The pool as [num_outer, num_blocks, slice bytes]."""
    return pool.view(torch.uint8).view(pool.shape[0] * pool.shape[1], num_blocks, -1)


def blocks_digest(pool: torch.Tensor, num_blocks: int, ids: np.ndarray) -> str:
    """SHA-256 of the given blocks' slices, in id order: equal digests mean equal bytes."""
    picked = _slices(pool, num_blocks)[:, torch.from_numpy(ids).to(pool.device)].cpu().contiguous()
    return hashlib.sha256(picked.numpy().data).hexdigest()


def untouched(pool: torch.Tensor, num_blocks: int, written: np.ndarray) -> bool:
    others = np.setdiff1d(np.arange(num_blocks), written)
    return bool((_slices(pool, num_blocks)[:, torch.from_numpy(others).to(pool.device)] == SENTINEL).all())


def make_backend(cfg: LoopbackConfig, role: str, pool: torch.Tensor, agent_name: Optional[str] = None,
                 key_file: Optional[str] = None) -> KVTransportBackend:
    """Register ``pool`` (of ``cfg``'s shape) with ``cfg.backend``; the agent is ``loopback-<role>`` unless named.

    ``key_file``: the metas' key (else ``$KVXFER_SECRET_FILE``'s, the backend's default)."""
    cls = construct_kv_transfer_backend_class(cfg.backend)
    return cls(
        agent_name or f"loopback-{role}", pool, cfg.pool_blocks,
        heads_per_partition=cfg.num_heads, head_dim=cfg.head_dim, tokens_per_block=cfg.tokens_per_block,
        timeout_s=cfg.timeout_s, meta_key=load_secret(secret_file=key_file) if key_file else None,
    )


@contextmanager
def run_key_file() -> Iterator[Optional[str]]:
    """A fresh key file for one run's two processes (removed after it); ``None`` when
    ``$KVXFER_SECRET_FILE`` names one already (both processes read it from there)."""
    if os.environ.get(SECRET_FILE_ENV):
        yield None
        return
    path = new_secret_file()
    try:
        yield path
    finally:
        remove_secret_file(path)


class _Prefill:
    """The prefill role: owns the source pool, pins the request's blocks until read-done."""

    def __init__(self, cfg: LoopbackConfig, key_file: Optional[str] = None) -> None:
        self.cfg = cfg
        self.src_ids, _ = cfg.block_ids()
        self.pool = make_pool(cfg, random_seed=cfg.seed + 1)
        self.backend = make_backend(cfg, "prefill", self.pool, key_file=key_file)
        self.pinned: set[int] = set(int(b) for b in self.src_ids)

    def offer(self) -> dict[str, Any]:
        return {
            "meta": self.backend.export_meta(),
            "src_ids": self.src_ids.tolist(),
            "digest": blocks_digest(self.pool, self.cfg.pool_blocks, self.src_ids),
            "request_id": 1,
        }

    def await_read_done(self, request_id: int) -> tuple[bool, float, int]:
        """Wait for the transport's read-done, then free the pinned blocks."""
        start = time.monotonic()
        deadline = start + self.cfg.timeout_s
        seen: list[Any] = []
        while time.monotonic() < deadline:
            seen += self.backend.drain_read_done()
            if request_id in seen:
                break
            if any(f.request_id == request_id for f in self.backend.drain_read_failed()):
                break
            time.sleep(1e-3)
        ok = seen.count(request_id) == 1
        freed = len(self.pinned) if ok else 0
        if ok:
            self.pinned.clear()
        return ok, time.monotonic() - start, freed

    def close(self) -> None:
        self.backend.close()


def _prefill_process(pipe: Pipe, cfg: LoopbackConfig, key_file: Optional[str] = None) -> None:
    """Child process body: offer the blocks, wait for read-done, report. Failures reach
    the parent through the harness as this process's own error."""
    prefill = _Prefill(cfg, key_file)
    try:
        pipe.send("offer", prefill.offer())
        if not pipe.poll(CONTROL_TIMEOUT_S):
            raise TimeoutError(f"decode did not report back within {CONTROL_TIMEOUT_S:.0f}s")
        kind, payload = pipe.recv()
        if kind != "pulled":
            return
        ok, latency, freed = prefill.await_read_done(payload["request_id"])
        pipe.send("read_done", {"ok": ok, "latency_s": latency, "freed": freed})
    finally:
        prefill.close()


def _push_prefill_process(pipe: Pipe, cfg: LoopbackConfig, spec: GroupSpec, key_file: Optional[str] = None) -> None:
    """Child process body for a push backend: join the group, offer, push when the decode asks, report."""
    join_group(spec, PREFILL_RANK)
    try:
        prefill = _Prefill(cfg, key_file)
        try:
            pipe.send("offer", prefill.offer())
            if not pipe.poll(CONTROL_TIMEOUT_S):
                raise TimeoutError(f"decode did not ask for the push within {CONTROL_TIMEOUT_S:.0f}s")
            kind, payload = pipe.recv()
            if kind != "push":
                return
            start = time.monotonic()
            handle = prefill.backend.begin_push_blocks(payload["meta"], prefill.src_ids,
                                                       request_id=payload["request_id"])
            handle.wait()
            ok, _, freed = prefill.await_read_done(payload["request_id"])
            pipe.send("read_done", {"ok": ok, "latency_s": time.monotonic() - start, "freed": freed})
        finally:
            prefill.close()
    finally:
        leave_group()


def _pull_and_verify(cfg: LoopbackConfig, decode: KVTransportBackend, pool: torch.Tensor,
                     offer: dict[str, Any], result: LoopbackResult,
                     ask_push: Optional[Callable[[], None]] = None) -> None:
    """Post the read (a pull) or the receives (a push: then ``ask_push`` tells the prefill to push),
    wait, verify. ``transfer_s`` runs from posting to every byte landed in the decode pool."""
    _, dst_ids = cfg.block_ids()
    src_ids = np.asarray(offer["src_ids"], dtype=np.int64)
    t0 = time.perf_counter()
    plan = plan_block_copies(parse_geometry_meta(offer["meta"]).geometry, decode.geometry, src_ids, dst_ids)
    result.plan_ms = (time.perf_counter() - t0) * 1e3
    result.raw_descriptors, result.descriptors = plan.raw_descriptors, plan.num_descriptors
    result.bytes_moved = plan.total_bytes
    t0 = time.perf_counter()
    handle = decode.begin_pull_blocks(offer["meta"], src_ids, dst_ids, request_id=offer["request_id"])
    if ask_push is not None:
        ask_push()
    handle.wait()
    result.transfer_s = time.perf_counter() - t0
    result.verified = blocks_digest(pool, cfg.pool_blocks, dst_ids) == offer["digest"]
    result.untouched_ok = untouched(pool, cfg.pool_blocks, dst_ids)


#: Called with a short description of each phase as the run enters it (the CLI shows it as progress).
OnPhase = Callable[[str], None]


logger = logging.getLogger(__name__)


def _no_phase(_: str) -> None:
    pass


def run_loopback(cfg: LoopbackConfig, on_phase: Optional[OnPhase] = None) -> LoopbackResult:
    """Run one handoff; never raises for transfer problems, they land in ``result.error``.

    A failure in the prefill child lands there as the child's own message
    (``prefill: <Type>: <what>``); ``result.extra["child_traceback"]`` keeps its traceback.
    """
    report_phase = on_phase or _no_phase

    def phase(text: str) -> None:
        logger.info("loopback on %s: %s", cfg.backend, text)
        report_phase(text)

    result = LoopbackResult(cfg)
    decode = None
    try:
        backend_cls = construct_kv_transfer_backend_class(cfg.backend)
        if backend_cls.is_push:
            result.direction = "push"
            with run_key_file() as key_file:
                _run_push(cfg, result, phase, key_file)
            return result
        phase("allocating the decode pool")
        pool = make_pool(cfg, random_seed=None)
        if not backend_cls.reads_other_processes:  # its peer must be in this process (``local``)
            phase(f"registering the decode pool with {cfg.backend}")
            decode = make_backend(cfg, "decode", pool)
            _run_in_process(cfg, decode, pool, result, phase)
        else:
            with run_key_file() as key_file:
                phase(f"registering the decode pool with {cfg.backend}")
                decode = make_backend(cfg, "decode", pool, key_file=key_file)
                _run_two_processes(cfg, decode, pool, result, phase, key_file)
    except ChildError as exc:
        result.error = str(exc)
        result.extra["child_traceback"] = exc.child_traceback
    except (KVXferError, TransferError, RuntimeError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if decode is not None:
            decode.close()
    return result


def _run_in_process(cfg: LoopbackConfig, decode: KVTransportBackend, pool: torch.Tensor, result: LoopbackResult,
                    phase: OnPhase) -> None:
    phase("preparing the prefill pool")
    prefill = _Prefill(cfg)
    try:
        offer = prefill.offer()
        phase(f"pulling {cfg.request_blocks} blocks")
        _pull_and_verify(cfg, decode, pool, offer, result)
        phase("waiting for read-done")
        result.read_done_ok, result.read_done_s, result.freed_blocks = prefill.await_read_done(offer["request_id"])
    finally:
        prefill.close()


def _run_two_processes(cfg: LoopbackConfig, decode: KVTransportBackend, pool: torch.Tensor, result: LoopbackResult,
                       phase: OnPhase, key_file: Optional[str] = None) -> None:
    phase("starting the prefill process")
    with Child("prefill", _prefill_process, cfg, key_file) as prefill:
        _, offer = prefill.recv(CONTROL_TIMEOUT_S, expected="offer")
        phase(f"pulling {cfg.request_blocks} blocks")
        try:
            _pull_and_verify(cfg, decode, pool, offer, result)
        except BaseException:
            try:
                prefill.send("abort", {})
            except ChildError:
                pass  # the prefill side is already gone; the pull's own error says more
            raise
        prefill.send("pulled", {"request_id": offer["request_id"]})
        phase("waiting for read-done")
        _, done = prefill.recv(CONTROL_TIMEOUT_S, expected="read_done")
        result.read_done_ok, result.read_done_s, result.freed_blocks = done["ok"], done["latency_s"], done["freed"]


def _run_push(cfg: LoopbackConfig, result: LoopbackResult, phase: OnPhase, key_file: Optional[str] = None) -> None:
    """A push backend: both processes in one Gloo group; decode posts receives and asks, prefill pushes."""
    phase("starting the prefill process")
    store, spec = host_group(timeout_s=max(cfg.timeout_s, 60.0))
    with Child("prefill", _push_prefill_process, cfg, spec, key_file) as prefill:
        phase("joining the process group")
        decode = None
        try:
            join_group(spec, DECODE_RANK, store)
            phase("allocating the decode pool")
            pool = make_pool(cfg, random_seed=None)
            phase(f"registering the decode pool with {cfg.backend}")
            decode = make_backend(cfg, "decode", pool, key_file=key_file)
            _, offer = prefill.recv(CONTROL_TIMEOUT_S, expected="offer")
            ask = {"meta": decode.export_meta(), "request_id": offer["request_id"]}
            phase(f"receiving {cfg.request_blocks} pushed blocks")
            _pull_and_verify(cfg, decode, pool, offer, result, ask_push=lambda: prefill.send("push", ask))
            phase("waiting for the push to complete at the prefill")
            _, done = prefill.recv(CONTROL_TIMEOUT_S, expected="read_done")
            result.read_done_ok, result.read_done_s, result.freed_blocks = done["ok"], done["latency_s"], done["freed"]
        except BaseException:
            try:  # a prefill still waiting for the push request leaves at once (one that pushed ignores it)
                prefill.send("abort", {})
            except ChildError:
                pass  # the prefill side is already gone; our own error says more
            raise
        finally:
            if decode is not None:
                decode.close()
            leave_group()
            del store
