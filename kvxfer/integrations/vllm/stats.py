"""Connector counters in vLLM's stats pipeline (``get_kv_connector_stats`` -> the stat loggers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

#: Counters summed across workers and steps.
COUNTERS = ("handoffs", "handoff_failures", "refused", "bytes", "descriptors", "released_read_done",
            "released_read_failed", "released_grace")


@dataclass
class KvxferStats(KVConnectorStats):
    """``data``: the COUNTERS plus ``handoff_s``, the decode-side handoff durations of the interval."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)
        self.data.setdefault("handoff_s", [])

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTERS}
        self.data["handoff_s"] = []

    def aggregate(self, other: KVConnectorStats) -> "KvxferStats":
        for name in COUNTERS:
            self.data[name] += int(other.data.get(name, 0))
        self.data["handoff_s"] = list(self.data["handoff_s"]) + list(other.data.get("handoff_s", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, Any] = {name: self.data[name] for name in COUNTERS}
        times = sorted(self.data["handoff_s"])
        if times:
            out["handoff_p50_ms"] = round(1000 * times[len(times) // 2], 3)
            out["handoff_max_ms"] = round(1000 * times[-1], 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in COUNTERS) and not self.data["handoff_s"]
