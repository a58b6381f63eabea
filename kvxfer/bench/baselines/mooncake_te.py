"""The Mooncake Transfer Engine baseline: ``batch_transfer_sync_read`` over TCP.

Two worker processes (``mooncake_te_worker.py``) under an interpreter that has
``mooncake`` installed, the one given by ``BenchConfig.mooncake_python`` or this one.
Each request reads the same coalesced runs kvxfer plans (the best case for Mooncake:
it is measured as a transport, not penalised for a naive descriptor list), and the
first measured repeat of each point is verified by digest. Mooncake's synchronous
read has no read-done notification at the source, so that column is empty.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional

from kvxfer.bench.config import BenchConfig, Point
from kvxfer.bench.results import PointResult, Unavailable
from kvxfer.bench.sweep import OnPoint
from kvxfer.plan.descriptors import plan_block_copies

NAME = "mooncake"
WORKER = Path(__file__).with_name("mooncake_te_worker.py")


def interpreter(cfg: BenchConfig) -> str:
    return cfg.mooncake_python or sys.executable


def availability(cfg: BenchConfig) -> Optional[Unavailable]:
    python = interpreter(cfg)
    try:
        probe = subprocess.run([python, "-c", "import mooncake.engine"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Unavailable(NAME, f"cannot run {python}: {exc}")
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return Unavailable(NAME, f"mooncake is not importable by {python}: {last} "
                                 "(pip install mooncake-transfer-engine-non-cuda; it needs libibverbs1 librdmacm1 libnuma1, "
                                 "or pass --mooncake-python)")
    return None


class _Worker:
    """A worker process and its JSON-lines channel; every answer is awaited with a timeout."""

    def __init__(self, python: str, role: str, timeout_s: float) -> None:
        self.log = tempfile.TemporaryFile()  # mooncake logs verbosely to stderr
        self.proc = subprocess.Popen([python, str(WORKER), role], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)
        self.timeout_s = timeout_s

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        if not ready:
            raise TimeoutError(f"mooncake worker gave no answer to {cmd['cmd']!r} within {self.timeout_s}s")
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            tail = self.log.read().decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"mooncake worker exited (rc={self.proc.poll()}): {' | '.join(tail)}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"mooncake worker: {answer['error']}")
        return answer

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call(cmd="close")
        except (OSError, TimeoutError, RuntimeError, ValueError):
            pass
        finally:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
            self.log.close()


def run(cfg: BenchConfig, points: Iterable[Point], on_point: Optional[OnPoint] = None) -> list[PointResult] | Unavailable:
    missing = availability(cfg)
    if missing is not None:
        return missing
    python = interpreter(cfg)
    timeout_s = max(cfg.timeout_s, 60.0)
    source, reader = _Worker(python, "source", timeout_s), _Worker(python, "reader", timeout_s)
    results: list[PointResult] = []
    try:
        current_size = None
        remote: dict[str, Any] = {}
        for point in points:
            if point.reshard:
                continue
            res = PointResult(NAME, "baseline", point.slice_bytes, point.num_blocks, point.pattern)
            res.extra["two_process"] = True
            try:
                pool_cfg = cfg.pool_config("local", point.slice_bytes)
                if point.slice_bytes != current_size:
                    pool_bytes = cfg.planes * pool_cfg.pool_blocks * point.slice_bytes
                    remote = source.call(cmd="setup", pool_bytes=pool_bytes, seed=cfg.seed + 1)
                    reader.call(cmd="setup", pool_bytes=pool_bytes)
                    current_size = point.slice_bytes
                _measure(cfg, point, pool_cfg, source, reader, remote, res)
            except Exception as exc:
                res.error = f"{type(exc).__name__}: {exc}"
                current_size = None  # set the pools up again for the next point
            results.append(res.summarize())
            if on_point:
                on_point(res)
    finally:
        source.close()
        reader.close()
    return results


def _geometry(cfg: BenchConfig, pool_blocks: int, slice_bytes: int) -> Any:
    from kvxfer.plan.geometry import BufferGeometry

    return BufferGeometry(buf_ptr=0, element_size=2, device_id=0, blocks_axis=2, num_blocks=pool_blocks,
                          num_outer=cfg.planes, bytes_per_slice=slice_bytes, outer_stride_bytes=pool_blocks * slice_bytes)


def _measure(cfg: BenchConfig, point: Point, pool_cfg: Any, source: _Worker, reader: _Worker,
             remote: dict[str, Any], res: PointResult) -> None:
    geo = _geometry(cfg, pool_cfg.pool_blocks, point.slice_bytes)
    for repeat in range(cfg.warmup + cfg.repeats):
        verify = repeat == cfg.warmup
        src_ids, dst_ids = cfg.request_config(pool_cfg, point, repeat).block_ids()
        plan = plan_block_copies(geo, geo, src_ids, dst_ids)
        shape = {"num_outer": cfg.planes, "num_blocks": pool_cfg.pool_blocks, "slice": point.slice_bytes}
        check = {"ids": dst_ids.tolist(), **shape} if verify else None
        answer = reader.call(cmd="read", session=remote["session"], remote=remote["addr"], src_off=plan.src_offsets.tolist(),
                             dst_off=plan.dst_offsets.tolist(), len=plan.lengths.tolist(), verify=check)
        if answer["rc"] != 0:
            raise RuntimeError(f"batch_transfer_sync_read returned {answer['rc']}")
        res.bytes, res.raw_descriptors, res.descriptors = plan.total_bytes, plan.raw_descriptors, plan.num_descriptors
        if verify:
            expected = source.call(cmd="digest", ids=src_ids.tolist(), **shape)["digest"]
            res.verified = expected == answer["digest"]
            if not res.verified:
                raise RuntimeError("verification failed: mooncake read the wrong bytes")
        if repeat >= cfg.warmup:
            res.samples.add(build_ms=answer["build_ms"], post_ms=0.0, transfer_ms=answer["transfer_ms"])


__all__ = ["NAME", "availability", "run"]
