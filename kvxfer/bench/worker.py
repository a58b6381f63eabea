"""Run one measurement (a backend's sweep, a baseline) in its own worker process.

The bench process itself only orchestrates: it never loads a transport. Why:

* a transport that crashes (or, like NIXL 1.5.1's UCX plugin here, segfaults in its
  C++ teardown at interpreter exit) takes down the worker, not the run, and not a
  test runner that called the bench in-process;
* the decode side and the source side are then two processes of their own,
  with the orchestrator out of their way.

Results stream back one ``PointResult`` at a time (so progress bars move), then a
final "done". A worker that dies or goes silent longer than ``silence_s`` is killed;
the points it did not report are recorded as failed with the reason.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional, Sequence

from kvxfer.bench.config import BenchConfig, Point
from kvxfer.bench.results import PointResult
from kvxfer.harness.child import Child, ChildError, ChildExited, ChildTimeout, Pipe

OnPoint = Callable[[PointResult], None]


def _body(pipe: Pipe, target: str, args: tuple) -> None:
    """Worker body: ``module:function(*args, on_point=send)``; every result is sent as it lands.

    An exception reaches the bench through the harness as the worker's own message."""
    import os

    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    module, name = target.split(":")
    if module.startswith(("kvxfer", "tests")):  # measurements: one torch thread, as in the bench process
        import torch

        torch.set_num_threads(1)
    fn = getattr(importlib.import_module(module), name)
    out = fn(*args, on_point=lambda res: pipe.send("point", res))
    pipe.send("done", out)


def run_in_worker(target: str, args: tuple, points: Sequence[Point], name: str, kind: str,
                  on_point: Optional[OnPoint] = None, silence_s: float = 300.0) -> Any:
    """Call ``target`` (``"module:function"``) in a fresh spawned process and return its result.

    Points the worker did not report (it died, hung or raised) come back as failed
    ``PointResult``s so the report still has a row, and a reason, for each.
    """
    seen: list[PointResult] = []
    error: Optional[str] = None
    result: Any = None
    # not a daemon: a worker may crash in its own teardown after "done", and that is not our failure
    with Child(f"{name} worker", _body, target, args, daemon=False, join_timeout_s=10.0) as worker:
        while True:
            try:
                kind_, payload = worker.recv(silence_s)
            except ChildTimeout:
                error = f"worker silent for {silence_s:.0f}s; killed"
                break
            except ChildExited as exc:
                error = f"worker died (exit code {exc.exitcode})"
                break
            except ChildError as exc:
                error = f"worker failed: {exc}"
                break
            if kind_ == "point":
                seen.append(payload)
                if on_point:
                    on_point(payload)
            elif kind_ == "done":
                result = payload
                break
        if error is not None and worker.is_alive():
            worker.close(timeout_s=0)
    if error is None:
        return result
    reported = {(r.slice_bytes, r.num_blocks, r.pattern, r.reshard) for r in seen}
    for p in points:
        if (p.slice_bytes, p.num_blocks, p.pattern, p.reshard) not in reported:
            res = PointResult(name, kind, p.slice_bytes, p.num_blocks, p.pattern, p.reshard, error=error)
            seen.append(res)
            if on_point:
                on_point(res)
    return seen


def silence_limit(cfg: BenchConfig) -> float:
    """How long a worker may stay quiet: one point's repeats at the transfer timeout, at least 5 min."""
    return max(300.0, cfg.timeout_s * 3)
