"""The engine's side of the ZeroMQ coordinator protocol: ``CoordinatorPlane``.

``DisaggDynamicInferenceEngine.connect(CoordinatorPlane(address, secret=...), role=...)``
registers the engine with a coordinator process (``coordinator``) over an encrypted,
replay-proof connection (``channel``), then from the engine loop:

- ``poll`` handles what the coordinator sent: ``AddRequest`` (prefill), ``PeerMeta`` and
  ``StartDecode`` (decode), ``PushKV`` (prefill, push backends), ``Release``, ``Abort``,
  ``Shutdown``. A message refused by the channel or the schema is counted
  (``refused_messages``); one whose handler fails is counted, logged and, when it names a
  request, answered with ``Failed``: the engine loop never dies of a message.
- the engine's reports become messages: ``HandoffReady`` (pinned), ``TransferReady`` and
  ``ReadDone`` (committed; ``ReadDone`` also after a failed pull once no read can be in
  flight), ``Failed``, ``Finished``, ``SendKV`` (push backends: our receives are posted).
- ``tick`` heartbeats with the engine's load figures; a coordinator silent for
  ``coordinator_timeout_s`` stops the engine (``shutdown_reason``).

Routing and admission are the coordinator's; this side only reports and obeys.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Any, Mapping, Optional

import zmq

from engine_integration.control_plane.base import ControlPlane, PlaneEngine, RegistrationRefused, RequestId
from engine_integration.control_plane.zmq import wire
from engine_integration.control_plane.zmq.channel import ClientChannel, resolve_secret
from kvxfer.defaults import MAX_TIMEOUT_S, MIN_TIMEOUT_S, bounded_float
from kvxfer.errors import KVXferError

log = logging.getLogger(__name__)


class CoordinatorPlane(ControlPlane):
    """One engine's connection to a coordinator (see the module docstring)."""

    kind = "zmq"
    supports_push = True

    def __init__(self, address: str, *, secret: Optional[str] = None, secret_file: Optional[str] = None,
                 insecure: bool = False, heartbeat_interval_s: float = 0.2,
                 coordinator_timeout_s: float = 10.0) -> None:
        if not address.startswith("tcp://"):
            raise ValueError(f"a coordinator address is tcp://host:port, got {address!r}")
        self.address = address
        self._secret, self._secret_file, self._insecure = secret, secret_file, insecure
        self.heartbeat_interval_s = bounded_float("heartbeat_interval_s", heartbeat_interval_s, MIN_TIMEOUT_S, 60.0,
                                                  unit="seconds")
        self.coordinator_timeout_s = bounded_float("coordinator_timeout_s", coordinator_timeout_s, MIN_TIMEOUT_S,
                                                   MAX_TIMEOUT_S, unit="seconds")
        self.incarnation = uuid.uuid4().hex[:12]
        self.refused_messages: dict[str, int] = {}      #: coordinator messages refused here, by reason
        self.engine: Optional[PlaneEngine] = None
        self._channel: Optional[ClientChannel] = None
        self._last_heartbeat = 0.0
        self._last_heard = time.monotonic()

    def __repr__(self) -> str:
        return f"CoordinatorPlane({self.address})"

    # --- registration ---------------------------------------------------------------------
    def attach(self, engine: PlaneEngine, *, timeout_s: float) -> None:
        key = resolve_secret(self._secret, secret_file=self._secret_file, insecure=self._insecure,
                             who=f"engine {engine.identity!r}")
        try:
            self._channel = ClientChannel(self.address, key, identity=f"{engine.identity}/{self.incarnation}".encode(),
                                          handshake_timeout_s=timeout_s)
        except KVXferError as exc:
            raise RegistrationRefused(f"{engine.identity!r}: {exc}") from None
        self.engine = engine
        self._send(wire.Register(
            role=engine.role or "", identity=engine.identity, incarnation=self.incarnation, pid=os.getpid(),
            host=socket.gethostname(), model_fingerprint=engine.model_fingerprint,
            transfer_meta=engine.transfer_meta, capacity_blocks=engine.capacity_blocks))
        reply = self._channel.recv(timeout_s)
        if reply is None:
            raise RegistrationRefused(f"{engine.identity!r}: no answer from the coordinator at "
                                      f"{self.address} within {timeout_s}s")
        if not isinstance(reply, wire.Registered) or not reply.ok:
            reason = getattr(reply, "reason", f"unexpected reply {type(reply).__name__}")
            raise RegistrationRefused(f"coordinator refused {engine.role} {engine.identity!r}: {reason}")
        self._last_heard = time.monotonic()
        self._heartbeat()

    # --- what the coordinator says ----------------------------------------------------------
    def poll(self) -> int:
        channel, engine = self._channel, self.engine
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
                log.warning("engine %r: refused %s: %s: %s", engine.identity if engine else "?", type(msg).__name__,
                            type(exc).__name__, exc)
                request_id = getattr(msg, "request_id", None)
                if isinstance(msg, (wire.AddRequest, wire.StartDecode)) and request_id is not None and engine:
                    self._send(wire.Failed(request_id, f"{engine.role} {engine.identity!r} refused it: {exc}"[:wire.MAX_TEXT]))
        if channel is not None:
            for reason, count in channel.dropped.items():
                self.refused_messages[reason] = count
        return n

    def _handle(self, msg: wire.Msg) -> None:
        from engine_integration.descriptor import HandoffDescriptor

        engine = self.engine
        assert engine is not None
        if isinstance(msg, wire.AddRequest):
            engine.add_request(msg.request_id, msg.prompt, msg.max_new_tokens)
        elif isinstance(msg, wire.PeerMeta):
            engine.add_peer_transfer_meta(msg.identity, msg.transfer_meta)
        elif isinstance(msg, wire.StartDecode):
            engine.add_handoff(HandoffDescriptor.from_dict(wire.descriptor_dict(msg.descriptor)), msg.max_new_tokens)
        elif isinstance(msg, wire.PushKV):
            try:
                engine.push_handoff(msg.request_id, msg.decode_meta, msg.skip_blocks)
            except (KVXferError, KeyError, ValueError, RuntimeError) as exc:
                log.warning("prefill %r: refused the push of request %s to %r: %s", engine.identity, msg.request_id,
                            msg.decode_identity, exc)
                self._send(wire.Failed(msg.request_id, (f"prefill {engine.identity!r} refused the push to "
                                                        f"{msg.decode_identity!r}: {exc}")[:wire.MAX_TEXT]))
        elif isinstance(msg, wire.Release):
            for request_id in msg.request_ids:
                engine.release_handoff(request_id)
        elif isinstance(msg, wire.Abort):
            engine.abort_request(msg.request_id, msg.reason)
        elif isinstance(msg, wire.Shutdown):
            engine.shutdown_reason = msg.reason or "coordinator asked"

    # --- what the engine reports --------------------------------------------------------------
    def publish(self, request_id: RequestId, descriptor: Any, prefill_s: float) -> None:
        self._send(wire.HandoffReady(request_id, descriptor.to_dict(), prefill_s))  # type: ignore[arg-type]

    def transfer_ready(self, request_id: RequestId, cached_prefix_blocks: int, stats: Any) -> None:
        self._send(wire.TransferReady(request_id, cached_prefix_blocks,  # type: ignore[arg-type]
                                      stats.pulled_blocks if stats else 0, stats.pull_s if stats else 0.0,
                                      stats.queue_s if stats else 0.0, stats.admit_seq if stats else 0))

    def read_done(self, request_id: RequestId, failure: str = "") -> None:
        self._send(wire.ReadDone(request_id))  # type: ignore[arg-type]

    def pull_failed(self, request_id: RequestId, reason: str) -> None:
        assert self.engine is not None
        self._send(wire.Failed(request_id, f"decode {self.engine.identity!r}: {reason}"[:wire.MAX_TEXT]))  # type: ignore[arg-type]

    def finished(self, record: Mapping[str, Any]) -> None:
        if "error" in record:
            self._send(wire.Failed(record["request_id"], str(record["error"])[:wire.MAX_TEXT]))
        else:
            self._send(wire.Finished(record["request_id"], list(record["tokens"])))

    def request_push(self, request_id: RequestId, skip_blocks: int) -> None:
        assert self.engine is not None
        self._send(wire.SendKV(request_id, self.engine.transfer_meta, skip_blocks))  # type: ignore[arg-type]

    def push_failed(self, request_id: RequestId, reason: str) -> None:
        assert self.engine is not None
        self._send(wire.Failed(request_id, f"prefill {self.engine.identity!r}: {reason}"[:wire.MAX_TEXT]))  # type: ignore[arg-type]

    # --- the loop ---------------------------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat >= self.heartbeat_interval_s:
            self._heartbeat()
        if now - self._last_heard > self.coordinator_timeout_s and self.engine is not None:
            self.engine.shutdown_reason = f"no word from the coordinator for {now - self._last_heard:.1f}s"

    def wait_s(self) -> float:
        return self.heartbeat_interval_s   # an arriving message wakes the loop anyway (``wake_socket``)

    @property
    def wake_socket(self) -> Any:
        return self._channel.sock if self._channel is not None else None

    def _heartbeat(self) -> None:
        assert self.engine is not None
        self._last_heartbeat = time.monotonic()
        figures = self.engine.handoff_stats()
        if self.engine.role == "decode":   # what routers must stop expecting cached here
            figures["evicted"] = self.engine.recent_evictions()
        self._send(wire.Heartbeat(**{k: figures[k] for k in wire.Heartbeat.__struct_fields__ if k in figures}))

    def _send(self, msg: Any) -> None:
        if self._channel is not None:
            self._channel.send(msg)

    def detach(self, reason: str = "") -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            try:
                channel.send(wire.Goodbye(reason[:wire.MAX_TEXT]))
            finally:
                channel.close(linger_ms=200)
