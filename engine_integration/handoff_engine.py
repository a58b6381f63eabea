"""The control-plane-neutral handoff engine: ``InferenceStateHandoffMixin`` and ``StateHandoffDynamicInferenceEngine``.

Names and signatures follow Megatron's ``core.inference.disaggregation`` (its
``inference_state_handoff.InferenceStateHandoffMixin`` and its engine):

- ``InferenceStateHandoffMixin`` -- transport setup (``setup_kv_transfer``: the backend, the
  transfer meta exported once, the torn-read counters) and the role-independent handoff
  plumbing (peer metas, ``add_handoff`` / ``release_handoff``, push hooks, stats).
- ``StateHandoffDynamicInferenceEngine`` -- the reference engine with a prefill or decode
  role. A prefill instance pins a computed prompt and publishes a descriptor; a decode
  instance pulls and admits handed-off requests. How descriptors and read-done travel is
  left to the caller (``handoff_outbox`` / ``handoff_events``, ``add_handoff`` /
  ``release_handoff``), so any external control plane can drive it.

One job: the engine side of a handoff, with no control plane. The state machines live in
``source``/``sink`` and see the engine only through ``reference_adapter.ReferenceEngineAdapter``.
Its imports: its row of ``LAYERS`` in tests/project/test_library_layout.py (no plane package, no
``disagg_engine``).
"""

from __future__ import annotations

import os
import uuid
from collections import OrderedDict
from typing import Any, Optional, Sequence

from engine_integration.adapter import ImportedRequest
from engine_integration.descriptor import HandoffDescriptor, RequestId, rank_transfer_meta
from engine_integration.reference.engine import InferenceRequest, ReferenceDynamicEngine
from engine_integration.reference_adapter import ReferenceEngineAdapter
from engine_integration.sink import HandoffSink, SinkEvent
from engine_integration.source import HandoffSource
from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.defaults import TRANSFER_TIMEOUT_S
from kvxfer.handoff.poll import KVPoll
from kvxfer.handoff.generations import BlockGenerations, GenerationChecker

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)
#: Prefill instances whose transfer metas a decode keeps (each restart may be a new identity).
MAX_PEER_METAS = 4096

__all__ = ["DECODE", "PREFILL", "ROLES", "InferenceStateHandoffMixin", "StateHandoffDynamicInferenceEngine"]


class InferenceStateHandoffMixin:
    """Transport setup and the role-independent handoff plumbing."""

    role: Optional[str] = None
    identity: str = ""
    _kv_backend: Any = None
    _generations: Optional[BlockGenerations] = None
    _generation_checker: Optional[GenerationChecker] = None
    _handoff_source: Optional[HandoffSource] = None
    _handoff_sink: Optional[HandoffSink] = None

    def setup_kv_transfer(self, role: str, backend: str = "local", *, identity: Optional[str] = None,
                          timeout_s: float = TRANSFER_TIMEOUT_S, queue_timeout_s: float = 120.0, verify_reads: bool = True) -> None:
        """Register the KV pool with the transport named ``backend`` and take ``role``.

        The transfer meta is exported here, once; descriptors only reference it. With
        ``verify_reads`` (torn-read detection, ``kvxfer.handoff.generations``) a prefill also
        registers one generation counter per block beside the pool, exported in the same
        static meta, and its allocator bumps a block's counter whenever the block is freed
        or reallocated; a decode registers a small scratch vector and checks those counters
        after each pull. It costs one extra small read per request.

        A push backend (``is_push``, e.g. ``nccl``) needs this process in the backend's
        process group before this call (``engine_integration.worker`` joins it). It runs
        Megatron's push order: the decode posts its receives, then asks its prefill to push
        (``push_outbox`` / ``_request_push``), and the prefill pushes (``push_handoff``).
        Reads are not verified there (the generation counters are read by a pull); the
        fingerprint of the source block ids in each pushed message's header is checked instead.
        """
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if self._kv_backend is not None:
            raise RuntimeError(f"{self.identity!r}: KV transfer is already set up")
        identity = identity or f"{role}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        cls = construct_kv_transfer_backend_class(backend)
        self._kv_backend = cls(identity, **self.context.backend_kwargs(), timeout_s=timeout_s)  # type: ignore[attr-defined]
        self.role, self.identity, self.backend_name = role, identity, cls.name
        self.is_push = bool(cls.is_push)
        verify_reads = verify_reads and not self.is_push
        generations_meta = None
        if verify_reads and role == PREFILL:
            self._generations = BlockGenerations(self._kv_backend)
            self.context.allocator.on_recycle = self._generations.bump  # type: ignore[attr-defined]
            generations_meta = self._generations.export_meta()
        elif verify_reads:
            self._generation_checker = GenerationChecker(self._kv_backend)
        self._transfer_meta = [rank_transfer_meta(self._kv_backend.export_meta(), generations_meta)]
        # prefill instance -> its transfer metas, the most recently added last (bounded: MAX_PEER_METAS)
        self._peer_metas: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._exported: dict[RequestId, HandoffDescriptor] = {}
        self.handoff_outbox: list[HandoffDescriptor] = []
        self.handoff_events: list[SinkEvent] = []
        self.push_outbox: list[tuple[RequestId, int]] = []  #: push backends, decode: (request, skip_blocks) to push
        adapter = ReferenceEngineAdapter(self)  # type: ignore[arg-type]
        if role == PREFILL:
            self._handoff_source = HandoffSource(adapter, self._kv_backend, identity, generations=self._generations)
        else:
            self._handoff_sink = HandoffSink(adapter, self._kv_backend, self._lookup_peer_meta,
                                             queue_timeout_s=queue_timeout_s, checker=self._generation_checker)
            if self.is_push:
                self._handoff_sink.on_posted = self._request_push

    @property
    def transfer_meta(self) -> list[dict[str, Any]]:
        return list(self._transfer_meta)

    def add_peer_transfer_meta(self, identity: str, metas: Sequence[dict[str, Any]]) -> None:
        """Remember a prefill instance's static transfer meta (once per instance, not per request). Every
        restart of a prefill may bring a new identity: beyond ``MAX_PEER_METAS`` the least recently added
        are forgotten (a live one's is added again by the plane when it is seen anew)."""
        self._peer_metas.pop(identity, None)
        self._peer_metas[identity] = list(metas)
        while len(self._peer_metas) > MAX_PEER_METAS:
            self._peer_metas.popitem(last=False)

    def _lookup_peer_meta(self, identity: str, index: int) -> Optional[dict[str, Any]]:
        metas = self._peer_metas.get(identity)
        return metas[index] if metas is not None and 0 <= index < len(metas) else None

    def add_handoff(self, descriptor: HandoffDescriptor, max_new_tokens: int) -> None:
        """Decode: queue a handed-off request (its source's meta must be added first or soon)."""
        self._require(DECODE)
        self._handoff_sink.submit(descriptor, max_new_tokens)  # type: ignore[union-attr]

    def _request_push(self, request_id: RequestId, skip_blocks: int) -> None:
        """Decode, push backends: our receives are posted; ask the prefill to push (Megatron's SEND_KV)."""
        self.push_outbox.append((request_id, skip_blocks))

    def push_handoff(self, request_id: RequestId, decode_metas: Sequence[dict[str, Any]], skip_blocks: int = 0) -> None:
        """Prefill, push backends: push a pinned request to the decode ranks of ``decode_metas``
        (the decode's registered transfer metas), which posted their receives first."""
        self._require(PREFILL)
        self._handoff_source.push(request_id, decode_metas, skip_blocks)  # type: ignore[union-attr]

    def release_handoff(self, request_id: RequestId) -> bool:
        """Prefill: the control plane says no read of this request can be in flight."""
        self._require(PREFILL)
        return self._handoff_source.release(request_id)  # type: ignore[union-attr]

    def close_kv_transfer(self) -> None:
        """Close the counters' registrations first: they are siblings on the pool's agent. Idempotent."""
        generations, self._generations = self._generations, None
        checker, self._generation_checker = self._generation_checker, None
        backend, self._kv_backend = self._kv_backend, None
        if generations is not None:
            self.context.allocator.on_recycle = None  # type: ignore[attr-defined]
            generations.close()
        if checker is not None:
            checker.close()
        if backend is not None:
            backend.close()

    def handoff_stats(self) -> dict[str, int]:
        alloc = self.context.allocator  # type: ignore[attr-defined]
        sink = self._handoff_sink
        return {
            "free_blocks": alloc.num_free, "pinned_blocks": alloc.num_pinned, "pins": alloc.num_pins,
            "queued": len(self.waiting) + (sink.num_queued + sink.num_transferring if sink else 0),  # type: ignore[attr-defined]
            "running": len(self.running),  # type: ignore[attr-defined]
            "quarantined_blocks": sink.num_quarantined_blocks if sink else 0,
            "evictions": alloc.evictions,
        }

    def recent_evictions(self) -> list[int]:
        """The newest hashes this pool evicted (``policy.MAX_EVICTED_REPORT`` at most), oldest first: a
        decode reports them with its load figures so routers stop expecting those prefixes here."""
        from engine_integration.control_plane.policy import MAX_EVICTED_REPORT

        return list(self.context.allocator.recent_evictions)[-MAX_EVICTED_REPORT:]  # type: ignore[attr-defined]

    def _require(self, role: str) -> None:
        if self.role != role:
            raise RuntimeError(f"only a {role} instance can do this; this one is {self.role or 'not set up'}")


class StateHandoffDynamicInferenceEngine(InferenceStateHandoffMixin, ReferenceDynamicEngine):
    """Dynamic engine with control-plane-neutral KV/state handoff behavior.

    Without ``setup_kv_transfer`` it is the co-located engine. External control planes
    read ``handoff_outbox`` (prefill) and ``handoff_events`` (decode) after each
    ``step`` and call ``add_handoff`` / ``release_handoff``.
    """

    def __init__(self, controller: Any, context: Any) -> None:
        ReferenceDynamicEngine.__init__(self, controller, context)

    def step(self) -> list[dict[str, Any]]:
        self._poll_source()
        if self._handoff_sink is not None:
            for event in self._handoff_sink.step():
                self._on_handoff_event(event)
        return ReferenceDynamicEngine.step(self)

    def has_unfinished_requests(self) -> bool:
        sink = self._handoff_sink
        return ReferenceDynamicEngine.has_unfinished_requests(self) or bool(
            sink is not None and (sink.num_queued or sink.num_transferring))

    def abort_request(self, request_id: RequestId, reason: str) -> None:
        """Drop a request wherever it is here; pinned source blocks stay pinned (reads may be in flight)."""
        for request in list(self.waiting):
            if request.request_id == request_id:
                self.waiting.remove(request)
        for request in list(self.running):
            if request.request_id == request_id:
                self.running.remove(request)
                self.context.allocator.release(request.block_ids)
        if self._handoff_sink is not None:
            event = self._handoff_sink.abort(request_id, reason)
            if event is not None:
                self._on_handoff_event(event)

    # --- prefill role ---------------------------------------------------------------------
    def _reserve_tokens(self, request: InferenceRequest) -> int:
        if self.role == PREFILL:
            return len(request.prompt)  # a prefill instance never decodes: the prompt is all it stores
        return ReferenceDynamicEngine._reserve_tokens(self, request)

    def _after_prefill(self, request: InferenceRequest) -> None:
        if self.role != PREFILL:
            ReferenceDynamicEngine._after_prefill(self, request)
            return
        self._send_requests_to_coordinator([request])
        self.context.allocator.release(request.block_ids)  # the pins now keep the blocks alive
        self._poll_source()  # between prefills too: some transports serve reads only when we progress

    def _poll_source(self) -> None:
        if self._handoff_source is not None:
            for request_id, state in self._handoff_source.poll_transport():
                self._on_source_released(request_id, state)
            if self._handoff_source.is_push:
                for request_id, reason in self._handoff_source.drain_push_failures():
                    self._on_push_failed(request_id, reason)

    def _send_requests_to_coordinator(self, requests: list[InferenceRequest]) -> None:
        """Register external handoffs before publishing their source descriptors.

        Pinning first means a descriptor can never name a block that is free.
        """
        assert self._handoff_source is not None
        for request in requests:
            self._exported[request.request_id] = self._handoff_source.export(
                request.request_id, request.block_ids, request.prompt, request.generated)
        for request in requests:
            self._publish_handoff(request, self._exported.pop(request.request_id))

    def _publish_handoff(self, request: InferenceRequest, descriptor: HandoffDescriptor) -> None:
        self.handoff_outbox.append(descriptor)

    def _on_source_released(self, request_id: RequestId, state: KVPoll) -> None:
        """Hook: the source released a request's pins (``state`` says how it ended)."""

    def _on_push_failed(self, request_id: RequestId, reason: str) -> None:
        """Hook, push backends: a push of ours failed (its pins are already released)."""

    def _record_and_serialize_finished_request(self, request: InferenceRequest) -> Optional[dict[str, Any]]:
        """A prefill handoff is intermediate, not a ledger/stager completion."""
        if self.role == PREFILL:
            return None
        return ReferenceDynamicEngine._record_and_serialize_finished_request(self, request)

    # --- decode role ----------------------------------------------------------------------
    def _admit_imported(self, imported: ImportedRequest) -> None:
        """Straight into the decode batch: the prompt's K/V is already in our pool."""
        request = InferenceRequest(imported.request_id, imported.prompt, imported.max_new_tokens,
                                   generated=list(imported.resume_tokens), block_ids=list(imported.block_ids),
                                   cached_prefix_blocks=imported.cached_prefix_blocks)
        if request.done:
            self._finish(request)
        else:
            self.running.append(request)

    def _on_handoff_event(self, event: SinkEvent) -> None:
        self.handoff_events.append(event)

