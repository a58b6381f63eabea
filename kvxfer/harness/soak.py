"""``kvxfer soak``: thousands of real handoffs, every byte verified, nothing leaked.

The prefill role behaves like an engine: for each request it allocates blocks
from its free list, writes fresh request-specific bytes into them, bumps their
generation counters, pins them and publishes a handoff; it frees (and later
reuses) them only when the transport reports read-done. The decode role reserves
destination blocks, pulls with the torn-read check, verifies every byte against
what that request's data must be, and frees. If any read-done came early, a
reused block would carry another request's bytes and verification would fail.

At the end both roles report what they still hold: pinned blocks, open handles,
registrations, resident memory growth.
"""

from __future__ import annotations

import logging
import resource
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.backends.base import KVTransportBackend, TransferHandle
from kvxfer.defaults import MAX_TIMEOUT_S, MIN_TIMEOUT_S, TRANSFER_TIMEOUT_S, bounded_float
from kvxfer.errors import BackendUnavailableError, KVXferError
from kvxfer.harness.child import Child, ChildError, Pipe
from kvxfer.harness.loopback import run_key_file
from kvxfer.handoff.generations import BlockGenerations, GenerationChecker

CONTROL_TIMEOUT_S = 60.0
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SoakConfig:
    backend: str = "local"
    handoffs: int = 2000
    in_flight: int = 8
    max_blocks: int = 16  # per request; sizes are uniform in [1, max_blocks]
    pool_blocks: int = 256
    num_layers: int = 2
    tokens_per_block: int = 4
    num_heads: int = 2
    head_dim: int = 64
    seed: int = 0
    timeout_s: float = TRANSFER_TIMEOUT_S

    def __post_init__(self) -> None:
        bounded_float("timeout_s", self.timeout_s, MIN_TIMEOUT_S, MAX_TIMEOUT_S, unit="seconds")

    @property
    def pool_shape(self) -> tuple[int, ...]:
        return (2, self.num_layers, self.pool_blocks, self.tokens_per_block, self.num_heads, self.head_dim)


@dataclass
class SoakReport:
    config: SoakConfig
    handoffs_done: int = 0
    bytes_verified: int = 0
    bytes_lost: int = 0  # bytes of requests that failed verification or never arrived
    mismatches: int = 0
    failures: list[str] = field(default_factory=list)
    prefill_pinned_at_end: int = -1
    decode_open_handles_at_end: int = -1
    decode_reserved_at_end: int = -1
    rss_growth_mib: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (not self.failures and self.mismatches == 0 and self.handoffs_done == self.config.handoffs
                and self.prefill_pinned_at_end == 0 and self.decode_open_handles_at_end == 0
                and self.decode_reserved_at_end == 0)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def request_bytes(cfg: SoakConfig, request_id: int, num_blocks: int, slice_bytes: int) -> torch.Tensor:
    """The bytes request ``request_id`` must carry, as ``[num_outer, num_blocks, slice_bytes]``.

    A fixed pseudo-random pattern shifted by the request id: every request's bytes
    differ from every other's at almost every position, so a block read after it
    was reused for another request cannot pass verification.
    """
    num_outer = 2 * cfg.num_layers
    pattern = _pattern(num_outer * cfg.max_blocks * slice_bytes, cfg.seed)[: num_outer * num_blocks * slice_bytes]
    shifted = (pattern + (request_id % 250 + 1)).remainder_(251).to(torch.uint8)
    return shifted.view(num_outer, num_blocks, slice_bytes)


_PATTERNS: dict[tuple[int, int], torch.Tensor] = {}


def _pattern(size: int, seed: int) -> torch.Tensor:
    if (size, seed) not in _PATTERNS:
        gen = torch.Generator().manual_seed(seed)
        _PATTERNS[(size, seed)] = torch.randint(0, 251, (size,), dtype=torch.int16, generator=gen)
    return _PATTERNS[(size, seed)]


def _slices(pool: torch.Tensor, cfg: SoakConfig) -> torch.Tensor:
    return pool.view(torch.uint8).view(2 * cfg.num_layers, cfg.pool_blocks, -1)


def _make_backend(cfg: SoakConfig, role: str, pool: torch.Tensor, key_file: Optional[str] = None) -> KVTransportBackend:
    """``key_file``: the metas' key for a two-process run (``loopback.run_key_file``), else the environment's."""
    from kvxfer.security.auth import load_secret

    cls = construct_kv_transfer_backend_class(cfg.backend)
    return cls(f"soak-{role}", pool, cfg.pool_blocks, timeout_s=cfg.timeout_s,
               meta_key=load_secret(secret_file=key_file) if key_file else None)


class SoakPrefill:
    """Allocates, writes, pins, publishes; frees only on read-done (or a failure report)."""

    def __init__(self, cfg: SoakConfig, key_file: Optional[str] = None) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed + 1)
        self.pool = torch.zeros(cfg.pool_shape, dtype=torch.bfloat16)
        self.backend = _make_backend(cfg, "prefill", self.pool, key_file)
        self.generations = BlockGenerations(self.backend)
        self.free: deque[int] = deque(int(b) for b in self.rng.permutation(cfg.pool_blocks))
        self.pinned: dict[Any, list[int]] = {}
        self.next_request = 0
        self.rss_start = _rss_mib()

    def can_publish(self) -> bool:
        return self.next_request < self.cfg.handoffs and len(self.pinned) < self.cfg.in_flight

    def publish(self) -> dict[str, Any]:
        n = int(self.rng.integers(1, self.cfg.max_blocks + 1))
        if len(self.free) < n:
            raise RuntimeError(f"prefill pool exhausted with {len(self.pinned)} requests pinned")
        ids = [self.free.popleft() for _ in range(n)]
        rid = self.next_request
        self.next_request += 1
        self.generations.bump(ids)  # new owner: a reader holding old counters must notice
        slices = _slices(self.pool, self.cfg)
        slices[:, torch.tensor(ids)] = request_bytes(self.cfg, rid, n, slices.shape[2])
        self.pinned[rid] = ids
        return {"request_id": rid, "src_ids": ids, "generations": self.generations.snapshot(ids)}

    def release_finished(self) -> int:
        finished = self.generations.drain_read_done() + [f.request_id for f in self.generations.drain_read_failed()]
        for rid in finished:
            ids = self.pinned.pop(rid, None)  # releasing twice is harmless
            if ids is not None:
                self.generations.bump(ids)
                self.free.extend(ids)
        return len(finished)

    def metas(self) -> dict[str, Any]:
        return {"kv": self.backend.export_meta(), "generations": self.generations.export_meta()}

    def close(self) -> dict[str, Any]:
        report = {"pinned": len(self.pinned), "rss_growth_mib": _rss_mib() - self.rss_start}
        self.generations.close()
        self.backend.close()
        return report


class SoakDecode:
    """Reserves, pulls with the torn-read check, verifies every byte, frees."""

    def __init__(self, cfg: SoakConfig, metas: dict[str, Any], key_file: Optional[str] = None) -> None:
        self.cfg = cfg
        self.metas = metas
        self.rng = np.random.default_rng(cfg.seed + 2)
        self.pool = torch.zeros(cfg.pool_shape, dtype=torch.bfloat16)
        self.backend = _make_backend(cfg, "decode", self.pool, key_file)
        self.checker = GenerationChecker(self.backend)
        self.free: deque[int] = deque(int(b) for b in self.rng.permutation(cfg.pool_blocks))
        self.open: dict[Any, tuple[TransferHandle, list[int], int]] = {}
        self.rss_start = _rss_mib()

    def start(self, handoff: dict[str, Any]) -> None:
        n = len(handoff["src_ids"])
        dst = [self.free.popleft() for _ in range(n)]
        handle = self.checker.begin_pull_verified(
            self.metas["kv"], self.metas["generations"], handoff["src_ids"], dst, handoff["generations"],
            request_id=handoff["request_id"])
        self.open[handoff["request_id"]] = (handle, dst, n)

    def poll(self, report: SoakReport) -> None:
        for rid, (handle, dst, n) in list(self.open.items()):
            try:
                if not handle.poll():
                    continue
            except KVXferError as exc:
                report.failures.append(f"request {rid}: {exc}")
                report.bytes_lost += n * _slices(self.pool, self.cfg)[0, 0].numel() * 2 * self.cfg.num_layers
                if not handle.storage_safe:
                    continue  # quarantined: never reused (and counted as still reserved)
            else:
                got = _slices(self.pool, self.cfg)[:, torch.tensor(dst)]
                expected = request_bytes(self.cfg, rid, n, got.shape[2])
                if torch.equal(got, expected):
                    report.bytes_verified += got.numel()
                else:
                    report.mismatches += 1
                    report.bytes_lost += got.numel()
                report.handoffs_done += 1
            del self.open[rid]
            self.free.extend(dst)

    def close(self) -> dict[str, Any]:
        report = {"open_handles": len(self.open), "reserved": self.cfg.pool_blocks - len(self.free),
                  "rss_growth_mib": _rss_mib() - self.rss_start, "stats": self.backend.stats()}
        self.checker.close()
        self.backend.close()
        return report


#: Called with (handoffs verified, handoffs in the run) as the soak goes (the CLI shows it as progress).
OnProgress = Callable[[int, int], None]


def _no_progress(done: int, total: int) -> None:
    pass


def _drive(cfg: SoakConfig, decode: SoakDecode, next_handoff: Callable[[], Optional[dict[str, Any]]],
           report: SoakReport, on_progress: OnProgress) -> None:
    """Keep ``in_flight`` handoffs going until all are verified (or the deadline passes)."""
    deadline = time.monotonic() + max(60.0, cfg.handoffs * 0.5)
    shown = -1
    while report.handoffs_done + len(report.failures) < cfg.handoffs:
        if report.handoffs_done != shown:
            shown = report.handoffs_done
            on_progress(shown, cfg.handoffs)
        if time.monotonic() > deadline:
            report.failures.append(f"soak did not finish: {report.handoffs_done} of {cfg.handoffs} verified")
            return
        handoff = next_handoff()
        if handoff is not None:
            decode.start(handoff)
        decode.poll(report)
        if handoff is None and decode.open:
            time.sleep(1e-4)


def run_soak(cfg: SoakConfig, on_progress: Optional[OnProgress] = None) -> SoakReport:
    """Run the soak; failures (the prefill child's included, as its own message) land in ``report.failures``."""
    progress = on_progress or _no_progress
    report = SoakReport(cfg)
    logger.info("soak on %s: %d handoffs, %d in flight", cfg.backend, cfg.handoffs, cfg.in_flight)
    start = time.monotonic()
    if _in_process_only(cfg.backend):
        _soak_in_process(cfg, report, progress)
    else:
        _soak_two_processes(cfg, report, progress)
    progress(report.handoffs_done, cfg.handoffs)
    report.duration_s = time.monotonic() - start
    return report


def _in_process_only(backend: str) -> bool:
    """Whether the backend reaches only its own process (``local``), so both sides run here.

    A name that does not resolve goes the two-process way, where it fails as the prefill child's own
    error in ``report.failures`` (not as an exception out of ``run_soak``)."""
    try:
        return not construct_kv_transfer_backend_class(backend).reads_other_processes
    except BackendUnavailableError:
        return False


def _soak_in_process(cfg: SoakConfig, report: SoakReport, on_progress: OnProgress) -> None:
    prefill = SoakPrefill(cfg)
    decode = SoakDecode(cfg, prefill.metas())

    def next_handoff() -> Optional[dict[str, Any]]:
        prefill.release_finished()
        return prefill.publish() if prefill.can_publish() else None

    try:
        _drive(cfg, decode, next_handoff, report, on_progress)
        prefill.release_finished()
    finally:
        d, p = decode.close(), prefill.close()
    _finish(report, p, d)


def _finish(report: SoakReport, prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    report.prefill_pinned_at_end = prefill["pinned"]
    report.decode_open_handles_at_end = decode["open_handles"]
    report.decode_reserved_at_end = decode["reserved"]
    report.rss_growth_mib = {"prefill": prefill["rss_growth_mib"], "decode": decode["rss_growth_mib"]}


def _prefill_process(pipe: Pipe, cfg: SoakConfig, key_file: Optional[str] = None) -> None:
    """Child: publish handoffs as read-dones free room; report at the end. Failures reach
    the parent through the harness as this process's own error."""
    prefill = SoakPrefill(cfg, key_file)
    pipe.send("metas", prefill.metas())
    deadline = time.monotonic() + max(60.0, cfg.handoffs * 0.5)
    while time.monotonic() < deadline:
        prefill.release_finished()
        if prefill.can_publish():
            pipe.send("handoff", prefill.publish())
        elif prefill.next_request >= cfg.handoffs and not prefill.pinned:
            break
        if pipe.poll(0 if prefill.can_publish() else 1e-3):
            if pipe.recv()[0] == "stop":
                break
    pipe.send("done", prefill.close())


def _soak_two_processes(cfg: SoakConfig, report: SoakReport, on_progress: OnProgress) -> None:
    """The two processes sign and check metas with a key of this run's own (``loopback.run_key_file``)."""
    with run_key_file() as key_file:
        _soak_with_key(cfg, report, on_progress, key_file)


def _soak_with_key(cfg: SoakConfig, report: SoakReport, on_progress: OnProgress, key_file: Optional[str]) -> None:
    decode = None
    with Child("prefill", _prefill_process, cfg, key_file) as prefill:
        try:
            _, metas = prefill.recv(CONTROL_TIMEOUT_S, expected="metas")
            decode = SoakDecode(cfg, metas, key_file)
            prefill_report: Optional[dict[str, Any]] = None

            def next_handoff() -> Optional[dict[str, Any]]:
                nonlocal prefill_report
                if not prefill.poll(0):
                    return None
                kind, payload = prefill.recv()
                if kind == "handoff":
                    return payload
                prefill_report = payload
                return None

            _drive(cfg, decode, next_handoff, report, on_progress)
            deadline = time.monotonic() + CONTROL_TIMEOUT_S
            while prefill_report is None and time.monotonic() < deadline:
                if prefill.poll(0.1):
                    next_handoff()
            if prefill_report is None:
                raise TimeoutError("prefill never reported its end state (pinned blocks leaked?)")
            d = decode.close()
            decode = None
            _finish(report, prefill_report, d)
        except ChildError as exc:
            report.failures.append(str(exc))
            report.extra["child_traceback"] = exc.child_traceback
        except (RuntimeError, TimeoutError, KVXferError) as exc:
            report.failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            if decode is not None:
                decode.close()
            try:
                prefill.send("stop", None)
            except ChildError:
                pass  # it already ended
