"""The same handoff clock on both connectors: ``TimedKvxferConnector`` and ``TimedNixlConnector``.

``kvxfer bench-vllm`` compares KvxferConnector with vLLM's NixlConnector in the same vLLM.
Each connector's own counters measure different things, so both are wrapped here and timed
identically on the decode worker: from the step whose metadata first asks for a request's
KV (``start_load_kv``) to the step that reports it in ``finished_recving``. Bytes and
descriptors per handoff come from each connector's stats (kvxfer's counters; NIXL's transfer
telemetry, summed as vLLM would). ``bench_timings()`` is read over ``collective_rpc``.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

from kvxfer.integrations.vllm.connector import KvxferConnector


class _Timed:
    def _timing_init(self) -> None:
        self._t_started: dict[str, float] = {}
        self._t_done: list[tuple[str, float]] = []
        self._t_bytes = 0
        self._t_descriptors = 0
        self._t_transfers = 0

    def _awaited_request_ids(self, metadata: Any) -> list[str]:
        raise NotImplementedError

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        for request_id in self._awaited_request_ids(self._get_connector_metadata()):
            self._t_started.setdefault(request_id, now)
        super().start_load_kv(forward_context, **kwargs)  # type: ignore[misc]

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)  # type: ignore[misc]
        now = time.perf_counter()
        for request_id in results.finished_recving:
            started = self._t_started.pop(request_id, None)
            if started is not None and request_id not in results.failed_recving:
                self._t_done.append((request_id, now - started))
        return results

    def bench_timings(self) -> dict[str, Any]:
        return {"bench_handoff_s": [s for _, s in self._t_done], "bench_bytes": self._t_bytes,
                "bench_descriptors": self._t_descriptors, "bench_transfers": self._t_transfers}


class TimedKvxferConnector(_Timed, KvxferConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timing_init()

    def _awaited_request_ids(self, metadata: Any) -> list[str]:
        return [spec.request_id for spec in metadata.loads if spec.awaiting]

    def bench_timings(self) -> dict[str, Any]:
        out = super().bench_timings()
        if self.connector_worker is not None and self.connector_worker.receiver is not None:
            c = self.connector_worker.receiver.counters
            out.update(bench_bytes=c["bytes"], bench_descriptors=c["descriptors"], bench_transfers=c["handoffs"])
        return out


class TimedNixlConnector(_Timed, NixlConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timing_init()

    def _awaited_request_ids(self, metadata: Any) -> list[str]:
        return [rid for rid, meta in metadata.reqs_to_recv.items() if meta.awaiting_kvs]

    def get_kv_connector_stats(self) -> Any:
        stats = super().get_kv_connector_stats()
        if stats is not None:
            self._t_bytes += sum(stats.data.get("bytes_transferred", []))
            self._t_descriptors += sum(stats.data.get("num_descriptors", []))
            self._t_transfers += len(stats.data.get("bytes_transferred", []))
        return stats
