"""``KvxferConnector``: the class vLLM instantiates, once per role, forwarding to the role's half.

vLLM builds the connector twice: in the scheduler process (``KVConnectorRole.SCHEDULER``) and
in every worker (``KVConnectorRole.WORKER``), with ``(vllm_config, role, kv_cache_config)``.
This facade checks the configuration, then forwards each hook to ``KvxferScheduler`` or
``KvxferWorker``; the two halves talk only through ``KvxferConnectorMetadata`` (down, each
step) and ``get_transfer_results`` (up), as vLLM's own connectors do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvxfer.integrations.vllm.config import ConnectorConfigError, KvxferConfig, check_kv_cache_groups
from kvxfer.integrations.vllm.metadata import KvxferConnectorMetadata
from kvxfer.integrations.vllm.scheduler import KvxferScheduler
from kvxfer.integrations.vllm.specs import MAMBA, TransferGroup
from kvxfer.integrations.vllm.stats import KvxferPromMetrics, KvxferStats
from kvxfer.integrations.vllm.worker import KvxferWorker, is_hybrid

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def check_supported(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> tuple[TransferGroup, ...]:
    """Refuse, at start-up and naming the setting, what this connector does not move; return the
    transfer groups (``kv_cache_config.transfer_group_ids``, as NixlConnector moves them)."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1 and (vllm_config.kv_transfer_config.kv_role != "kv_producer"
                                                 or is_hybrid(kv_cache_config)):
        raise ConnectorConfigError(  # a decode reads a prefill's stages into PP 1 (``pp_stages``)
            f"KvxferConnector supports pipeline_parallel_size {parallel.pipeline_parallel_size} only on a "
            "kv_producer (a prefill's stages read into a decode of PP 1) without a hybrid model; "
            f"this instance is {vllm_config.kv_transfer_config.kv_role}")
    if parallel.decode_context_parallel_size != 1 or parallel.prefill_context_parallel_size != 1:
        raise ConnectorConfigError("KvxferConnector does not support decode/prefill context parallelism")
    groups = kv_cache_config.transfer_groups
    kinds = check_kv_cache_groups([[cls.__name__ for cls in type(group.kv_cache_spec).__mro__] for group in groups])
    return tuple(TransferGroup(kind, int(group.kv_cache_spec.block_size),
                               int(getattr(group.kv_cache_spec, "num_speculative_blocks", 0)) if kind == MAMBA else 0)
                 for kind, group in zip(kinds, groups))


class KvxferConnector(KVConnectorBase_V1, SupportsHMA):
    """kvxfer as a vLLM V1 KV connector (``docs/vllm.md``). ``SupportsHMA``: vLLM keeps its hybrid KV
    cache manager on, so a hybrid attention+Mamba model arrives as several groups, which the
    connector moves (one list of block ids per transfer group; ``request_finished_all_groups``)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kv_cfg = vllm_config.kv_transfer_config
        assert kv_cfg is not None and kv_cfg.engine_id is not None
        groups = check_supported(vllm_config, kv_cache_config)
        self.kvxfer_config = KvxferConfig.from_extra_config(kv_cfg.kv_connector_extra_config)
        self.engine_id: str = kv_cfg.engine_id
        self.connector_scheduler: Optional[KvxferScheduler] = None
        self.connector_worker: Optional[KvxferWorker] = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvxferScheduler(vllm_config, self.engine_id, self.kvxfer_config,
                                                       kv_cache_config, groups)
        else:
            self.connector_worker = KvxferWorker(vllm_config, self.engine_id, kv_cache_config, self.kvxfer_config)

    # ---- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta()

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_connector_output(connector_output.finished_sending)

    def on_new_request(self, request: "Request") -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.on_new_request(request)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """vLLM's hybrid manager is off (``--disable-hybrid-kv-cache-manager``): one group."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.set_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
                                             ) -> None:
        """vLLM's engine core hands every worker's metadata keyed ``(pp_rank, tp_rank)`` (``v1/engine/core.py``);
        its default refuses ``pp_rank > 0``. A prefill of PP > 1 serves every stage's ranks (``pp_stages``)."""
        assert self.connector_scheduler is not None
        if all(pp_rank == 0 for pp_rank, _ in metadata):
            return self.connector_scheduler.set_handshake_metadata({tp: meta for (_, tp), meta in metadata.items()})
        self.connector_scheduler.set_handshake_metadata(dict(metadata))

    # ---- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    # ---- sleep mode (vLLM 0.33; 0.32 never calls these) ----------------------------------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Yes, on every backend: the registrations are dropped before vLLM frees the KV cache and made anew
        after it is back (``KvxferWorker.unregister_kv_caches`` / ``restore_kv_caches``); vLLM then serves the
        new metas under a new instance id, and no reader passes a lease check on a cache from before the sleep."""
        return True

    def unregister_kv_caches(self) -> None:
        assert self.connector_worker is not None
        self.connector_worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        assert self.connector_worker is not None
        self.connector_worker.restore_kv_caches()

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        assert self.connector_worker is not None
        return self.connector_worker.handshake_metadata()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self.connector_worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvxferConnectorMetadata)
        self.connector_worker.start_load(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous (between steps): nothing per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing is pushed: the decode reads the producer's blocks where they are."""

    def wait_for_save(self) -> None:
        """Nothing to save."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.connector_worker is not None
        sent, received, failed = self.connector_worker.transfer_results()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Failures are reported per request (``failed_recving``), not per block: a load is verified whole."""
        return set()

    def get_kv_connector_stats(self) -> Optional[KvxferStats]:
        """What changed since the last call: a worker's handoffs, failures and pins, or the scheduler's refused
        exports (vLLM aggregates both every step; ``stats.py``)."""
        half = self.connector_worker if self.connector_worker is not None else self.connector_scheduler
        data = None if half is None else half.interval_stats()
        return None if data is None else KvxferStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> Optional[KvxferStats]:
        return KvxferStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvxferPromMetrics:
        """kvxfer's ``vllm:kvxfer_*`` series in vLLM's ``/metrics`` (``stats.METRICS``), labelled per engine."""
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def kvxfer_stats(self) -> dict[str, Any]:
        """Cumulative counters of this worker (``llm.collective_rpc`` can call it)."""
        assert self.connector_worker is not None
        return self.connector_worker.stats()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
