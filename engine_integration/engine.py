"""The engines: control-plane-neutral handoff, and the coordinator-native variant.

Names and signatures follow Megatron's ``core.inference.disaggregation.engine``:

- ``StateHandoffDynamicInferenceEngine`` -- an engine with a prefill or decode role
  (``setup_kv_transfer``). A prefill instance pins a computed prompt and publishes a
  descriptor; a decode instance pulls and admits handed-off requests. How descriptors
  and read-done travel is left to the caller (``handoff_outbox`` / ``handoff_events``,
  ``add_handoff`` / ``release_handoff``), so any control plane can drive it.
- ``DisaggDynamicInferenceEngine`` -- the same engine speaking this package's
  coordinator protocol (``engine_integration.coordinator``) over ZeroMQ.

The handoff state machines themselves live in ``source``/``sink`` and see the engine
only through ``HandoffEngineAdapter``; this module is the glue for the reference
engine (``engine_integration.reference``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Any, Optional, Sequence

import zmq

from engine_integration import wire
from engine_integration.channel import ClientChannel, resolve_secret
from engine_integration.adapter import ImportedRequest
from engine_integration.descriptor import HandoffDescriptor, RequestId, rank_transfer_meta
from engine_integration.poll import KVPoll
from engine_integration.reference.engine import InferenceRequest, ReferenceDynamicEngine
from engine_integration.sink import HandoffSink, SinkEvent
from engine_integration.source import HandoffSource
from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.errors import KVXferError
from kvxfer.runtime.generations import BlockGenerations, GenerationChecker

log = logging.getLogger("kvxfer.engine")

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)


class RegistrationRefused(KVXferError):
    """The coordinator refused this engine; the message says why (e.g. a geometry mismatch)."""


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
        """Close the counters' registrations first: they are siblings on the pool's agent."""
        if self._generations is not None:
            self.context.allocator.on_recycle = None  # type: ignore[attr-defined]
            self._generations.close()
        if self._generation_checker is not None:
            self._generation_checker.close()
        if self._kv_backend is not None:
            self._kv_backend.close()

    def handoff_stats(self) -> dict[str, int]:
        alloc = self.context.allocator  # type: ignore[attr-defined]
        sink = self._handoff_sink
        return {
            "free_blocks": alloc.num_free, "pinned_blocks": alloc.num_pinned, "pins": alloc.num_pins,
            "queued": len(self.waiting) + (sink.num_queued + sink.num_transferring if sink else 0),  # type: ignore[attr-defined]
            "running": len(self.running),  # type: ignore[attr-defined]
            "quarantined_blocks": sink.num_quarantined_blocks if sink else 0,
        }

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

    Adds the coordinator-native registration and callbacks (``connect``, then call
    ``serve_step`` from the engine loop, or use ``engine_integration.worker.serve``).
    """

    def __init__(self, controller: Any, context: Any) -> None:
        super().__init__(controller, context)
        self._channel: Optional[ClientChannel] = None
        self._coordinator_address: Optional[str] = None
        self._coordinator_process: Any = None
        self._coordinator_secret: Optional[str] = None  # the secret of a coordinator we spawned
        self._coordinator_secret_file: Optional[str] = None
        self._coordinator_insecure = False
        self._owned_secret_file: Optional[str] = None   # generated for a spawned coordinator; removed with it
        self.refused_messages: dict[str, int] = {}       #: coordinator messages refused here, by reason
        self._disagg_role: Optional[str] = None
        self._disagg_identity: Optional[str] = None
        self.incarnation = uuid.uuid4().hex[:12]
        self.shutdown_reason: Optional[str] = None
        self._last_heartbeat = 0.0
        self._last_heard = time.monotonic()
        self.heartbeat_interval_s = 0.2
        self.coordinator_timeout_s = 10.0

    def set_disaggregation_config(self, *, role: str, identity: str, spawn_coordinator: bool,
                                  coordinator_group: Any) -> None:
        """Configure one coordinator-native prefill or decode instance.

        ``coordinator_group`` is the coordinator's address (``tcp://host:port``); with
        ``spawn_coordinator`` it may instead be a ``CoordinatorConfig`` (or ``None``)
        and a coordinator process is started here. A spawned coordinator is never
        unauthenticated by accident: without a secret in the config (or
        ``$KVXFER_SECRET_FILE``) a fresh one is written to a 0600 file,
        ``coordinator_secret_file``, which other engines of the cluster are given.
        """
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self._disagg_role, self._disagg_identity = role, identity
        if spawn_coordinator:
            from dataclasses import replace

            from engine_integration.coordinator import CoordinatorConfig, start_coordinator_process
            from kvxfer.security.auth import SECRET_FILE_ENV, new_secret_file

            cfg = coordinator_group if isinstance(coordinator_group, CoordinatorConfig) else CoordinatorConfig()
            if cfg.secret is None and cfg.secret_file is None and not cfg.insecure \
                    and not os.environ.get(SECRET_FILE_ENV):
                self._owned_secret_file = new_secret_file()
                cfg = replace(cfg, secret_file=self._owned_secret_file)
            self._coordinator_process, self._coordinator_address = start_coordinator_process(cfg)
            self._coordinator_secret, self._coordinator_secret_file = cfg.secret, cfg.secret_file
            self._coordinator_insecure = cfg.insecure
        else:
            if not isinstance(coordinator_group, str):
                raise ValueError("coordinator_group must be the coordinator's address when not spawning one")
            self._coordinator_address = coordinator_group

    @property
    def coordinator_secret_file(self) -> Optional[str]:
        """The secret file of a coordinator this engine spawned (give it to the cluster's other engines)."""
        return self._coordinator_secret_file

    def connect(self, *, backend: str = "local", transfer_timeout_s: float = 30.0, queue_timeout_s: float = 120.0,
                register_timeout_s: float = 30.0, heartbeat_interval_s: float = 0.2,
                coordinator_timeout_s: float = 10.0, secret: Optional[str] = None,
                secret_file: Optional[str] = None, insecure: bool = False) -> None:
        """Set up the transport and register with the coordinator; raises ``RegistrationRefused``.

        ``secret`` (or ``secret_file``, or ``$KVXFER_SECRET_FILE``) keys the encrypted,
        replay-proof control connection; it defaults to that of a coordinator this engine
        spawned. With none, ``insecure=True`` must be asked for by name.
        """

        if self._coordinator_address is None or self._disagg_role is None:
            raise RuntimeError("call set_disaggregation_config first")
        if self._kv_backend is None:
            self.setup_kv_transfer(self._disagg_role, backend, identity=self._disagg_identity,
                                   timeout_s=transfer_timeout_s, queue_timeout_s=queue_timeout_s)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.coordinator_timeout_s = coordinator_timeout_s
        if secret is None and secret_file is None:
            secret, secret_file = self._coordinator_secret, self._coordinator_secret_file
        key = resolve_secret(secret, secret_file=secret_file, insecure=insecure or self._coordinator_insecure,
                             who=f"engine {self.identity!r}")
        try:
            self._channel = ClientChannel(self._coordinator_address, key,
                                          identity=f"{self.identity}/{self.incarnation}".encode(),
                                          handshake_timeout_s=register_timeout_s)
        except KVXferError as exc:
            raise RegistrationRefused(f"{self.identity!r}: {exc}") from None
        self._send(wire.Register(
            role=self.role or "", identity=self.identity, incarnation=self.incarnation, pid=os.getpid(),
            host=socket.gethostname(), model_fingerprint=self.controller.config.fingerprint,
            transfer_meta=self._build_instance_transfer_meta(), capacity_blocks=self.context.num_blocks))
        reply = self._channel.recv(register_timeout_s)
        if reply is None:
            raise RegistrationRefused(f"{self.identity!r}: no answer from the coordinator at "
                                      f"{self._coordinator_address} within {register_timeout_s}s")
        if not isinstance(reply, wire.Registered) or not reply.ok:
            reason = getattr(reply, "reason", f"unexpected reply {type(reply).__name__}")
            raise RegistrationRefused(f"coordinator refused {self.role} {self.identity!r}: {reason}")
        self._last_heard = time.monotonic()
        self._send_heartbeat()

    def _build_instance_transfer_meta(self) -> list[dict[str, Any]]:
        """Flatten this instance's PP/TP transport descriptors for registration.

        One entry per (pp_rank, tp_rank), in rank order; the reference engine has one.
        Each is that rank's KV meta, with a prefill's generation-counter meta beside it
        (``descriptor.rank_transfer_meta``): exported once here, never per request.
        """
        return self.transfer_meta

    def _request_push(self, request_id: RequestId, skip_blocks: int) -> None:
        """Push backends: our receives are posted; the coordinator forwards our meta to the prefill."""
        self._send(wire.SendKV(request_id, self.transfer_meta, skip_blocks))  # type: ignore[arg-type]

    def _on_push_failed(self, request_id: RequestId, reason: str) -> None:
        self._send(wire.Failed(request_id, f"prefill {self.identity!r}: {reason}"[:wire.MAX_TEXT]))  # type: ignore[arg-type]

    def _notify_kv_read_done(self, request_id: RequestId) -> None:
        """Tell the native coordinator that decode no longer needs source storage."""
        self._send(wire.ReadDone(request_id))  # type: ignore[arg-type]

    def _notify_kv_transfer_ready(self, request_id: RequestId, cached_prefix_blocks: int) -> None:
        """Tell the native coordinator that the destination storage is committed."""
        stats = self._handoff_sink.pull_stats.pop(request_id, None) if self._handoff_sink else None
        self._send(wire.TransferReady(request_id, cached_prefix_blocks,  # type: ignore[arg-type]
                                      stats.pulled_blocks if stats else 0, stats.pull_s if stats else 0.0,
                                      stats.queue_s if stats else 0.0, stats.admit_seq if stats else 0))

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
        assert record is not None
        self._send(wire.HandoffReady(request.request_id, record["descriptor"], record["prefill_s"]))  # type: ignore[arg-type]

    def _on_handoff_event(self, event: SinkEvent) -> None:
        if event.state is KVPoll.Success:
            self._notify_kv_transfer_ready(event.request_id, event.cached_prefix_blocks)
            self._notify_kv_read_done(event.request_id)
            return
        if not event.quarantine_cleared:
            self._send(wire.Failed(event.request_id, f"decode {self.identity!r}: {event.reason}"))  # type: ignore[arg-type]
        if event.source_safe:
            self._notify_kv_read_done(event.request_id)

    # --- the loop -------------------------------------------------------------------------
    def _between_decode_chunks(self) -> None:
        """Take new handoffs and finish pulls mid-step, so a long decode batch does not delay them."""
        self._poll_messages()
        self._poll_source()
        if self._handoff_sink is not None:
            for event in self._handoff_sink.step():
                self._on_handoff_event(event)

    def serve_step(self) -> float:
        """Handle coordinator messages, run one engine step, heartbeat.

        Returns how long the loop may wait before the next call: 0 with compute to do
        (or messages just handled), a millisecond with only pulls in flight, else the
        heartbeat interval (an arriving message wakes the loop anyway).
        """
        handled = self._poll_messages()
        if self.shutdown_reason is not None:
            return self.heartbeat_interval_s
        for record in self.step():
            if "error" in record:
                self._send(wire.Failed(record["request_id"], record["error"]))
            else:
                self._send(wire.Finished(record["request_id"], record["tokens"]))
        now = time.monotonic()
        if now - self._last_heartbeat >= self.heartbeat_interval_s:
            self._send_heartbeat()
        if now - self._last_heard > self.coordinator_timeout_s:
            self.shutdown_reason = f"no word from the coordinator for {now - self._last_heard:.1f}s"
        if handled or self.waiting or self.running:
            return 0.0
        sink = self._handoff_sink
        if sink is not None and (sink.num_transferring or sink.num_queued or sink.num_quarantined_blocks):
            return 0.001
        if self._handoff_source is not None and self._handoff_source.pushes_in_flight:
            return 0.001
        return self.heartbeat_interval_s

    def _poll_messages(self) -> int:
        """Handle what the coordinator sent. A message refused by the channel or the schema is
        counted (``refused_messages``); one that fails in its handler is counted, logged and,
        when it names a request, answered with ``Failed``: the engine loop never dies of it."""
        channel = self._channel
        n = 0
        while channel is not None and channel.sock.poll(0, zmq.POLLIN):
            msg = channel.receive()
            n += 1
            if msg is None:
                continue
            self._last_heard = time.monotonic()
            try:
                self._handle(msg)
            except Exception as exc:
                self.refused_messages["handler error"] = self.refused_messages.get("handler error", 0) + 1
                log.warning("engine %r: refused %s: %s: %s", self.identity, type(msg).__name__,
                            type(exc).__name__, exc)
                request_id = getattr(msg, "request_id", None)
                if isinstance(msg, (wire.AddRequest, wire.StartDecode)) and request_id is not None:
                    self._send(wire.Failed(request_id, f"{self.role} {self.identity!r} refused it: {exc}"))
        if channel is not None:
            for reason, count in channel.dropped.items():
                self.refused_messages[reason] = count
        return n

    def _handle(self, msg: wire.Msg) -> None:
        if isinstance(msg, wire.AddRequest):
            self.add_request(msg.request_id, msg.prompt, msg.max_new_tokens)
        elif isinstance(msg, wire.PeerMeta):
            self.add_peer_transfer_meta(msg.identity, msg.transfer_meta)
        elif isinstance(msg, wire.StartDecode):
            self.add_handoff(HandoffDescriptor.from_dict(wire.descriptor_dict(msg.descriptor)), msg.max_new_tokens)
        elif isinstance(msg, wire.PushKV):
            try:
                self.push_handoff(msg.request_id, msg.decode_meta, msg.skip_blocks)
            except (KVXferError, KeyError, ValueError, RuntimeError) as exc:
                log.warning("prefill %r: refused the push of request %s to %r: %s", self.identity, msg.request_id,
                            msg.decode_identity, exc)
                self._send(wire.Failed(msg.request_id, (f"prefill {self.identity!r} refused the push to "  # type: ignore[arg-type]
                                                        f"{msg.decode_identity!r}: {exc}")[:wire.MAX_TEXT]))
        elif isinstance(msg, wire.Release):
            for request_id in msg.request_ids:
                self.release_handoff(request_id)
        elif isinstance(msg, wire.Abort):
            self.abort_request(msg.request_id, msg.reason)
        elif isinstance(msg, wire.Shutdown):
            self.shutdown_reason = msg.reason or "coordinator asked"

    def _send_heartbeat(self) -> None:
        self._last_heartbeat = time.monotonic()
        self._send(wire.Heartbeat(**self.handoff_stats()))

    def _send(self, msg: Any) -> None:
        self._channel.send(msg)  # type: ignore[union-attr]

    @property
    def socket(self) -> Any:
        return self._channel.sock if self._channel is not None else None

    def disconnect(self, reason: str = "") -> None:
        """Say goodbye, close the socket and the transport, stop a spawned coordinator."""
        if self._channel is not None:
            try:
                self._send(wire.Goodbye(reason[:wire.MAX_TEXT]))
            finally:
                self._channel.close(linger_ms=200)
                self._channel = None
        self.close_kv_transfer()
        if self._coordinator_process is not None:
            from engine_integration.coordinator import stop_coordinator_process

            stop_coordinator_process(self._coordinator_process)
            self._coordinator_process = None
        if self._owned_secret_file is not None:
            from kvxfer.security.auth import remove_secret_file

            remove_secret_file(self._owned_secret_file)
            self._owned_secret_file = None
