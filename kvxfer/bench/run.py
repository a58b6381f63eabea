"""Run a whole bench: every backend, every baseline, the targets, the machine.

This is the orchestration only (what runs, in which order, with progress bars);
measuring lives in ``sweep`` and ``baselines``, presenting in ``report``.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Optional, Sequence

from kvxfer.bench.config import RESHARD_SRC_TP, BenchConfig, Point
from kvxfer.bench.results import PointResult, Unavailable
from kvxfer.bench import machine, reshard_build, targets

Progress = Callable[[str, int], Callable[[PointResult], None]]  # (task name, total) -> per-point callback


@dataclass
class BenchReport:
    """Everything one run produced; ``to_json`` is the file format."""

    config: BenchConfig
    command: str
    machine: dict[str, Any]
    started_utc: str
    runtime_s: float = 0.0
    results: list[PointResult] = field(default_factory=list)
    unavailable: list[Unavailable] = field(default_factory=list)
    targets: dict[str, Any] = field(default_factory=dict)
    reshard_axis: str = ""

    @property
    def ok(self) -> bool:
        """Every point that ran was verified and error-free."""
        return all(r.ok for r in self.results)

    def to_json(self) -> dict[str, Any]:
        cfg = asdict(self.config)
        cfg.pop("extra", None)
        return {
            "schema_version": 1,
            "command": self.command,
            "started_utc": self.started_utc,
            "runtime_s": self.runtime_s,
            "ok": self.ok,
            "machine": self.machine,
            "config": cfg,
            "reshard_axis": self.reshard_axis,
            "points": [r.to_json() for r in self.results],
            "unavailable": [asdict(u) for u in self.unavailable],
            "targets": self.targets,
        }


def perftest_sizes(slice_sizes: Sequence[int], coalesced: Sequence[int] = ()) -> list[int]:
    """Every power of two from the smallest to the largest slice, the slices themselves and the
    points' coalesced message sizes: each point is compared with the largest measured message
    that is not longer than its mean descriptor."""
    lo, hi = min(slice_sizes), max(slice_sizes)
    sizes = set(slice_sizes) | set(coalesced)
    size = 1 << (lo - 1).bit_length()
    while size <= hi:
        sizes.add(size)
        size <<= 1
    return sorted(sizes)


def annotate_get_ceiling(results: Sequence[PointResult]) -> None:
    """Give every transfer point (not the ceilings themselves) the ucp-get-cold figure at its coalesced
    message size: the largest measured message not longer than its mean descriptor (else the smallest)."""
    gets = sorted((r for r in results if r.source == "ucp-get-cold" and r.ok and r.gbps), key=lambda r: r.slice_bytes)
    if not gets:
        return
    for r in results:
        if r.source in ("ucp-get-cold", "ucx-perftest", "memcpy") or not r.ok or not r.gbps or not r.descriptors:
            continue
        fitting = [g for g in gets if g.slice_bytes <= r.mean_descriptor_bytes] or gets[:1]
        ref = fitting[-1]
        r.get_size, r.get_gbps, r.vs_get = ref.slice_bytes, ref.gbps, r.gbps / ref.gbps


def _no_progress(name: str, total: int) -> Callable[[PointResult], None]:
    return lambda result: None


def _prepare_process() -> None:
    """Quiet NIXL's INFO logging and keep torch to one thread (on a small shared machine
    the intra-op pool's wake-ups cost more than they save). The environment the nixl
    backend would set for itself (``UCX_MODULES=^ib`` without an RDMA device) is set
    here once, so every UCX user of the run -- backends, naive NIXL, ucx_perftest, all
    children -- runs with the same UCX settings."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        from kvxfer.backends.nixl.ucx_env import keep_idle_ib_module_out
    except ImportError:  # no nixl backend in this checkout: nothing to align with
        pass
    else:
        keep_idle_ib_module_out()
    import torch

    torch.set_num_threads(1)


def run_bench(cfg: BenchConfig, command: str = "", progress: Optional[Progress] = None) -> BenchReport:
    """Run every backend and baseline in ``cfg``; failures are recorded on points, never raised."""
    saved_env, saved_threads = dict(os.environ), _torch_threads()
    try:
        _prepare_process()
        return _run(cfg, command, progress or _no_progress)
    finally:  # a caller running the bench in-process (a test runner) gets its environment back
        os.environ.clear()
        os.environ.update(saved_env)
        _torch_threads(saved_threads)


def _torch_threads(n: Optional[int] = None) -> int:
    import torch

    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def _run(cfg: BenchConfig, command: str, progress: Progress) -> BenchReport:
    from kvxfer.backends import available_backends, normalize_name
    from kvxfer.bench.baselines import memcpy, mooncake_te, naive_nixl, ucp_get_cold, ucx_perftest
    from kvxfer.bench.worker import run_in_worker, silence_limit

    started = time.monotonic()
    report = BenchReport(cfg, command, machine.describe(), datetime.now(timezone.utc).isoformat(timespec="seconds"))
    reshard_on = cfg.reshard == "on"
    report.reshard_axis = (f"on: prefill TP {RESHARD_SRC_TP} -> decode TP 1 points for kvxfer backends "
                           "(baselines: plain pulls only)" if reshard_on else "off: disabled by --reshard off")
    points: list[Point] = list(cfg.points(reshard=reshard_on))

    runnable = {info.name: info for info in available_backends()}
    silence = silence_limit(cfg)
    for backend in cfg.backends:
        info = runnable.get(normalize_name(backend))
        if info is None or not info.available:
            report.unavailable.append(Unavailable(backend, info.reason if info else f"unknown backend {backend!r}"))
            continue
        report.results += run_in_worker("kvxfer.bench.sweep:run_backend", (cfg, backend, points), points, backend,
                                        "backend", progress(backend, len(points)), silence)
    points = [p for p in points if not p.reshard]  # baselines measure plain pulls

    if "memcpy" in cfg.baselines:
        report.results += memcpy.run(cfg, points, progress("memcpy", len(points)))
    if "naive-nixl" in cfg.baselines:
        missing = naive_nixl.availability()
        if missing:
            report.unavailable.append(missing)
        else:
            report.results += run_in_worker("kvxfer.bench.baselines.naive_nixl:run", (cfg, points), points,
                                            naive_nixl.NAME, "baseline", progress(naive_nixl.NAME, len(points)), silence)
    if "ucx-perftest" in cfg.baselines:
        sizes = perftest_sizes(cfg.slice_sizes, cfg.coalesced_sizes())
        on_point = progress("ucx-perftest", len(sizes))
        outcome = ucx_perftest.run(sizes, timeout_s=cfg.timeout_s)
        if isinstance(outcome, Unavailable):
            report.unavailable.append(outcome)
        else:
            for res in outcome:
                on_point(res)
            report.results += outcome
    if "ucp-get-cold" in cfg.baselines:
        missing = ucp_get_cold.availability()
        if missing:
            report.unavailable.append(missing)
        else:
            sizes = cfg.coalesced_sizes()
            llc = report.machine.get("llc_bytes")
            region = cfg.get_region(llc, report.machine.get("memory_bytes"))
            report.results += run_in_worker("kvxfer.bench.baselines.ucp_get_cold:run",
                                            (sizes, region, max(cfg.timeout_s, 60.0), llc),
                                            [Point(size, 1, "contiguous") for size in sizes], ucp_get_cold.NAME,
                                            "baseline", progress(ucp_get_cold.NAME, len(sizes)), silence)
    if "mooncake" in cfg.baselines:
        missing = mooncake_te.availability(cfg)
        outcome = missing or mooncake_te.run(cfg, points, progress("mooncake", len(points)))
        if isinstance(outcome, Unavailable):
            report.unavailable.append(outcome)
        else:
            report.results += outcome

    build = (reshard_build.measure_build(repeats=max(3, 2 * cfg.repeats)) if reshard_on
             else {"status": "not measured: --reshard off"})
    annotate_get_ceiling(report.results)
    report.targets = targets.evaluate(report.results, build)
    report.machine["load_average_end"] = machine.load_average()
    report.runtime_s = time.monotonic() - started
    return report
