"""One measured point, as it goes into the table, the JSON and the plot.

Per-repeat samples are kept raw; the summary (p50/p99, GB/s at the median) is
computed here once, so every consumer reports the same numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import numpy as np


def percentile(samples: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (linear interpolation), or None with no samples."""
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q)) if len(samples) else None


@dataclass
class Samples:
    """Per-repeat figures of one point (warm-up runs are never added)."""

    build_ms: list[float] = field(default_factory=list)
    post_ms: list[float] = field(default_factory=list)
    transfer_ms: list[float] = field(default_factory=list)
    read_done_ms: list[float] = field(default_factory=list)

    def add(self, *, build_ms: float, post_ms: float, transfer_ms: float, read_done_ms: Optional[float] = None) -> None:
        self.build_ms.append(build_ms)
        self.post_ms.append(post_ms)
        self.transfer_ms.append(transfer_ms)
        if read_done_ms is not None:
            self.read_done_ms.append(read_done_ms)


@dataclass
class PointResult:
    """A point's summary. ``source`` is a backend name or a baseline name.

    Times are per request, in ms: ``build`` = descriptor build, ``post`` = the call
    that posts the reads, ``transfer`` = request start (build included) to every byte
    landed. ``read_done`` = time from the reader's completion to the source seeing
    the read-done notification. ``gbps`` is bytes / median transfer time, ``gbps_mean``
    bytes / mean transfer time (1 GB = 1e9 B); on a busy machine the two differ.
    """

    source: str
    kind: str  # "backend" | "baseline"
    slice_bytes: int
    num_blocks: int
    pattern: str
    reshard: bool = False
    bytes: int = 0
    raw_descriptors: int = 0
    descriptors: int = 0
    build_ms: Optional[float] = None
    post_ms: Optional[float] = None
    transfer_ms_p50: Optional[float] = None
    transfer_ms_p99: Optional[float] = None
    read_done_ms_p50: Optional[float] = None
    read_done_ms_p99: Optional[float] = None
    gbps: Optional[float] = None
    gbps_mean: Optional[float] = None
    # the point's own ceilings, measured in the same run (``kvxfer.bench.ceiling``):
    # a same-process gather copy of exactly these slices (same ids, pattern and pool shapes) ...
    gather_ms_p50: Optional[float] = None
    gather_ms_p99: Optional[float] = None
    gather_gbps: Optional[float] = None
    vs_gather: Optional[float] = None  # gbps / gather_gbps
    # ... and a two-process ucp_get stream at the coalesced message size over buffers larger than the LLC
    get_size: Optional[int] = None  # the measured message size used (largest <= mean descriptor bytes)
    get_gbps: Optional[float] = None
    vs_get: Optional[float] = None  # gbps / get_gbps
    repeats: int = 0
    verified: bool = False
    error: Optional[str] = None
    samples: Samples = field(default_factory=Samples)
    extra: dict[str, Any] = field(default_factory=dict)

    def summarize(self) -> "PointResult":
        s = self.samples
        self.repeats = len(s.transfer_ms)
        self.build_ms = percentile(s.build_ms, 50)
        self.post_ms = percentile(s.post_ms, 50)
        self.transfer_ms_p50 = percentile(s.transfer_ms, 50)
        self.transfer_ms_p99 = percentile(s.transfer_ms, 99)
        self.read_done_ms_p50 = percentile(s.read_done_ms, 50)
        self.read_done_ms_p99 = percentile(s.read_done_ms, 99)
        if self.transfer_ms_p50:
            self.gbps = self.bytes / (self.transfer_ms_p50 / 1e3) / 1e9
            self.gbps_mean = self.bytes / (float(np.mean(s.transfer_ms)) / 1e3) / 1e9
        return self

    def set_gather(self, samples_ms: Sequence[float]) -> None:
        """The gather ceiling's per-request times (ms) -> its p50/p99, GB/s and this point's ratio to it."""
        self.gather_ms_p50, self.gather_ms_p99 = percentile(samples_ms, 50), percentile(samples_ms, 99)
        if self.gather_ms_p50 and self.bytes:
            self.gather_gbps = self.bytes / (self.gather_ms_p50 / 1e3) / 1e9
            self.vs_gather = self.gbps / self.gather_gbps if self.gbps else None

    @property
    def ok(self) -> bool:
        return self.error is None and self.verified and self.repeats > 0

    @property
    def mean_descriptor_bytes(self) -> float:
        return self.bytes / self.descriptors if self.descriptors else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["mean_descriptor_bytes"] = self.mean_descriptor_bytes
        return out


#: Every key a point carries in the JSON (the smoke test checks them all).
POINT_FIELDS = tuple(PointResult.__dataclass_fields__) + ("ok", "mean_descriptor_bytes")


@dataclass
class Unavailable:
    """A backend or baseline that could not run here, and why."""

    name: str
    reason: str
