"""The memcpy ceiling: one same-process copy of the same number of bytes.

No transport moves host bytes between two processes faster than the machine copies
them within one, so this is the physical limit every other line is read against.
It is one flat ``memmove`` (libc, one thread: the best case for the memory system,
and free of any framework's thread-pool wake-ups) per distinct byte count.

With VRAM pools (``device`` cuda) the limit is the GPU's own: one device-to-device
copy of the same bytes (``cudaMemcpyAsync`` through ``Tensor.copy_``), timed to the
stream's end. A VRAM read between two processes is judged against that figure.
"""

from __future__ import annotations

import ctypes
import time
from typing import Callable, Iterable, Optional

import torch

from kvxfer.bench.config import BenchConfig, Point
from kvxfer.bench.results import PointResult
from kvxfer.bench.sweep import OnPoint

NAME = "memcpy"


def _copy_result(cfg: BenchConfig, point: Point, num_bytes: int) -> PointResult:
    res = PointResult(NAME, "baseline", point.slice_bytes, point.num_blocks, point.pattern, bytes=num_bytes,
                      raw_descriptors=1, descriptors=1)
    res.extra["two_process"] = False
    res.extra["copy"] = "memmove" if cfg.device == "cpu" else "device to device (cudaMemcpyAsync)"
    gen = torch.Generator().manual_seed(cfg.seed)
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen).to(cfg.device)
    dst = torch.empty_like(src)
    copy = _copy_on(cfg.device, src, dst)
    try:
        for repeat in range(cfg.warmup + cfg.repeats):
            if repeat == cfg.warmup:
                dst.zero_()
            t0 = time.perf_counter()
            copy()
            t1 = time.perf_counter()
            if repeat == cfg.warmup:
                res.verified = bool(torch.equal(dst, src))
            if repeat >= cfg.warmup:
                res.samples.add(build_ms=0.0, post_ms=0.0, transfer_ms=(t1 - t0) * 1e3)
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res.summarize()


def _copy_on(device: str, src: torch.Tensor, dst: torch.Tensor) -> Callable[[], None]:
    """One flat copy of ``src`` into ``dst``, finished when it returns."""
    if device == "cpu":
        return lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())

    def device_copy() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(dst.device)

    return device_copy


def run(cfg: BenchConfig, points: Iterable[Point], on_point: Optional[OnPoint] = None) -> list[PointResult]:
    """One ceiling per point, measured once per distinct byte count and shared by equal sizes."""
    measured: dict[int, PointResult] = {}
    out: list[PointResult] = []
    for point in points:
        if point.reshard:
            continue
        num_bytes = point.num_blocks * cfg.planes * point.slice_bytes
        if num_bytes not in measured:
            measured[num_bytes] = _copy_result(cfg, point, num_bytes)
        base = measured[num_bytes]
        res = PointResult(**{**base.__dict__, "slice_bytes": point.slice_bytes, "num_blocks": point.num_blocks,
                             "pattern": point.pattern, "extra": dict(base.extra)})
        out.append(res)
        if on_point:
            on_point(res)
    return out
