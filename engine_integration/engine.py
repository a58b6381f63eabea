"""The engines: control-plane-neutral handoff, and the one engine every control plane drives.

Names and signatures follow Megatron's ``core.inference.disaggregation.engine``:

- ``StateHandoffDynamicInferenceEngine`` -- an engine with a prefill or decode role
  (``setup_kv_transfer``). A prefill instance pins a computed prompt and publishes a
  descriptor; a decode instance pulls and admits handed-off requests. How descriptors
  and read-done travel is left to the caller (``handoff_outbox`` / ``handoff_events``,
  ``add_handoff`` / ``release_handoff``), so any external control plane can drive it.
- ``DisaggDynamicInferenceEngine`` -- the same engine with a control plane object
  (``engine_integration.control_plane.base.ControlPlane``): the ZeroMQ coordinator's
  (``control_plane.zmq.CoordinatorPlane``) or etcd's (``control_plane.etcd.EtcdPlane``).
  The engine knows nothing of either: it reports its handoffs to the plane and serves
  the calls the plane makes back (``PlaneEngine``).

The handoff state machines themselves live in ``source``/``sink`` and see the engine
only through ``HandoffEngineAdapter``; this module is the glue for the reference
engine (``engine_integration.reference``).
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Callable, Optional, Sequence

from engine_integration.adapter import ImportedRequest
from engine_integration.control_plane import push_refusal
from engine_integration.control_plane.base import ControlPlane, RegistrationRefused
from engine_integration.descriptor import HandoffDescriptor, RequestId, rank_transfer_meta
from engine_integration.poll import KVPoll
from engine_integration.reference.engine import InferenceRequest, ReferenceDynamicEngine
from engine_integration.sink import HandoffSink, PullStats, SinkEvent
from engine_integration.source import HandoffSource
from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.runtime.generations import BlockGenerations, GenerationChecker

log = logging.getLogger("kvxfer.engine")

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)

__all__ = ["DECODE", "PREFILL", "DisaggDynamicInferenceEngine", "RegistrationRefused",
           "StateHandoffDynamicInferenceEngine"]


class _EngineAdapter:
    """``HandoffEngineAdapter`` over the reference engine's context and batch."""

    def __init__(self, engine: "StateHandoffDynamicInferenceEngine") -> None:
        self._engine = engine
        self._alloc = engine.context.allocator
        self.tokens_per_block = engine.context.tokens_per_block

    def block_hashes(self, tokens: Sequence[int]) -> list[int]:
        return self._engine.context.block_hashes(tokens)

    def allocate_blocks(self, n: int) -> Optional[list[int]]:
        return self._alloc.allocate(n)

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        self._alloc.release(block_ids)

    def pin_blocks(self, block_ids: Sequence[int]) -> None:
        self._alloc.pin(block_ids)

    def unpin_blocks(self, block_ids: Sequence[int]) -> None:
        self._alloc.unpin(block_ids)

    def acquire_cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        return self._alloc.acquire_prefix(hashes)

    def register_block_hashes(self, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        self._alloc.register(block_ids, hashes)

    def admit_decode_request(self, request: ImportedRequest) -> None:
        self._engine._admit_imported(request)


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
                          timeout_s: float = 30.0, queue_timeout_s: float = 120.0, verify_reads: bool = True) -> None:
        """Register the KV pool with the transport named ``backend`` and take ``role``.

        The transfer meta is exported here, once; descriptors only reference it. With
        ``verify_reads`` (torn-read detection, ``kvxfer.runtime.generations``) a prefill also
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
        self._peer_metas: dict[str, list[dict[str, Any]]] = {}
        self._exported: dict[RequestId, HandoffDescriptor] = {}
        self.handoff_outbox: list[HandoffDescriptor] = []
        self.handoff_events: list[SinkEvent] = []
        self.push_outbox: list[tuple[RequestId, int]] = []  #: push backends, decode: (request, skip_blocks) to push
        adapter = _EngineAdapter(self)  # type: ignore[arg-type]
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
        """Remember a prefill instance's static transfer meta (once per instance, not per request)."""
        self._peer_metas[identity] = list(metas)

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


class DisaggDynamicInferenceEngine(StateHandoffDynamicInferenceEngine):
    """Dynamic inference engine with prefill/decode state hand-off support.

    Adds registration with a control plane and the callbacks that keep it informed:
    ``connect(plane, role=..., name=...)``, then call ``serve_step`` from the engine
    loop (or ``engine_integration.worker.serve``). ``plane`` is a
    ``control_plane.base.ControlPlane`` object, or its URL: ``tcp://host:port`` for the
    ZeroMQ coordinator, ``etcd://...`` for the etcd fleet (``open_control_plane``).
    Megatron's way works too: ``set_disaggregation_config(...)`` then ``connect()``.
    """

    def __init__(self, controller: Any, context: Any) -> None:
        super().__init__(controller, context)
        self.plane: Optional[ControlPlane] = None
        self.shutdown_reason: Optional[str] = None  #: set by the plane (or a signal): the loop stops
        self._disagg_role: Optional[str] = None
        self._disagg_identity: Optional[str] = None
        self._plane_target: Any = None               # what connect() uses without a plane argument
        self._spawned: Any = None                    # a coordinator this engine started (stopped with it)
        #: while this file exists the engine computes nothing (no prefill, no decode token) but keeps
        #: serving its plane: heartbeats, handoffs, pulls and commits go on, so a state it holds (a
        #: full pool, a request running) stays put until whoever made the file has seen it
        self.pause_file: Optional[str] = None

    def set_disaggregation_config(self, *, role: str, identity: str, spawn_coordinator: bool,
                                  coordinator_group: Any) -> None:
        """Configure one prefill or decode instance and where its control plane is.

        ``coordinator_group`` is a ``ControlPlane`` object or its URL (``tcp://host:port``:
        a coordinator; ``etcd://...``: the etcd fleet). With ``spawn_coordinator`` it may
        instead be a ``CoordinatorConfig`` (or ``None``) and a coordinator process is started
        here. A spawned coordinator is never unauthenticated by accident: without a secret
        in the config (or ``$KVXFER_SECRET_FILE``) a fresh one is written to a 0600 file,
        ``coordinator_secret_file``, which other engines of the cluster are given.
        """
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self._disagg_role, self._disagg_identity = role, identity
        if spawn_coordinator:
            from engine_integration.control_plane.zmq.coordinator import CoordinatorConfig
            from engine_integration.control_plane.zmq.service import CoordinatorService

            cfg = coordinator_group if isinstance(coordinator_group, CoordinatorConfig) else CoordinatorConfig()
            self._spawned = CoordinatorService(cfg)
            self._spawned.start()
            self._plane_target = self._spawned.url
        elif isinstance(coordinator_group, (str, ControlPlane)):
            self._plane_target = coordinator_group
        else:
            raise ValueError("coordinator_group must be a control plane or its URL (tcp://host:port, etcd://...) "
                             "when not spawning a coordinator")

    @property
    def spawned_coordinator(self) -> Any:
        """The ``CoordinatorService`` this engine started (``set_disaggregation_config(spawn_coordinator=True)``)."""
        return self._spawned

    @property
    def coordinator_secret_file(self) -> Optional[str]:
        """The secret file of a coordinator this engine spawned (give it to the cluster's other engines)."""
        return self._spawned.secret_file if self._spawned is not None else None

    def connect(self, plane: Any = None, *, role: Optional[str] = None, name: Optional[str] = None,
                backend: str = "local", transfer_timeout_s: float = 30.0, queue_timeout_s: float = 120.0,
                verify_reads: bool = True, register_timeout_s: float = 30.0, **plane_options: Any) -> None:
        """Set up the transport and register with the control plane; raises ``RegistrationRefused``.

        ``plane`` (default: ``set_disaggregation_config``'s) is a ``ControlPlane`` or its URL;
        a URL is opened with ``plane_options`` (``open_control_plane``: ``secret``,
        ``secret_file``, ``insecure``, ``heartbeat_interval_s``, ``coordinator_timeout_s``
        for a coordinator; ``password_file``, ``secret_file``, ``insecure`` for etcd). A
        spawned coordinator's secret is the default.
        """
        target = plane if plane is not None else self._plane_target
        role = role or self._disagg_role
        name = name or self._disagg_identity
        if target is None or role is None:
            raise RuntimeError("give connect() a control plane and a role, or call set_disaggregation_config first")
        refused = push_refusal(target, self.backend_name if self._kv_backend is not None else backend)
        if refused:   # before the plane is opened or the transport set up: nothing to undo
            raise RegistrationRefused(f"{refused} (choose a pull backend, or the embedded coordinator's tcp:// plane)")
        if isinstance(target, str):
            from engine_integration.control_plane import open_control_plane

            if self._spawned is not None and plane_options.get("secret") is None \
                    and plane_options.get("secret_file") is None:
                plane_options = {**plane_options, **self._spawned.engine_options()}
            target = open_control_plane(target, **plane_options)
        elif plane_options:
            raise TypeError(f"options {sorted(plane_options)} apply only when connect() opens the plane from its URL")
        if self._kv_backend is None:
            self.setup_kv_transfer(role, backend, identity=name, timeout_s=transfer_timeout_s,
                                   queue_timeout_s=queue_timeout_s, verify_reads=verify_reads)
        self.plane = target
        target.attach(self, timeout_s=register_timeout_s)

    # --- what a control plane reads and calls (``control_plane.base.PlaneEngine``) ------------
    @property
    def model_fingerprint(self) -> str:
        return self.controller.config.fingerprint

    @property
    def capacity_blocks(self) -> int:
        return self.context.num_blocks

    def take_pull_stats(self, request_id: RequestId) -> Optional[PullStats]:
        """How a committed request's pull went (once; ``None`` if not known)."""
        return self._handoff_sink.pull_stats.pop(request_id, None) if self._handoff_sink else None

    def set_commit_guard(self, guard: Optional[Callable[[RequestId], Optional[str]]]) -> None:
        """Decode: asked before each pull is committed; a returned reason fails the request instead."""
        if self._handoff_sink is not None:
            self._handoff_sink.commit_guard = guard

    def handoff_stats(self) -> dict[str, int]:
        figures = super().handoff_stats()
        if self.plane is not None:
            figures.update(self.plane.figures())
        return figures

    def _build_instance_transfer_meta(self) -> list[dict[str, Any]]:
        """Flatten this instance's PP/TP transport descriptors for registration.

        One entry per (pp_rank, tp_rank), in rank order; the reference engine has one.
        Each is that rank's KV meta, with a prefill's generation-counter meta beside it
        (``descriptor.rank_transfer_meta``): exported once, never per request. It is the
        ``transfer_meta`` a control plane registers.
        """
        return self.transfer_meta

    # --- what the engine reports to its plane --------------------------------------------------
    def _record_and_serialize_finished_request(self, request: InferenceRequest) -> Optional[dict[str, Any]]:
        """Send handoff metadata and canonical tokens on the internal decode hop."""
        if self.role == PREFILL:
            descriptor = self._exported.get(request.request_id)
            return {"request_id": request.request_id, "tokens": list(request.prompt) + list(request.generated),
                    "descriptor": descriptor.to_dict() if descriptor else None, "prefill_s": request.prefill_s}
        return StateHandoffDynamicInferenceEngine._record_and_serialize_finished_request(self, request)

    def _publish_handoff(self, request: InferenceRequest, descriptor: HandoffDescriptor) -> None:
        self._exported[request.request_id] = descriptor
        record = self._record_and_serialize_finished_request(request)
        self._exported.pop(request.request_id, None)
        assert record is not None and self.plane is not None
        self.plane.publish(request.request_id, descriptor, record["prefill_s"])

    def _on_handoff_event(self, event: SinkEvent) -> None:
        if event.state is KVPoll.Success:
            self._notify_kv_transfer_ready(event.request_id, event.cached_prefix_blocks)
            self._notify_kv_read_done(event.request_id)
            return
        if not event.quarantine_cleared:
            self.plane.pull_failed(event.request_id, event.reason)  # type: ignore[union-attr]
        if event.source_safe:
            self._notify_kv_read_done(event.request_id, failure=event.reason)

    def _notify_kv_read_done(self, request_id: RequestId, failure: str = "") -> None:
        """Tell the control plane that decode no longer needs source storage."""
        self.plane.read_done(request_id, failure)  # type: ignore[union-attr]

    def _notify_kv_transfer_ready(self, request_id: RequestId, cached_prefix_blocks: int) -> None:
        """Tell the control plane that the destination storage is committed."""
        self.plane.transfer_ready(request_id, cached_prefix_blocks, self.take_pull_stats(request_id))  # type: ignore[union-attr]

    def _request_push(self, request_id: RequestId, skip_blocks: int) -> None:
        """Push backends: our receives are posted; the plane asks the prefill to push to us."""
        self.plane.request_push(request_id, skip_blocks)  # type: ignore[union-attr]

    def _on_push_failed(self, request_id: RequestId, reason: str) -> None:
        self.plane.push_failed(request_id, reason)  # type: ignore[union-attr]

    # --- the loop -------------------------------------------------------------------------
    def paused(self) -> bool:
        return self.pause_file is not None and os.path.exists(self.pause_file)

    def step(self) -> list[dict[str, Any]]:
        if not self.paused():
            return StateHandoffDynamicInferenceEngine.step(self)
        self._poll_source()
        if self._handoff_sink is not None:
            for event in self._handoff_sink.step():
                self._on_handoff_event(event)
        return []

    def _between_decode_chunks(self) -> None:
        """Take new handoffs and finish pulls mid-step, so a long decode batch does not delay them."""
        if self.plane is not None:
            self.plane.poll()
        self._poll_source()
        if self._handoff_sink is not None:
            for event in self._handoff_sink.step():
                self._on_handoff_event(event)

    def serve_step(self) -> float:
        """Act on the plane, run one engine step, report what finished; returns how long the loop may wait.

        0 with compute to do (or plane news just handled), a millisecond with only pulls or
        pushes in flight, else whatever the plane asks (its next heartbeat or poll; a plane
        with a ``wake_socket`` is woken by news sooner).
        """
        plane = self.plane
        assert plane is not None, "connect() first"
        handled = plane.poll()
        if self.shutdown_reason is not None:
            return plane.wait_s()
        for record in self.step():
            plane.finished(record)
        plane.tick()
        if handled or ((self.waiting or self.running) and not self.paused()):
            return 0.0
        sink = self._handoff_sink
        if sink is not None and (sink.num_transferring or sink.num_queued or sink.num_quarantined_blocks):
            return 0.001
        if self._handoff_source is not None and self._handoff_source.pushes_in_flight:
            return 0.001
        return plane.wait_s()

    @property
    def socket(self) -> Any:
        """The plane's ``wake_socket`` (a zmq socket to poll), or ``None``."""
        return self.plane.wake_socket if self.plane is not None else None

    def disconnect(self, reason: str = "") -> None:
        """Say goodbye to the plane, close the transport, stop a spawned coordinator; idempotent."""
        plane, self.plane = self.plane, None
        try:
            if plane is not None:
                plane.detach(reason)
        finally:
            self.close_kv_transfer()
            spawned, self._spawned = self._spawned, None
            if spawned is not None:
                spawned.stop()
