"""The connector's worker role: one registration of vLLM's KV buffer, then pins (producer) and
loads (consumer) driven by the scheduler's metadata each step.

``register_kv_caches`` turns vLLM's per-layer tensors into the fewest contiguous regions
(``kv_buffers``: one on vLLM's CPU layout) and registers them with the configured kvxfer
backend, plus an int64 lease table (producer) and a lease scratch (consumer) on the same
transport agent. ``get_handshake_metadata`` hands the metas to the scheduler, which serves
them. Each step, ``start_load`` pins what finished exporting and starts loads;
``transfer_results`` reports what was sent (pins gone) and received (or failed).
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.integrations.vllm.attn_format import attention_facts
from kvxfer.integrations.vllm.config import KvxferConfig
from kvxfer.integrations.vllm.handshake import EngineLayout, Handshake, rank_agent_name
from kvxfer.integrations.vllm.handshake_cache import HandshakeCache, confirm_rank_sources
from kvxfer.integrations.vllm.kv_buffers import (TensorPlacement, hma_pages_region, kv_regions, layout_signature,
                                                 page_layout)
from kvxfer.integrations.vllm.metadata import KvxferConnectorMetadata, KvxferHandshakeMetadata
from kvxfer.integrations.vllm.receiver import Receiver
from kvxfer.integrations.vllm.sender import Sender
from kvxfer.meta.seal import meta_key_from_env, unauthenticated_metas_allowed_by_env

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


def is_hybrid(kv_cache_config: "KVCacheConfig") -> bool:
    """Several transfer groups (vLLM's hybrid KV cache manager): moved as pages (``hma_pages_region``)."""
    return len(kv_cache_config.transfer_group_ids) > 1


def kv_group_facts(kv_cache_config: "KVCacheConfig", kv_caches: Optional[dict[str, torch.Tensor]] = None
                   ) -> list[dict[str, Any]]:
    """Per transfer group, what decides the bytes of its pages, for the handshake to compare: the spec
    kind, layers, block size and page size; for Mamba also the state shapes and dtypes, vLLM's
    ``mamba_cache_mode`` and speculative slots, the conv state layout (``VLLM_SSM_CONV_STATE_LAYOUT``:
    SD and DS order the same conv state differently) and the Mamba type (its conv bands); for attention
    the page as its views show it (``kv_buffers.page_layout``: the order of heads and tokens, their
    sizes, a kernel block split): what a read of parts of a page across TP sizes needs (``hybrid_tp``)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    out = []
    for group in kv_cache_config.transfer_groups:
        spec = group.kv_cache_spec
        facts: dict[str, Any] = {"spec": type(spec).__name__, "layers": len(group.layer_names),
                                 "block_size": int(spec.block_size), "page_bytes": int(spec.page_size_bytes)}
        if isinstance(spec, MambaSpec):
            from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

            facts.update(shapes=[list(shape) for shape in spec.shapes],
                         dtypes=[str(d).removeprefix("torch.") for d in spec.dtypes],
                         mamba_cache_mode=spec.mamba_cache_mode, spec_blocks=int(spec.num_speculative_blocks),
                         conv_layout=str(get_conv_state_layout()),
                         mamba_type=str(getattr(spec.mamba_type, "name", spec.mamba_type)))
        else:
            facts["dtype"] = str(getattr(spec, "dtype", "")).removeprefix("torch.")
            views = [kv_caches[name] for name in group.layer_names if kv_caches and name in kv_caches]
            if views:
                facts.update(page_layout(views[0], kv_cache_config.num_blocks))
        out.append(facts)
    return out


def engine_model(vllm_config: "VllmConfig", kv_cache_config: Optional["KVCacheConfig"] = None,
                 kv_caches: Optional[dict[str, torch.Tensor]] = None, block_size: Optional[int] = None
                 ) -> dict[str, Any]:
    """The model facts both sides must share for their KV bytes to mean the same (a hybrid model's
    groups too, and the attention backend with its packing of a block, ``attn_format``: a mismatch is
    refused by ``check_compatible`` before any byte moves)."""
    mc = vllm_config.model_config
    facts = {
        "architectures": list(getattr(mc.hf_config, "architectures", None) or []),
        "num_layers": mc.get_total_num_hidden_layers(),
        "num_kv_heads": mc.get_total_num_kv_heads(),
        "head_size": mc.get_head_size(),
        "dtype": str(mc.dtype).removeprefix("torch."),
        "kv_dtype": str(vllm_config.cache_config.cache_dtype),
        "use_mla": bool(getattr(mc, "use_mla", False)),  # one latent cache per layer: read whole, any TP
        **attention_facts(vllm_config, block_size or vllm_config.cache_config.block_size),
    }
    if kv_cache_config is not None and is_hybrid(kv_cache_config):
        facts["kv_groups"] = kv_group_facts(kv_cache_config, kv_caches)
        hf = mc.hf_config  # Mamba2's B/C groups, whole model (a rank's share depends on the TP size)
        groups = getattr(hf, "mamba_n_groups", None) or getattr(hf, "n_groups", None)
        if isinstance(groups, int) and not isinstance(groups, bool):
            facts["mamba_ngroups"] = groups
    return facts


#: What a producer's retired lease table holds in every slot once its registration is dropped (sleep mode):
#: larger than any lease, so every lease read of it fails (``lease_holds``), e.g. a same-host reader whose
#: transport still reaches the memory (CMA) with an old meta.
LEASE_OVER = 2 ** 63 - 1


class KvxferWorker:
    def __init__(self, vllm_config: "VllmConfig", engine_id: str, kv_cache_config: "KVCacheConfig",
                 cfg: KvxferConfig, *, tp_rank: Optional[int] = None, pp_rank: Optional[int] = None) -> None:
        """``tp_rank``, ``pp_rank``: this worker's TP rank and pipeline stage; None asks vLLM (its groups are set
        up in a worker; the stage only at PP > 1, where it is sealed in the agent name)."""
        if tp_rank is None:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        if pp_rank is None:
            pp_rank = 0
            if self.pp_size > 1:
                from vllm.distributed.parallel_state import get_pp_group

                pp_rank = get_pp_group().rank_in_group
        self.pp_rank = pp_rank
        kv_cfg = vllm_config.kv_transfer_config
        self.cfg = cfg
        self.engine_id = engine_id
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.is_producer = bool(kv_cfg.is_kv_producer)
        self.is_consumer = bool(kv_cfg.is_kv_consumer)
        self.tp_rank = tp_rank
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self.cluster_key = meta_key_from_env()
        self.backends: list[Any] = []
        self.lease_backend: Any = None
        self.scratch_backend: Any = None
        self.sender: Optional[Sender] = None
        self.receiver: Optional[Receiver] = None
        self.handshakes: Optional[HandshakeCache] = None
        self.layout: Optional[EngineLayout] = None
        self._handshake_payload: Optional[str] = None
        self._last_counters: dict[str, int] = {}
        self._step_spent_s = 0.0  # this step's time inside start_load so far
        self._step_hold_max_s = 0.0  # the longest engine step spent in this connector since the last stats()
        self._regions: list[Any] = []  # what register_kv_caches made of vLLM's tensors, registered again on restore
        self._lease_table: Optional[torch.Tensor] = None
        self.asleep = False  # unregister_kv_caches (vLLM's sleep mode) until restore_kv_caches
        self.registrations = 0  # how many times the KV cache was registered (1 + restores)
        #: what ``unregister_kv_caches`` collected and vLLM hears in the next ``transfer_results``
        self._held_results: tuple[set[str], set[str], set[str]] = (set(), set(), set())
        #: kept alive for good: retired lease tables (LEASE_OVER), and registrations a read may still land in
        self._retired: list[Any] = []

    # --- start-up --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self.kv_cache_config.num_blocks
        if is_hybrid(self.kv_cache_config):
            placements = [TensorPlacement(tuple(t.layers), t.size, t.offset, t.layer_stride, t.block_stride)
                          for t in self.kv_cache_config.kv_cache_tensors]
            regions = [hma_pages_region(kv_caches, placements, num_blocks)]
            groups = kv_group_facts(self.kv_cache_config, kv_caches)
            self.block_size = min(g["block_size"] for g in groups if "shapes" not in g)  # attention's, not Mamba's
            logger.info("kvxfer vllm: hybrid model: KV cache groups %s registered as pages %s", groups,
                        tuple(regions[0].layer_shape))
        else:
            regions = kv_regions(kv_caches, num_blocks)
        signature = layout_signature(regions, self.block_size)
        self.layout = EngineLayout(model=engine_model(self.vllm_config, self.kv_cache_config, kv_caches,
                                                      self.block_size),
                                   tp_size=self.tp_size,
                                   pp_size=self.vllm_config.parallel_config.pipeline_parallel_size,
                                   block_size=self.block_size, regions=tuple(signature["regions"]),
                                   num_blocks=num_blocks)
        self._regions = regions
        self._register()

    def _stage_window(self) -> Optional[list[int]]:
        """This pipeline stage's layers ``[first, count]`` (vLLM's ``get_layers_start_end_indices``, the window
        NixlConnector's push path slices by), None at PP 1."""
        parallel = self.vllm_config.parallel_config
        if parallel.pipeline_parallel_size == 1:
            return None
        start, end = self.vllm_config.model_config.get_layers_start_end_indices(parallel)
        return [int(start), int(end) - int(start)]

    def _register(self) -> None:
        """Register ``_regions`` (vLLM's KV tensors) with a new agent: the KV regions, a fresh lease table
        (producer) or lease scratch (consumer), and the halves that use them; counters carry over."""
        assert self.layout is not None
        regions, num_blocks = self._regions, self.layout.num_blocks
        cls = construct_kv_transfer_backend_class(self.cfg.backend_name)
        agent = rank_agent_name(self.engine_id, self.tp_rank, self.tp_size,  # sealed in each meta: whose they are
                                self.pp_rank, self.pp_size)
        common = dict(timeout_s=self.cfg.transfer_timeout_s, meta_key=self.cluster_key)
        first = cls(agent_name=agent, memory_buffer=regions[0].view,
                    expected_num_blocks=num_blocks * regions[0].head_slabs, **common)
        self.backends = [first] + [  # LBHNC: one slab per head (kv_buffers), so different TP reads its heads
            first.new_registered_buffer(memory_buffer=r.view, expected_num_blocks=num_blocks * r.head_slabs)
            for r in regions[1:]
        ]
        if self.is_producer:
            table = self._lease_table = torch.zeros(self.cfg.lease_slots, dtype=torch.int64)
            self.lease_backend = first.new_registered_buffer(memory_buffer=table, expected_num_blocks=table.numel())
            before = self.sender
            self.sender = Sender(self.backends + [self.lease_backend], table, self.cfg.pin_grace_s)
            if before is not None:
                self.sender.counters = before.counters
            self._handshake_payload = json.dumps({
                "kv": [b.export_meta() for b in self.backends],
                "lease": self.lease_backend.export_meta(),
                "layout": self.layout.to_dict(),
                "stage": self._stage_window(),
            })
        if self.is_consumer:
            scratch = torch.zeros(max(1024, min(num_blocks, 65536)) + 1, dtype=torch.int64)
            self.scratch_backend = first.new_registered_buffer(memory_buffer=scratch, expected_num_blocks=scratch.numel())
            self.handshakes = HandshakeCache(self.cfg.handshake_timeout_s, self.cluster_key,
                                             unauthenticated_metas_allowed_by_env(), prepare=self._confirm_sources)
            before_receiver = self.receiver
            self.receiver = Receiver(tp_rank=self.tp_rank, backend_name=self.cfg.backend_name, layout=self.layout,
                                     regions=self.backends, scratch_backend=self.scratch_backend, scratch=scratch,
                                     handshakes=self.handshakes, cluster_key=self.cluster_key,
                                     handshake_timeout_s=self.cfg.handshake_timeout_s,
                                     transfer_timeout_s=self.cfg.transfer_timeout_s,
                                     spin_s=self.cfg.completion_spin_us / 1e6)
            if before_receiver is not None:
                self.receiver.counters, self.receiver.recent = before_receiver.counters, before_receiver.recent
                self.receiver.interval_handoffs = before_receiver.interval_handoffs
        self.registrations += 1
        total = sum(r.view.numel() * r.view.element_size() for r in regions)
        logger.info("kvxfer vllm: registered %d KV region(s) (%d layers, %.1f MiB, %d blocks) with the %s backend "
                    "as %r", len(regions), sum(len(r.layers) for r in regions), total / 2**20, num_blocks,
                    self.cfg.backend_name, agent)

    # --- vLLM's sleep mode (0.33: ``unregister_kv_caches`` before it frees the KV cache, ``restore_kv_caches``
    # after it mapped the cache again at the same addresses; the engine then asks every worker for its handshake
    # metadata again and hands it to the scheduler, which serves it under a new instance id) -------------------
    def unregister_kv_caches(self) -> None:
        """Drop every registration of the KV cache (idempotent). vLLM drained transfers first; what is still
        here is settled before anything is closed: loads in flight are stepped to their end (at most
        ``transfer_timeout_s``), pins are released with their leases revoked (``released_sleep``), and the
        results reach vLLM in the next ``transfer_results``. The lease table is retired full of LEASE_OVER and
        kept, so no reader with an old ticket or meta can pass a lease check on what the cache holds next."""
        if self.asleep or not self.backends:
            return
        sent, received, failed = self._held_results
        if self.receiver is not None:
            deadline = time.monotonic() + self.cfg.transfer_timeout_s
            while True:
                done, bad = self.receiver.collect()
                received |= done
                failed |= bad
                if not self.receiver.in_flight or time.monotonic() > deadline:
                    break
                time.sleep(0.001)
        keep = self.receiver is not None and self.receiver.in_flight > 0
        if keep:  # a byte may still land in them: never close what a read may still write to
            logger.error("kvxfer vllm: %d load(s) still in flight after transfer_timeout_s=%ss at sleep; their "
                         "registrations are kept until shutdown", self.receiver.in_flight, self.cfg.transfer_timeout_s)
        if self.sender is not None:
            sent |= self.sender.collect()
            sent |= self.sender.release_all("sleep")
        if self._lease_table is not None:
            self._lease_table.fill_(LEASE_OVER)
            self._retired.append(self._lease_table)
            self._lease_table = None
        if self.handshakes is not None:
            self.handshakes.close()
            self.handshakes = None
        windows = self.receiver.window_registrations() if self.receiver is not None else []
        registrations = [self.scratch_backend, self.lease_backend, *windows, *reversed(self.backends)]
        if keep:
            self._retired.extend(b for b in registrations if b is not None)
        else:
            self._close(registrations)
        self.backends, self.lease_backend, self.scratch_backend = [], None, None
        self._handshake_payload = None
        self._held_results = (sent, received, failed)
        self.asleep = True
        logger.info("kvxfer vllm: KV cache unregistered (sleep mode): %d pin(s) released, %d load(s) settled",
                    len(sent), len(received))

    def restore_kv_caches(self) -> None:
        """Register the KV cache again after a sleep (idempotent): the same tensors under a new agent, new metas
        and a new lease table (``get_handshake_metadata`` then answers with them)."""
        if not self.asleep:
            return
        self._register()
        self.asleep = False

    def _confirm_sources(self, handshake: Handshake) -> None:
        """On the handshake cache's pool, never the engine's thread: have the backend check (and
        remember) every meta this rank will read through. ucx without a cluster key asks each
        source process whether it exported its meta: a stopped source fails at ``transfer_timeout_s``,
        a live but busy one is waited for longer (``ucx/confirm.py``); done here, the reads later find
        the answer remembered."""
        if handshake.backend != self.cfg.backend_name:
            return  # refused with both names by check_compatible
        assert self.layout is not None
        confirm_rank_sources(handshake, self.tp_rank, self.layout, self.backends, self.scratch_backend,
                             self.cfg.transfer_timeout_s)

    def handshake_metadata(self) -> Optional[KvxferHandshakeMetadata]:
        return None if self._handshake_payload is None else KvxferHandshakeMetadata(self._handshake_payload)

    # --- every step ------------------------------------------------------------------------
    def start_load(self, metadata: KvxferConnectorMetadata) -> None:
        began = time.perf_counter()
        try:
            self._start_load(metadata)
        finally:
            self._step_spent_s += time.perf_counter() - began

    def _start_load(self, metadata: KvxferConnectorMetadata) -> None:
        if self.asleep and (metadata.sends or metadata.loads):
            logger.error("kvxfer vllm: a step asked for %d export(s) and %d load(s) while the KV cache is "
                         "unregistered (sleep mode); ignored", len(metadata.sends), len(metadata.loads))
            return
        for spec in metadata.sends:
            if self.sender is None:
                logger.error("kvxfer vllm: asked to export request %s but this instance is not a kv producer",
                             spec.request_id)
                continue
            self.sender.pin(spec)
        for spec in metadata.loads:
            if self.receiver is None:
                logger.error("kvxfer vllm: asked to load request %s but this instance is not a kv consumer",
                             spec.request_id)
                continue
            self.receiver.submit(spec)

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)``."""
        began = time.perf_counter()
        sent = self.sender.collect() if self.sender is not None and not self.asleep else set()
        received, failed = self.receiver.collect() if self.receiver is not None and not self.asleep else (set(), set())
        if any(self._held_results):  # settled by unregister_kv_caches
            sent, received, failed = (sent | self._held_results[0], received | self._held_results[1],
                                      failed | self._held_results[2])
            self._held_results = (set(), set(), set())
        # vLLM calls start_load, runs the model, then calls this, once per step: the step spent here
        # the two calls' time, never the model's forward between them (a first forward compiles)
        held = self._step_spent_s + time.perf_counter() - began
        self._step_spent_s = 0.0
        self._step_hold_max_s = max(self._step_hold_max_s, held)
        return sent, received, failed

    def stats(self) -> dict[str, Any]:
        """Cumulative counters (for tests, ``kvxfer bench-vllm`` and operators via ``collective_rpc``)."""
        out: dict[str, Any] = {"backend": self.cfg.backend_name, "tp_rank": self.tp_rank,
                               "step_hold_max_s": self._step_hold_max_s, "asleep": self.asleep,
                               "registrations": self.registrations}
        self._step_hold_max_s = 0.0
        if self.sender is not None:
            out.update(self.sender.counters, pins_held=self.sender.held)
        if self.receiver is not None:
            out.update(self.receiver.counters, loads_in_flight=self.receiver.in_flight, loads=self.receiver.states(),
                       recent=list(self.receiver.recent),
                       handshake_fetches=self.handshakes.fetches if self.handshakes is not None else 0,
                       handshakes_cached=len(self.handshakes) if self.handshakes is not None else 0,
                       scratch_free=self.receiver.slots.free,
                       scratch_quarantined=self.receiver.slots.quarantined)
        out["transport"] = [b.stats() for b in self.backends]
        if self.layout is not None:
            out["layout"] = self.layout.to_dict()  # what this rank's handshake says of its KV cache
        return out

    def interval_stats(self) -> Optional[dict[str, Any]]:
        """What changed since the last call, for vLLM's stats pipeline (None when nothing did)."""
        now = {**(self.sender.counters if self.sender else {}), **(self.receiver.counters if self.receiver else {})}
        data: dict[str, Any] = {name: value - self._last_counters.get(name, 0) for name, value in now.items()}
        self._last_counters = now
        handoffs: list[tuple[float, int, int]] = []
        if self.receiver is not None:
            handoffs, self.receiver.interval_handoffs = self.receiver.interval_handoffs, []
        if not handoffs and not any(data.values()):
            return None
        data["handoff_s"] = [s for s, _, _ in handoffs]  # stats.SERIES: one entry per handoff, in order
        data["handoff_bytes"] = [b for _, b, _ in handoffs]
        data["handoff_descriptors"] = [d for _, _, d in handoffs]
        return data

    def shutdown(self) -> None:
        if self.handshakes is not None:
            self.handshakes.close()
        windows = self.receiver.window_registrations() if self.receiver is not None else []
        self._close([self.scratch_backend, self.lease_backend, *windows, *reversed(self.backends),
                     *(r for r in self._retired if not isinstance(r, torch.Tensor))])

    @staticmethod
    def _close(backends: list[Any]) -> None:
        for backend in backends:
            if backend is not None:
                try:
                    backend.close()
                except Exception:
                    logger.exception("kvxfer vllm: closing a backend failed")
