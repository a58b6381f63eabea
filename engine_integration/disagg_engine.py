"""The engine every control plane drives: ``DisaggDynamicInferenceEngine``.

The handoff engine (``handoff_engine.StateHandoffDynamicInferenceEngine``) with a control plane
object (``engine_integration.control_plane.base.ControlPlane``): the ZeroMQ coordinator's
(``control_plane.zmq.CoordinatorPlane``) or etcd's (``control_plane.etcd.EtcdPlane``). The
engine knows nothing of either: it registers (``connect``), reports its handoffs to the plane
(``publish``, ``transfer_ready``, ``read_done``, ``pull_failed``, ``finished``,
``request_push``), serves the calls the plane makes back (``PlaneEngine``) and runs the serve
loop's step (``serve_step``).

One job: the glue between the handoff engine and a plane. It imports a plane package only to spawn a
ZeroMQ coordinator (lazily); its row of ``LAYERS`` in tests/project/test_library_layout.py says the rest.
Nothing imports it but ``engine``, ``worker`` and the package's lazy names.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from engine_integration.control_plane import push_refusal
from engine_integration.control_plane.base import ControlPlane, RegistrationRefused
from engine_integration.descriptor import HandoffDescriptor, RequestId
from engine_integration.handoff_engine import PREFILL, ROLES, StateHandoffDynamicInferenceEngine
from engine_integration.reference.engine import InferenceRequest
from engine_integration.sink import PullStats, SinkEvent
from kvxfer.defaults import TRANSFER_TIMEOUT_S
from kvxfer.handoff.poll import KVPoll

__all__ = ["DisaggDynamicInferenceEngine"]


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
                backend: str = "local", transfer_timeout_s: float = TRANSFER_TIMEOUT_S, queue_timeout_s: float = 120.0,
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
