"""Per-backend counters a user can read from a running system.

Every backend keeps one ``TransferStats``; the handle state machine updates it, so
transports need do nothing. ``snapshot()`` is what ``KVTransportBackend.stats()``
returns; ``kvxfer.runtime.metrics`` exposes the same figures to Prometheus.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class TransferStats:
    """Cumulative counters since the backend was created (``in_flight`` is current)."""

    transfers_started: int = 0
    transfers_completed: int = 0
    transfers_failed: int = 0
    timeouts: int = 0
    bytes_requested: int = 0
    bytes_completed: int = 0
    descriptors_posted: int = 0
    read_done_received: int = 0
    read_failed_received: int = 0
    notices_dropped: int = 0  # read-done/failed reports dropped because nobody drained them
    notices_undelivered: int = 0  # reports to a source given up on (unreachable too long, or too many kept)
    #: Failed transfers whose destination may still be written (a read that could not be proven
    #: over yet): their blocks must stay quarantined. A gauge: it drops as they settle.
    storage_unsafe: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def in_flight(self) -> int:
        return self.transfers_started - self.transfers_completed - self.transfers_failed

    def started(self, num_bytes: int, descriptors: int) -> None:
        with self._lock:
            self.transfers_started += 1
            self.bytes_requested += num_bytes
            self.descriptors_posted += descriptors

    def completed(self, num_bytes: int) -> None:
        with self._lock:
            self.transfers_completed += 1
            self.bytes_completed += num_bytes

    def failed(self, timed_out: bool) -> None:
        with self._lock:
            self.transfers_failed += 1
            self.timeouts += int(timed_out)

    def unsafe(self, delta: int) -> None:
        with self._lock:
            self.storage_unsafe += delta

    def notified(self, done: int, failed: int) -> None:
        with self._lock:
            self.read_done_received += done
            self.read_failed_received += failed

    def notice_dropped(self) -> None:
        with self._lock:
            self.notices_dropped += 1

    def notice_undelivered(self) -> None:
        with self._lock:
            self.notices_undelivered += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            out = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        out["in_flight"] = out["transfers_started"] - out["transfers_completed"] - out["transfers_failed"]
        return out
