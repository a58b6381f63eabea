"""The engine on the etcd control plane: no coordinator process, the state lives in etcd.

``EtcdDisaggEngine`` is ``StateHandoffDynamicInferenceEngine`` driven by an
``EtcdControlPlane`` (``engine_integration.control_plane``) instead of the ZeroMQ
coordinator. Each ``serve_step`` runs the engine; every ``poll_interval_s`` it takes one
snapshot of the fleet and acts on the verdicts computed from it
(``FleetView.source_verdicts`` / ``reader_verdicts``), so any process that restarts
reaches the same decisions:

prefill
  takes the requests clients routed to it (``requests/<me>/<rid>``, one atomic delete
  each: never run twice), refuses what no live decode pool can hold, computes, pins,
  picks a decode (fewest handoffs in flight, among the live decodes whose pool can hold
  the request) and publishes the handoff under its lease. Verdict ``read_done`` /
  ``failed``: unpin, clear the handoff. ``reader_dead`` (the decode's lease expired, it
  said goodbye or restarted): fail the request to its client and unpin when the
  descriptor carries block generations (a zombie reader fails its torn-read check),
  else only once the death is *confirmed* (restarted under its name, or same host and
  its pid is gone), as the coordinator does.
decode
  adds each new prefill incarnation's transfer metas; verdict ``start``: writes PULLING
  (acknowledged by etcd before any read is posted) and queues the pull; a completed pull
  is committed only while its own lease is valid (self-fencing: ``HandoffSink.commit_guard``),
  then it writes the client's result ``decoding`` and READ_DONE; a failed pull writes
  FAILED once ``storage_safe`` (quarantine as today). ``source_gone`` (the prefill's lease
  expired or it restarted): the request fails to its client at once, the pull is aborted
  and its blocks stay quarantined until ``storage_safe``.

Clients (``EtcdGenerationClient``) write requests under their own lease and read
``results/<client>/`` (``control_plane.requests`` has the records). A request whose
holder dies is failed by the survivor that notices (the decode for a dead prefill, the
prefill for a dead decode) or, when no survivor holds it, by the client itself from
the same snapshot: nothing waits for a timeout.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from engine_integration.fleet_rules import GEOMETRY_FIELDS, process_gone
from engine_integration.control_plane import ControlPlaneError, FleetView, HandoffState, InstanceRecord
from engine_integration.control_plane.etcd import EtcdControlPlane, LeaseGone
from engine_integration.control_plane.records import RecordRefused
from engine_integration.control_plane.requests import (DECODING, DONE, FAILED, RequestRecord, ResultRecord,
                                                       decode_request, decode_result, decode_stats, stats_body)
from engine_integration.descriptor import HandoffDescriptor, RequestId
from engine_integration.engine import DECODE, PREFILL, RegistrationRefused, StateHandoffDynamicInferenceEngine
from engine_integration.poll import KVPoll
from engine_integration.reference.engine import InferenceRequest
from engine_integration.sink import SinkEvent

log = logging.getLogger("kvxfer.engine.etcd")


def tokens_per_block(record: InstanceRecord) -> Optional[int]:
    value = record.transfer_meta[0].get("tokens_per_block") if record.transfer_meta else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def inadmissible(view: FleetView, prompt_tokens: int, max_new_tokens: int) -> Optional[str]:
    """Why no live pool could ever hold this request (None: one can, or none is known yet)."""
    tokens = prompt_tokens + max_new_tokens - 1
    for role, need in (("prefill", prompt_tokens), ("decode", tokens)):
        pools = [(r.capacity_blocks, tokens_per_block(r)) for r in view.live(role)]
        if not pools or any(tpb is None for _, tpb in pools):
            continue
        if all(-(-need // tpb) > cap for cap, tpb in pools):  # type: ignore[operator]
            cap, tpb = max(pools)  # type: ignore[type-var]
            return (f"{prompt_tokens} prompt tokens + {max_new_tokens} new tokens need {-(-need // tpb)} KV blocks "
                    f"of {tpb} tokens on a {role} instance; the largest live {role} pool has {cap} blocks")
    return None


def compatibility_problem(meta: Sequence[dict[str, Any]], fingerprint: str, ref: InstanceRecord) -> Optional[str]:
    where = f"{ref.role} {ref.name!r}"
    if len(meta) != len(ref.transfer_meta):
        return f"{len(meta)} transfer metas (ranks) here, {len(ref.transfer_meta)} on {where}"
    for i, (a, b) in enumerate(zip(meta, ref.transfer_meta)):
        for name in GEOMETRY_FIELDS:
            if a.get(name) != b.get(name):
                return (f"transfer meta [{i}] field {name!r} is {a.get(name)!r} here but {b.get(name)!r} on {where}; "
                        "prefill and decode must use the same transport and KV geometry")
    theirs = ref.extra.get("fingerprint")
    if theirs is not None and theirs != fingerprint:
        return (f"model fingerprint {fingerprint} differs from {theirs} on {where}: "
                "the engines run different models or model configs")
    return None


@dataclass
class _Claimed:
    """Prefill: a request taken from the store, until its handoff ends."""

    request: RequestRecord
    taken_at: float
    reader: str = ""
    reader_incarnation: str = ""
    checked: bool = False          #: its descriptor carries block generations (torn-read checked)
    prefill_s: float = 0.0
    descriptor: Optional[HandoffDescriptor] = None


@dataclass
class _Read:
    """Decode: a handoff this instance took."""

    source: str
    source_incarnation: str
    client: str
    client_lease: int
    max_new_tokens: int
    info: dict[str, Any] = field(default_factory=dict)
    result_written: bool = False   #: a final (failed) result went to the client already
    source_gone: bool = False


class EtcdDisaggEngine(StateHandoffDynamicInferenceEngine):
    """A prefill or decode instance whose control plane is etcd (see the module docstring)."""

    def __init__(self, controller: Any, context: Any) -> None:
        super().__init__(controller, context)
        self.plane: Optional[EtcdControlPlane] = None
        self.me: Optional[InstanceRecord] = None
        self.shutdown_reason: Optional[str] = None
        self.poll_interval_s = 0.25
        self.stats_interval_s = 0.2
        self.publish_timeout_s = 60.0       #: a computed request waits this long for a live decode that fits
        self.view: Optional[FleetView] = None
        self._last_poll = 0.0
        self._last_stats = 0.0
        self._last_figures: Optional[dict[str, int]] = None
        self._claimed: dict[RequestId, _Claimed] = {}
        self._unpublished: list[tuple[InferenceRequest, HandoffDescriptor]] = []
        self._awaiting_death: dict[RequestId, tuple[str, str]] = {}   # rid -> (reader, incarnation): pins kept
        self._routed: dict[str, int] = {}                             # decode -> handoffs routed since the view
        self._reads: dict[RequestId, _Read] = {}
        self._peer_incarnations: dict[str, str] = {}
        self._seen: dict[tuple[str, str], InstanceRecord] = {}        # (name, incarnation) -> its record
        self._retry: list[Any] = []                                   # state writes etcd did not take yet
        self.detections: list[dict[str, Any]] = []                    #: verdicts about dead peers, with times

    # --- registration ---------------------------------------------------------------------
    def connect(self, plane: EtcdControlPlane, *, role: str, name: str, backend: str = "local",
                transfer_timeout_s: float = 30.0, queue_timeout_s: float = 120.0, verify_reads: bool = True) -> None:
        """Set up the transport, check compatibility with the live fleet, register under a fresh lease."""
        if self._kv_backend is None:
            self.setup_kv_transfer(role, backend, identity=name, timeout_s=transfer_timeout_s,
                                   queue_timeout_s=queue_timeout_s, verify_reads=verify_reads)
        self.plane = plane
        self.poll_interval_s = plane.config.poll_interval_s
        fingerprint = self.controller.config.fingerprint
        try:
            view = plane.snapshot()
        except ControlPlaneError as exc:
            raise RegistrationRefused(f"{name!r}: cannot reach the control plane: {exc}") from None
        for ref in view.live():
            if ref.name == name:
                continue
            why = compatibility_problem(self.transfer_meta, fingerprint, ref)
            if why is not None:
                raise RegistrationRefused(f"etcd fleet refused {role} {name!r}: {why}")
        try:
            self.me = plane.register(name=name, role=role, transfer_meta=self.transfer_meta,
                                     capacity_blocks=self.context.num_blocks,
                                     extra={"fingerprint": fingerprint, "backend": self.backend_name})
        except ControlPlaneError as exc:
            raise RegistrationRefused(f"{name!r}: {exc}") from None
        plane.on_lease_lost = self._on_lease_lost
        if self._handoff_sink is not None:
            self._handoff_sink.commit_guard = self._fence
        self._publish_stats(force=True)

    def _on_lease_lost(self, why: str) -> None:
        # Everything of this incarnation is dead to the fleet; the peers act on that (decodes fail
        # our handoffs, prefills free what we pulled). Stop; pins go with the process.
        self.shutdown_reason = f"lost its etcd lease: {why}"

    def _fence(self) -> Optional[str]:
        if self.plane is not None and not self.plane.lease_valid():
            return (f"decode {self.identity!r} may have lost its etcd lease (cut off from etcd): the source may "
                    "already have freed the blocks, KV not committed")
        return None

    # --- the loop -------------------------------------------------------------------------
    def serve_step(self) -> float:
        """Poll the plane when due, run one engine step; returns how long the loop may sleep."""
        if self.shutdown_reason is not None:
            return self.poll_interval_s
        now = time.monotonic()
        polled = False
        if now - self._last_poll >= self.poll_interval_s:
            self._last_poll = now
            polled = True
            try:
                self._poll_plane()
            except ControlPlaneError as exc:   # etcd away: no verdict, nothing freed; fencing covers the rest
                log.warning("%s %r: control plane poll failed: %s", self.role, self.identity, exc)
        for record in self.step():
            self._on_finished(record)
        self._publish_stats(force=False)
        if self.waiting or self.running:
            return 0.0
        sink = self._handoff_sink
        if sink is not None and (sink.num_transferring or sink.num_queued or sink.num_quarantined_blocks):
            return 0.001
        if polled and self._unpublished:
            return 0.0
        return max(0.0, self._last_poll + self.poll_interval_s - time.monotonic())

    def _poll_plane(self) -> None:
        assert self.plane is not None and self.me is not None
        view = self.plane.snapshot()
        self.view = view
        self._routed.clear()
        for record in view.instances.values():
            self._seen[(record.name, record.incarnation)] = record
        if len(self._seen) > 4096:
            self._seen = {k: v for k, v in self._seen.items() if view.is_live(*k)}
        for retry in list(self._retry):
            self._retry.remove(retry)
            retry()
        if self.role == PREFILL:
            self._take_requests(view)
            self._publish_pending()
            self._act_as_source(view)
        else:
            self._act_as_reader(view)

    # --- prefill --------------------------------------------------------------------------
    def _take_requests(self, view: FleetView) -> None:
        plane, me = self.plane, self.me
        assert plane is not None and me is not None
        for kv in plane.range_raw(f"{plane.layout.requests}{me.name}/"):
            key = kv.key.decode(errors="replace")
            try:
                request = decode_request(key, kv.value, kv.lease, plane.layout, plane.cluster_key,
                                         allow_unauthenticated=plane.config.allow_unauthenticated)
            except RecordRefused as exc:
                log.warning("prefill %r: refused request record %s: %s", me.name, key, exc)
                plane.delete(key)
                continue
            if request.prefill_incarnation != me.incarnation or request.request_id in self._claimed:
                continue   # routed to an earlier incarnation of this name: its client fails it
            taken = plane.take(key)
            if taken is None or taken.value != kv.value:
                continue
            why = inadmissible(view, len(request.prompt), request.max_new_tokens)
            if why is not None:
                self._result(request.client, request.client_lease, request.request_id, FAILED,
                             error=f"request refused at submit: {why}")
                continue
            self._claimed[request.request_id] = _Claimed(request, time.monotonic())
            self.add_request(request.request_id, request.prompt, request.max_new_tokens)

    def _publish_handoff(self, request: InferenceRequest, descriptor: HandoffDescriptor) -> None:
        """Pinned: route to a decode and publish under our lease (or keep it until a decode fits)."""
        claim = self._claimed.get(request.request_id)
        if claim is None:   # not a request of ours (cannot happen through the store): unpin
            self.release_handoff(request.request_id)
            return
        claim.prefill_s = request.prefill_s
        claim.descriptor = descriptor
        self._unpublished.append((request, descriptor))
        self._publish_pending()

    def _publish_pending(self) -> None:
        plane = self.plane
        assert plane is not None
        view = self.view if self.view is not None else plane.snapshot()
        for request, descriptor in list(self._unpublished):
            claim = self._claimed[request.request_id]
            rec = claim.request
            decode = self._pick_decode(view, len(rec.prompt) + rec.max_new_tokens - 1)
            if decode is None:
                if time.monotonic() - claim.taken_at < self.publish_timeout_s:
                    continue
                self._unpublished.remove((request, descriptor))
                self._fail_claim(request.request_id, f"no live decode instance could take it within "
                                                     f"{self.publish_timeout_s:.0f}s")
                continue
            payload = {"descriptor": descriptor.to_dict(), "max_new_tokens": rec.max_new_tokens,
                       "client": rec.client, "client_lease": str(rec.client_lease), "prefill_s": claim.prefill_s}
            try:
                plane.publish_handoff(str(request.request_id), reader=decode.name,
                                      reader_incarnation=decode.incarnation, descriptor=payload)
            except ControlPlaneError as exc:   # not published: no reader knows it, the pins may go
                self._unpublished.remove((request, descriptor))
                self._fail_claim(request.request_id, f"prefill {self.identity!r} could not publish: {exc}")
                continue
            self._unpublished.remove((request, descriptor))
            claim.reader, claim.reader_incarnation = decode.name, decode.incarnation
            claim.checked = bool(descriptor.generations)
            self._routed[decode.name] = self._routed.get(decode.name, 0) + 1

    def _pick_decode(self, view: FleetView, tokens: int) -> Optional[InstanceRecord]:
        """Fewest handoffs in flight, among the live decodes whose pool can hold ``tokens``."""
        load: dict[str, int] = {}
        for (_, _), pair in view.handoffs.items():
            if pair.source is not None and not (pair.reader is not None and pair.reader.state.terminal):
                load[pair.source.reader] = load.get(pair.source.reader, 0) + 1
        fits = [d for d in view.live(DECODE)
                if (tpb := tokens_per_block(d)) is None or -(-tokens // tpb) <= d.capacity_blocks]
        if not fits:
            return None
        return min(fits, key=lambda d: (load.get(d.name, 0) + self._routed.get(d.name, 0), d.name))

    def _fail_claim(self, request_id: RequestId, error: str) -> None:
        claim = self._claimed.pop(request_id, None)
        self.release_handoff(request_id)
        if claim is not None:
            self._result(claim.request.client, claim.request.client_lease, str(request_id), FAILED, error=error)

    def _act_as_source(self, view: FleetView) -> None:
        plane, me = self.plane, self.me
        assert plane is not None and me is not None
        for verdict in view.source_verdicts(me.name, me.incarnation):
            rid = verdict.request_id
            claim = self._claimed.pop(rid, None)
            if verdict.action in ("read_done", "failed"):   # the reader says no read is in flight
                self.release_handoff(rid)
            elif verdict.action == "reader_dead":
                pub = verdict.record
                reader, incarnation = pub.reader, pub.reader_incarnation  # type: ignore[union-attr]
                self.detections.append({"verdict": "reader_dead", "request_id": rid, "peer": reader,
                                        "at": time.time(), "detail": verdict.detail})
                log.warning("prefill %r: handoff %s: %s", me.name, rid, verdict.detail)
                client, lease = self._client_of(claim, pub)
                if client:
                    self._result(client, lease, rid, FAILED,
                                 error=f"decode {reader!r} died mid-handoff: {verdict.detail}")
                checked = claim.checked if claim is not None else bool(
                    ((pub.descriptor or {}).get("descriptor") or {}).get("generations"))  # type: ignore[union-attr]
                if checked or self._death_confirmed(reader, incarnation, view):
                    self.release_handoff(rid)
                else:   # read without generations: a silent reader may still read; keep the pins
                    self._awaiting_death[rid] = (reader, incarnation)
            self._clear(verdict.source, rid)
        for rid, (reader, incarnation) in list(self._awaiting_death.items()):
            if self._death_confirmed(reader, incarnation, view):
                del self._awaiting_death[rid]
                self.release_handoff(rid)

    def _death_confirmed(self, reader: str, incarnation: str, view: FleetView) -> bool:
        now = view.instances.get(reader)
        if now is not None and now.incarnation != incarnation:
            return True   # the same name registered again: the old process is gone
        seen = self._seen.get((reader, incarnation))
        return seen is not None and seen.host == socket.gethostname() and process_gone(seen.pid)

    @staticmethod
    def _client_of(claim: Optional[_Claimed], pub: Any) -> tuple[str, int]:
        if claim is not None:
            return claim.request.client, claim.request.client_lease
        payload = (pub.descriptor or {}) if pub is not None else {}
        try:
            return str(payload.get("client", "")), int(payload.get("client_lease", 0))
        except (TypeError, ValueError):
            return "", 0

    def _clear(self, source: str, rid: str) -> None:
        try:
            self.plane.clear_handoff(source, rid)  # type: ignore[union-attr]
        except ControlPlaneError as exc:
            log.warning("%r: could not clear handoff %s/%s (%s); next poll", self.identity, source, rid, exc)

    # --- decode ---------------------------------------------------------------------------
    def _act_as_reader(self, view: FleetView) -> None:
        plane, me = self.plane, self.me
        assert plane is not None and me is not None
        for inst in view.live(PREFILL):
            if self._peer_incarnations.get(inst.name) != inst.incarnation:
                self.add_peer_transfer_meta(inst.name, inst.transfer_meta)   # a new incarnation: fresh metas
                self._peer_incarnations[inst.name] = inst.incarnation
        for verdict in view.reader_verdicts(me.name, me.incarnation):
            rid, source = verdict.request_id, verdict.source
            if verdict.action == "start" and rid not in self._reads:
                self._start(view, source, rid, verdict.record)
            elif verdict.action == "source_gone":
                read = self._reads.get(rid)
                if read is None or read.source_gone:
                    continue
                read.source_gone = True
                self.detections.append({"verdict": "source_gone", "request_id": rid, "peer": source,
                                        "at": time.time(), "detail": verdict.detail})
                log.warning("decode %r: handoff %s: %s", me.name, rid, verdict.detail)
                self._fail_to_client(rid, read, f"prefill {source!r} died mid-handoff: {verdict.detail}")
                self.abort_request(rid, f"prefill {source!r} gone: {verdict.detail}")
            elif verdict.action == "cleanup":
                self._reads.pop(rid, None)
                self._clear(source, rid)

    def _start(self, view: FleetView, source: str, rid: str, pub: Any) -> None:
        plane = self.plane
        assert plane is not None
        payload = pub.descriptor or {}
        try:
            descriptor = HandoffDescriptor.from_dict(payload["descriptor"])
            max_new_tokens = int(payload["max_new_tokens"])
            client, client_lease = str(payload["client"]), int(payload["client_lease"])
            if descriptor.source != source or str(descriptor.request_id) != rid:
                raise ValueError(f"descriptor names {descriptor.source}/{descriptor.request_id}")
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("decode %r: refused handoff %s/%s: %s", self.identity, source, rid, exc)
            self._write_state(source, rid, HandoffState.FAILED, pub.owner_incarnation, f"refused: {exc}")
            return
        read = _Read(source, pub.owner_incarnation, client, client_lease, max_new_tokens,
                     info={"prefill_s": float(payload.get("prefill_s", 0.0))})
        try:   # acknowledged by etcd before any read can be posted
            plane.set_reader_state(source, rid, HandoffState.PULLING, source_incarnation=pub.owner_incarnation)
        except ControlPlaneError as exc:
            log.warning("decode %r: cannot take %s/%s now (%s); next poll", self.identity, source, rid, exc)
            return
        self._reads[rid] = read
        try:
            self.add_handoff(descriptor, max_new_tokens)
        except ValueError as exc:
            self._fail_to_client(rid, read, f"decode {self.identity!r} refused it: {exc}")
            self._write_state(source, rid, HandoffState.FAILED, read.source_incarnation, str(exc))

    def _on_handoff_event(self, event: SinkEvent) -> None:
        rid = str(event.request_id)
        read = self._reads.get(rid)
        if read is None:
            return
        if event.state is KVPoll.Success:
            stats = self._handoff_sink.pull_stats.pop(event.request_id, None) if self._handoff_sink else None
            read.info.update(cached_prefix_blocks=event.cached_prefix_blocks, pulled_blocks=event.pulled_blocks,
                             pull_s=stats.pull_s if stats else 0.0, decode_queue_s=stats.queue_s if stats else 0.0,
                             admit_seq=stats.admit_seq if stats else 0)
            self._result(read.client, read.client_lease, rid, DECODING)   # before READ_DONE: the client sees a holder
            self._write_state(read.source, rid, HandoffState.READ_DONE, read.source_incarnation)
            return
        if not event.quarantine_cleared:
            self._fail_to_client(rid, read, f"decode {self.identity!r} pulling from prefill {read.source!r}: "
                                            f"{event.reason}")
        if event.source_safe:
            self._write_state(read.source, rid, HandoffState.FAILED, read.source_incarnation, event.reason)

    def _write_state(self, source: str, rid: str, state: HandoffState, source_incarnation: str,
                     detail: str = "") -> None:
        def write() -> None:
            try:
                self.plane.set_reader_state(source, rid, state, source_incarnation=source_incarnation,  # type: ignore[union-attr]
                                            detail=detail)
            except ControlPlaneError as exc:
                if self.shutdown_reason is None and not isinstance(exc, LeaseGone):
                    log.warning("decode %r: %s for %s/%s not written (%s); retrying", self.identity, state.value,
                                source, rid, exc)
                    self._retry.append(write)
        write()

    def _fail_to_client(self, rid: str, read: _Read, error: str) -> None:
        if not read.result_written:
            read.result_written = True
            self._result(read.client, read.client_lease, rid, FAILED, error=error)

    # --- results --------------------------------------------------------------------------
    def _on_finished(self, record: dict[str, Any]) -> None:
        rid = str(record["request_id"])
        if self.role == PREFILL:   # only refusals come out of a prefill's step
            if "error" in record:
                self._fail_claim(rid, record["error"])
            return
        read = self._reads.pop(rid, None)
        if read is None:
            return
        if "error" in record:
            self._fail_to_client(rid, read, record["error"])
        else:
            self._result(read.client, read.client_lease, rid, DONE, tokens=record["tokens"], info=read.info)

    def _result(self, client: str, lease: int, rid: str, state: str, *, tokens: Optional[Sequence[int]] = None,
                error: str = "", info: Optional[dict[str, Any]] = None) -> None:
        plane, me = self.plane, self.me
        assert plane is not None and me is not None
        rec = ResultRecord(rid, client, lease, state, me.name, me.incarnation,
                           tuple(int(t) for t in tokens) if tokens is not None else None, error, dict(info or {}))
        try:
            plane.put_record(plane.layout.result(client, rid), rec.body(), lease)
        except LeaseGone:
            log.info("%r: client %r is gone; result of %s dropped", self.identity, client, rid)
        except (ControlPlaneError, ValueError) as exc:
            log.warning("%r: result of %s for %r not written: %s", self.identity, rid, client, exc)

    # --- load figures ---------------------------------------------------------------------
    def handoff_stats(self) -> dict[str, int]:
        figures = super().handoff_stats()
        figures["published"] = sum(1 for c in self._claimed.values() if c.reader)
        figures["awaiting_death"] = len(self._awaiting_death)
        figures["reads"] = len(self._reads)
        return figures

    def _publish_stats(self, *, force: bool) -> None:
        plane, me = self.plane, self.me
        if plane is None or me is None or self.shutdown_reason is not None:
            return
        now = time.monotonic()
        if not force and now - self._last_stats < self.stats_interval_s:
            return
        figures = self.handoff_stats()
        if not force and figures == self._last_figures and now - self._last_stats < 2.0:
            return
        self._last_stats, self._last_figures = now, figures
        try:
            plane.put_record(plane.layout.stat(me.name), stats_body(me.name, me.incarnation, me.lease, figures),
                             me.lease)
        except ControlPlaneError as exc:
            log.debug("%r: stats not published: %s", self.identity, exc)

    def disconnect(self, reason: str = "") -> None:
        """Goodbye (the lease is revoked: every key of ours goes at once), close the transport."""
        if self.plane is not None:
            try:
                self.plane.deregister()
            finally:
                self.plane.close()
        self.close_kv_transfer()


def serve_etcd(engines: Sequence[EtcdDisaggEngine]) -> None:
    """Step every engine until each one stops; never spins idle (sleeps until the next poll).

    SIGTERM stops the loop cleanly (the caller then says goodbye: leases revoked at once).
    """
    import signal

    def _stop(signum: int, _frame: Any) -> None:
        for engine in engines:
            engine.shutdown_reason = engine.shutdown_reason or f"signal {signum}"

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
    while any(e.shutdown_reason is None for e in engines):
        wait = 0.05
        for engine in engines:
            if engine.shutdown_reason is None:
                wait = min(wait, engine.serve_step())
        if wait > 0:
            time.sleep(wait)


# ------------------------------------------------------------------------------------------ client
@dataclass
class _Pending:
    prefill: str
    prefill_incarnation: str
    submitted_at: float


class EtcdGenerationClient:
    """Submit prompts through etcd and collect results in input order (no coordinator).

    Requests and results live under this client's own lease: if it dies, they go.
    ``plane`` is an unregistered ``EtcdControlPlane`` (it is only used to read the fleet
    and to sign records).
    """

    def __init__(self, plane: EtcdControlPlane, *, name: Optional[str] = None) -> None:
        from engine_integration.control_plane.records import check_name

        self.plane = plane
        self.layout = plane.layout
        self.name = check_name("client", name or f"client-{uuid.uuid4().hex[:12]}")
        self.lease, ttl = plane.client.lease_grant(plane.config.ttl_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, args=(max(0.5, ttl / 3.0),), daemon=True,
                                        name=f"etcd-lease-{self.name}")
        self._thread.start()
        self._ids = itertools.count(1)
        self._pending: dict[str, _Pending] = {}
        self._results: dict[str, Any] = {}
        self._view: Optional[FleetView] = None
        self._view_at = 0.0
        self._known: set[str] = set()

    def _keepalive(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.plane.client.lease_keepalive(self.lease)
            except Exception as exc:  # noqa: BLE001 - keep trying until closed
                log.warning("client %r: lease keepalive failed: %s", self.name, exc)

    def view(self, max_age_s: float = 0.0) -> FleetView:
        if self._view is None or time.monotonic() - self._view_at > max_age_s:
            self._view, self._view_at = self.plane.snapshot(), time.monotonic()
        return self._view

    def submit(self, prompt: Sequence[int], max_new_tokens: int, *, wait_for_prefill_s: float = 30.0) -> str:
        from engine_integration.client import GenerationResult

        rid = f"{self.name}.{next(self._ids)}"
        deadline = time.monotonic() + wait_for_prefill_s
        view = self.view(self.plane.config.poll_interval_s)
        while not view.live(PREFILL) and time.monotonic() < deadline:
            time.sleep(self.plane.config.poll_interval_s)
            view = self.view()
        prefills = view.live(PREFILL)
        why = ("the prompt is empty" if not prompt else f"max_new_tokens must be >= 1, got {max_new_tokens}"
               if max_new_tokens < 1 else inadmissible(view, len(prompt), max_new_tokens))
        if why is None and not prefills:
            why = f"no live prefill instance in etcd cluster {self.plane.config.cluster!r}"
        if why is not None:
            self._results[rid] = GenerationResult(None, f"request refused at submit: {why}")
            return rid
        load = {p.name: 0 for p in prefills}
        for pending in self._pending.values():
            if pending.prefill in load:
                load[pending.prefill] += 1
        prefill = min(prefills, key=lambda p: (load[p.name], p.name))
        rec = RequestRecord(rid, self.name, self.lease, prefill.name, prefill.incarnation,
                            tuple(int(t) for t in prompt), int(max_new_tokens))
        self.plane.put_record(self.layout.request(prefill.name, rid), rec.body(), self.lease)
        self._pending[rid] = _Pending(prefill.name, prefill.incarnation, time.monotonic())
        return rid

    def poll(self) -> None:
        """One look at the fleet (first) and at our results (second): deliver, or fail orphans."""
        from engine_integration.client import GenerationResult

        if not self._pending:
            return
        view = self.view()   # before the results: a holder's last word is then never missed
        current: dict[str, ResultRecord] = {}
        for kv in self.plane.range_raw(f"{self.layout.results}{self.name}/"):
            key = kv.key.decode(errors="replace")
            try:
                rec = decode_result(key, kv.value, kv.lease, self.layout, self.plane.cluster_key,
                                    allow_unauthenticated=self.plane.config.allow_unauthenticated)
            except RecordRefused as exc:
                log.warning("client %r: refused result %s: %s", self.name, key, exc)
                continue
            current[rec.request_id] = rec
        for rid, pending in list(self._pending.items()):
            rec = current.get(rid)
            error = None
            if rec is not None and rec.state in (DONE, FAILED):
                self._results[rid] = GenerationResult(
                    rec.tokens, rec.error or None if rec.state == FAILED else None,
                    {k: float(v) for k, v in rec.info.items() if isinstance(v, (int, float))},
                    int(rec.info.get("cached_prefix_blocks", 0)), int(rec.info.get("pulled_blocks", 0)))
                if rec.state == FAILED and not rec.error:
                    self._results[rid] = GenerationResult(None, f"request {rid} failed on {rec.by!r}")
                del self._pending[rid]
                self.plane.delete(self.layout.result(self.name, rid))
                continue
            if rec is not None:   # decoding: held by that decode incarnation
                if not view.is_live(rec.by, rec.by_incarnation):
                    error = f"decode {rec.by!r} died while decoding (its etcd lease expired or it restarted)"
            elif not view.is_live(pending.prefill, pending.prefill_incarnation) \
                    and (pending.prefill, rid) not in view.handoffs:
                error = (f"prefill {pending.prefill!r} died before handing the request off "
                         "(its etcd lease expired or it restarted)")
                self.plane.delete(self.layout.request(pending.prefill, rid))
            if error is not None:
                self._results[rid] = GenerationResult(None, error)
                del self._pending[rid]
                self.plane.delete(self.layout.result(self.name, rid))

    def collect(self, ids: Sequence[str], timeout_s: float) -> list[Any]:
        from engine_integration.client import GenerationResult

        deadline = time.monotonic() + timeout_s
        while any(i in self._pending for i in ids) and time.monotonic() < deadline:
            self.poll()
            if any(i in self._pending for i in ids):
                time.sleep(self.plane.config.poll_interval_s)
        out = []
        for i in ids:
            if i in self._pending:
                self._pending.pop(i)
                out.append(GenerationResult(None, f"no result within {timeout_s}s"))
            else:
                out.append(self._results.pop(i))
        return out

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 timeout_s: float = 120.0) -> list[Any]:
        ids = [self.submit(p, max_new_tokens) for p in prompts]
        return self.collect(ids, timeout_s)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def engine_stats(self) -> dict[str, dict[str, Any]]:
        """Each instance's last published load figures, with ``alive`` from the live set."""
        view = self.view()
        out: dict[str, dict[str, Any]] = {}
        for kv in self.plane.range_raw(self.layout.stats):
            try:
                name, incarnation, figures = decode_stats(kv.key.decode(errors="replace"), kv.value, kv.lease,
                                                          self.layout, self.plane.cluster_key)
            except RecordRefused:
                continue
            out[name] = {**figures, "alive": view.is_live(name, incarnation), "incarnation": incarnation}
        for inst in view.live():
            out.setdefault(inst.name, {"alive": True, "incarnation": inst.incarnation})
            self._known.add(inst.name)
        for name in self._known - set(out):   # gone with its lease: known dead
            out[name] = {"alive": False}
        return out

    def stats(self) -> Any:
        """The coordinator's ``Stats`` shape, from the store (engines' published figures)."""
        from engine_integration import wire

        engines = self.engine_stats()
        return wire.Stats(engines=engines, requests_in_flight=self.in_flight + len(self.view().handoffs))

    def close(self) -> None:
        """Stop the keepalive and revoke our lease: our requests and results go with it."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.plane.client.lease_revoke(self.lease)
        except Exception as exc:  # noqa: BLE001 - it expires anyway
            log.info("client %r: lease not revoked (%s); it expires", self.name, exc)


def build_etcd_engine(spec: Any) -> EtcdDisaggEngine:
    """An ``EtcdDisaggEngine`` registered in the etcd fleet ``spec.control_plane`` (a worker's ``EngineSpec``).

    The cluster key (``spec.secret_file``) signs this process's transport metas and its
    records, so it is put in ``$KVXFER_SECRET_FILE`` before the transport exports anything.
    """
    from engine_integration.control_plane import open_control_plane
    from engine_integration.reference import build_reference_engine
    from kvxfer.security.auth import SECRET_FILE_ENV

    if spec.secret_file:
        os.environ[SECRET_FILE_ENV] = spec.secret_file
    elif not os.environ.get(SECRET_FILE_ENV) and not spec.insecure:
        raise RegistrationRefused(f"{spec.identity!r}: the etcd control plane needs the cluster key "
                                  f"(secret_file or ${SECRET_FILE_ENV}), or insecure=True")
    plane = open_control_plane(spec.control_plane, password_file=spec.etcd_password_file,
                               allow_unauthenticated=False)
    engine = build_reference_engine(spec.model, spec.num_blocks, spec.device, EtcdDisaggEngine)
    try:
        engine.connect(plane, role=spec.role, name=spec.identity, backend=spec.backend,
                       transfer_timeout_s=spec.transfer_timeout_s, queue_timeout_s=spec.queue_timeout_s)
    except BaseException:
        plane.close()
        engine.close_kv_transfer()
        raise
    return engine
