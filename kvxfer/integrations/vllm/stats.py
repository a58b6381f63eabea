"""Connector counters in vLLM's stats pipeline and in its Prometheus ``/metrics``.

vLLM's path (0.32 and 0.33, ``distributed/kv_transfer/kv_connector/v1/metrics.py``): every step each worker's
``get_kv_connector_stats`` (what changed since the last call) and the scheduler connector's are aggregated
(``KvxferStats.aggregate``) and travel as ``KvxferStats.data`` to the front-end process, where the log line
(``KVConnectorLogging``: ``reduce``) and the Prometheus logger (``KVConnectorProm``) take them. The latter asks
the connector class once for its metrics, ``KvxferConnector.build_prom_metrics`` -> ``KvxferPromMetrics``, made
with vLLM's metric classes and labels (``model_name``, ``engine``: one child per engine, as vLLM's own), and
calls ``observe(data, engine_idx)`` with each step's aggregate. Names are ``vllm:kvxfer_*`` (``METRICS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvxfer.integrations.vllm.receiver import FAILURE_KINDS

#: Why a producer's pin went (``released_<why>`` counters) -> the ``reason`` label of ``vllm:kvxfer_pins_released``.
#: ``grace`` is a lease expiry: ``pin_grace_s`` passed without every reader, the lease was revoked, the blocks freed.
RELEASE_REASONS = {"read_done": "read_done", "read_failed": "read_failed", "grace": "lease_expired", "sleep": "sleep"}

#: Counters summed across workers and steps.
COUNTERS = ("handoffs", "handoff_failures", "refused", "bytes", "descriptors",
            *(f"released_{why}" for why in RELEASE_REASONS), *(f"failed_{kind}" for kind in FAILURE_KINDS),
            "exports_refused")

#: Per decode handoff (one entry per worker that completed a load), in the same order in each list.
SERIES = ("handoff_s", "handoff_bytes", "handoff_descriptors")

#: What ``/metrics`` shows (counters get ``_total``, histograms ``_bucket``/``_sum``/``_count``), each with
#: vLLM's labels ``model_name`` and ``engine`` (docs/metrics.md).
METRICS = {
    "vllm:kvxfer_xfer_time_seconds": "histogram: decode handoff durations, from the step asking for the KV to "
                                     "the lease check passed (per worker)",
    "vllm:kvxfer_bytes_transferred": "histogram: bytes read per decode handoff (per worker); _sum is all bytes moved",
    "vllm:kvxfer_num_descriptors": "histogram: transport descriptors posted per decode handoff (per worker)",
    "vllm:kvxfer_failed_handoffs": "counter, label kind (handshake, refused, transfer, lease, scratch): decode "
                                   "loads reported failed to vLLM",
    "vllm:kvxfer_pins_released": "counter, label reason (read_done, read_failed, lease_expired, sleep): producer "
                                 "exports whose blocks went back to vLLM",
    "vllm:kvxfer_exports_refused": "counter: finished prefills returned without kv_transfer_params (no lease slot)",
}

TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BYTES_BUCKETS = tuple(float(2 ** k) for k in range(12, 36, 2))  # 4 KiB .. 16 GiB
DESCRIPTOR_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0)


@dataclass
class KvxferStats(KVConnectorStats):
    """``data``: the COUNTERS plus the SERIES (one entry per decode handoff of the interval)."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)
        for name in SERIES:
            self.data.setdefault(name, [])

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTERS}
        self.data.update({name: [] for name in SERIES})

    def aggregate(self, other: KVConnectorStats) -> "KvxferStats":
        for name in COUNTERS:
            self.data[name] += int(other.data.get(name, 0))
        for name in SERIES:
            self.data[name] = list(self.data[name]) + list(other.data.get(name, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, Any] = {name: self.data[name] for name in COUNTERS
                               if self.data[name] or not name.startswith(("failed_", "released_sleep"))}
        times = sorted(self.data["handoff_s"])
        if times:
            out["handoff_p50_ms"] = round(1000 * times[len(times) // 2], 3)
            out["handoff_max_ms"] = round(1000 * times[-1], 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in COUNTERS) and not any(self.data[name] for name in SERIES)


class KvxferPromMetrics(KVConnectorPromMetrics):
    """kvxfer's series in vLLM's Prometheus registry (``METRICS``), one child per engine and label value."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any, *extra: str) -> dict[int, Any]:
            return {idx: metric.labels(*values, *extra) for idx, values in per_engine_labelvalues.items()}

        def histogram(name: str, buckets: tuple[float, ...]) -> dict[int, Any]:
            return per_engine(self._histogram_cls(name=name, documentation=METRICS[name], buckets=list(buckets),
                                                  labelnames=labelnames))

        def labelled(name: str, label: str, values: Any) -> dict[str, dict[int, Any]]:
            metric = self._counter_cls(name=name, documentation=METRICS[name], labelnames=[*labelnames, label])
            return {value: per_engine(metric, value) for value in values}

        self.series = {"handoff_s": histogram("vllm:kvxfer_xfer_time_seconds", TIME_BUCKETS),
                       "handoff_bytes": histogram("vllm:kvxfer_bytes_transferred", BYTES_BUCKETS),
                       "handoff_descriptors": histogram("vllm:kvxfer_num_descriptors", DESCRIPTOR_BUCKETS)}
        failed = labelled("vllm:kvxfer_failed_handoffs", "kind", FAILURE_KINDS)
        released = labelled("vllm:kvxfer_pins_released", "reason", RELEASE_REASONS.values())
        self.counters = {**{f"failed_{kind}": failed[kind] for kind in FAILURE_KINDS},
                         **{f"released_{why}": released[reason] for why, reason in RELEASE_REASONS.items()},
                         "exports_refused": per_engine(self._counter_cls(
                             name="vllm:kvxfer_exports_refused", documentation=METRICS["vllm:kvxfer_exports_refused"],
                             labelnames=labelnames))}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, children in self.series.items():
            for value in transfer_stats_data.get(name, ()):
                children[engine_idx].observe(value)
        for name, children in self.counters.items():
            count = transfer_stats_data.get(name, 0)
            if count > 0:
                children[engine_idx].inc(count)
