"""Prometheus exposition of the per-backend counters (``backend.stats()``).

A running engine creates its backends once; ``KVXferCollector`` holds a set of them
and, on every scrape, reads their ``stats()`` and yields one metric family per
counter, labelled by backend name and agent. Nothing is copied or cached, so a
scrape always shows the live numbers, and closed backends simply drop out.

``prometheus-client`` is optional (``pip install 'kvxfer[prometheus]'``); without it,
constructing a collector raises ``ImportError`` saying so.

Usage::

    from kvxfer.runtime.metrics import serve
    collector = serve([backend], port=9400)   # then scrape http://host:9400/metrics
    collector.add(other_backend)              # backends created later
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Iterator, Optional

from kvxfer.backends.base import KVTransportBackend

#: stats() key -> (metric name, help, is a gauge)
METRICS: dict[str, tuple[str, str, bool]] = {
    "transfers_started": ("kvxfer_transfers_started", "Pulls posted by this backend", False),
    "transfers_completed": ("kvxfer_transfers_completed", "Pulls whose every byte landed", False),
    "transfers_failed": ("kvxfer_transfers_failed", "Pulls that failed (timeouts included)", False),
    "timeouts": ("kvxfer_transfer_timeouts", "Pulls that failed by timing out", False),
    "bytes_requested": ("kvxfer_bytes_requested", "Bytes of posted pulls", False),
    "bytes_completed": ("kvxfer_bytes_completed", "Bytes of completed pulls", False),
    "descriptors_posted": ("kvxfer_descriptors_posted", "Transfer descriptors posted (after coalescing)", False),
    "read_done_received": ("kvxfer_read_done_received", "Read-done notifications received as a source", False),
    "read_failed_received": ("kvxfer_read_failed_received", "Read-failure reports received as a source", False),
    "in_flight": ("kvxfer_transfers_in_flight", "Pulls posted and not yet finished", True),
    "storage_unsafe": ("kvxfer_transfers_storage_unsafe",
                       "Failed pulls whose destination may still be written (blocks quarantined)", True),
}
LABELS = ("backend", "agent")


def _prometheus() -> Any:
    try:
        import prometheus_client.core as core
    except ImportError as exc:
        raise ImportError("kvxfer.runtime.metrics needs prometheus-client: pip install 'kvxfer[prometheus]' "
                          f"(or pip install prometheus-client); import failed: {exc}") from exc
    return core


class KVXferCollector:
    """A Prometheus collector over a set of backends (add/remove as they come and go)."""

    def __init__(self, backends: Iterable[KVTransportBackend] = ()) -> None:
        self._core = _prometheus()
        self._lock = threading.Lock()
        self._backends: list[KVTransportBackend] = list(backends)

    def add(self, backend: KVTransportBackend) -> None:
        with self._lock:
            if backend not in self._backends:
                self._backends.append(backend)

    def remove(self, backend: KVTransportBackend) -> None:
        with self._lock:
            if backend in self._backends:
                self._backends.remove(backend)

    def collect(self) -> Iterator[Any]:
        core = self._core
        with self._lock:
            live = [b for b in self._backends if not b.closed]
        families = {}
        for key, (name, help_text, gauge) in METRICS.items():
            family = core.GaugeMetricFamily if gauge else core.CounterMetricFamily
            families[key] = family(name, help_text, labels=LABELS)
        for backend in live:
            stats = backend.stats()
            for key, family in families.items():
                if key in stats:
                    family.add_metric([backend.name, backend.agent_name], stats[key])
        yield from families.values()

    def describe(self) -> Iterator[Any]:
        """Metric names without reading any backend (lets ``registry.register`` check duplicates cheaply)."""
        core = self._core
        for name, help_text, gauge in METRICS.values():
            family = core.GaugeMetricFamily if gauge else core.CounterMetricFamily
            yield family(name, help_text, labels=LABELS)


def register(backends: Iterable[KVTransportBackend] = (), registry: Optional[Any] = None) -> KVXferCollector:
    """Create a collector over ``backends`` and register it (default: the global registry)."""
    collector = KVXferCollector(backends)
    if registry is None:
        registry = _prometheus().REGISTRY
    registry.register(collector)
    return collector


def serve(backends: Iterable[KVTransportBackend], port: int, addr: str = "0.0.0.0") -> KVXferCollector:
    """Register a collector over ``backends`` in the global registry and serve ``/metrics`` on ``port``."""
    import prometheus_client

    collector = register(backends)
    prometheus_client.start_http_server(port, addr=addr)
    return collector
