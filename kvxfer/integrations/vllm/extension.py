"""``KvxferWorkerExtension``: the connector's counters over vLLM's ``collective_rpc``.

Pass ``worker_extension_cls="kvxfer.integrations.vllm.extension.KvxferWorkerExtension"`` to
``LLM(...)`` (or ``--worker-extension-cls`` to ``vllm serve``); then
``llm.collective_rpc("kvxfer_stats")`` returns each worker's counters (handoffs, bytes,
descriptors, failures, refusals, pins held and how they went) without vLLM's insecure pickle
fallback for callables.
"""

from __future__ import annotations

from typing import Any


class KvxferWorkerExtension:
    def kvxfer_stats(self) -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return {}
        connector = get_kv_transfer_group()
        out: dict[str, Any] = {}
        for name in ("kvxfer_stats", "bench_timings"):
            fn = getattr(connector, name, None)
            if fn is not None:
                out.update(fn())
        return out
