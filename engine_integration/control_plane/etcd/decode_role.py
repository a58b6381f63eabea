"""The decode role of an ``EtcdPlane``: ``DecodeRole``, a mixin.

One job: being a decode in the etcd fleet, from one snapshot of it per poll:

decode
  adds each new prefill incarnation's transfer metas; verdict ``start``: writes PULLING
  (acknowledged by etcd before any read is posted, and only while the source key it saw
  still exists) and queues the pull; a completed pull is committed only while its own
  lease is valid (self-fencing) and only if it creates the attempt's result first (the
  engine's commit guard: an attempt its client gave up is never committed), then
  READ_DONE; a failed pull writes FAILED once ``storage_safe`` (quarantine as today).
  ``source_gone`` (the prefill's lease expired or it restarted): the attempt fails to its
  client as retryable, the pull is aborted and its blocks stay quarantined until
  ``storage_safe``.

It builds on ``records``, ``requests``, ``store`` and ``membership`` (and ``descriptor``, lazily, to read a
handoff), never on ``prefill_role`` or ``plane`` (tests/engine/test_engine_layout.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from engine_integration.control_plane.base import ControlPlaneError, RequestId
from engine_integration.control_plane.etcd.membership import PREFILL, SharedState
from engine_integration.control_plane.etcd.records import FleetView, HandoffState
from engine_integration.control_plane.etcd.requests import DECODING, DONE, FAILED, ResultRecord
from engine_integration.control_plane.etcd.store import LeaseGone, LeaseLost

log = logging.getLogger(__name__)


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
    state: HandoffState = HandoffState.PULLING   #: what our reader key says (restored if someone deletes it)
    finished: bool = False         #: the request left this engine; kept until the handoff's keys are cleared
    source_missing_since: Optional[float] = None  #: the source key vanished while the source lives
    result_revision: int = 0       #: the revision of the result we created at commit (later writes update only it)
    retryable: bool = False        #: it failed here before any token was committed, through no fault of its own


class DecodeRole(SharedState):
    """What an ``EtcdPlane`` does as a decode (a mixin: its state is the plane's)."""

    # what it uses of the plane besides ``SharedState``: its ``_result`` and ``_clear``

    def _init_decode(self) -> None:
        """The decode's state: the handoffs it took, the prefill incarnations it knows, the counts."""
        self._reads: dict[RequestId, _Read] = {}
        self._peer_incarnations: dict[str, str] = {}
        self.commits = 0                                              #: decode: pulls committed (result created)
        self.refused_commits = 0                                      #: decode: completed pulls not committed

    def _fence(self, request_id: RequestId) -> Optional[str]:
        """Decode, before a completed pull is committed: why it must not be (``None``: commit).

        Our lease must be valid (self-fencing: past it the source may have freed the blocks), and
        the attempt's result is created here, once (``create_record``): if the client already gave
        this attempt up (it re-routed the request) or someone answered it, the KV is not committed,
        so an abandoned attempt can never be served."""
        name = self.engine.identity if self.engine else "?"
        read = self._reads.get(str(request_id))
        if not self.store.lease_valid():
            self.refused_commits += 1
            if read is not None:
                read.retryable = True
            return (f"decode {name!r} may have lost its etcd lease (cut off from etcd): the source may already "
                    "have freed the blocks, KV not committed")
        if read is None or self.me is None:
            return None
        rec = ResultRecord(str(request_id), read.client, read.client_lease, DECODING, self.me.name,
                           self.me.incarnation)
        try:
            revision = self.store.create_record(self.store.layout.result(read.client, str(request_id)), rec.body(),
                                                read.client_lease)
        except LeaseGone:
            return f"client {read.client!r} is gone (its lease expired): nobody to answer, KV not committed"
        except ControlPlaneError as exc:
            read.retryable = True
            return f"decode {name!r} could not record the commit in etcd ({exc}): KV not committed"
        if revision is None:
            read.result_written = True   # someone else's answer stands
            self.refused_commits += 1
            return f"request {request_id} was answered or re-routed by its client meanwhile: KV not committed"
        read.result_revision = revision
        self.commits += 1
        return None

    # --- decode ---------------------------------------------------------------------------
    def _act_as_reader(self, view: FleetView) -> int:
        me, engine = self.me, self.engine
        assert me is not None and engine is not None
        acted = 0
        live = {}
        for inst in view.live(PREFILL):
            if self._peer_incarnations.get(inst.name) != inst.incarnation:
                engine.add_peer_transfer_meta(inst.name, inst.transfer_meta)   # a new incarnation: fresh metas
            live[inst.name] = inst.incarnation
        self._peer_incarnations = live   # the live prefills only: one that comes back is added afresh
        missing: set[str] = set()
        for verdict in view.reader_verdicts(me.name, me.incarnation):
            rid, source = verdict.request_id, verdict.source
            read = self._reads.get(rid)
            if verdict.action == "start" and read is None:
                acted += 1
                self._start(source, rid, verdict.record)
            elif verdict.action == "start" and not read.source_gone:   # type: ignore[union-attr]
                acted += 1   # our reader key is gone (someone deleted it): say again where we are
                self.repairs += 1
                log.warning("decode %r: the reader key of handoff %s/%s was deleted by someone else: restored",
                            me.name, source, rid)
                self._write_state(source, rid, read.state, read.source_incarnation)  # type: ignore[union-attr]
            elif verdict.action == "source_missing" and verdict.record.state.terminal:  # type: ignore[union-attr]
                # our side is settled (read done, its request perhaps still decoding here; or failed): no pull to
                # abort, nothing to fail. The source restores its key and acts on our state. A key not restored
                # within the grace (the source had acted, and ours was written again after its clear) is cleared
                if read is not None:
                    missing.add(rid)
                    read.source_missing_since = read.source_missing_since or time.monotonic()
                if read is None or time.monotonic() - read.source_missing_since > self.repair_grace_s:
                    acted += 1
                    self._clear(source, rid)
            elif verdict.action in ("source_missing", "source_gone") and read is not None and read.finished:
                continue   # it left this engine with its result; the source's own verdicts clear its keys
            elif verdict.action == "source_missing" and read is not None and not read.source_gone:
                missing.add(rid)   # the source restores it at its next poll; the pull goes on meanwhile
                read.source_missing_since = read.source_missing_since or time.monotonic()
                if time.monotonic() - read.source_missing_since > self.repair_grace_s:
                    acted += 1
                    self._source_gone(rid, read, source, f"its source key was deleted and not restored within "
                                                         f"{self.repair_grace_s:.0f}s")
            elif verdict.action == "source_gone":
                if read is None or read.source_gone:
                    continue
                acted += 1
                self._source_gone(rid, read, source, verdict.detail)
            elif verdict.action == "cleanup":
                acted += 1
                if read is not None and read.finished:
                    del self._reads[rid]
                # else its request is still in this engine (read done, decoding): kept, so its answer reaches its
                # client when it leaves; dropped then, its handoff's keys being gone (issue 39: a11 was never answered)
                self._clear(source, rid)
        for rid, read in list(self._reads.items()):
            if rid not in missing:
                read.source_missing_since = None
            if read.finished and (read.source, rid) not in view.handoffs:
                del self._reads[rid]   # its handoff's keys are cleared: nothing of it left to restore
        return acted

    def _source_gone(self, rid: str, read: _Read, source: str, detail: str) -> None:
        """The prefill of a read of ours is gone: fail the request to its client, abort the pull."""
        me, engine = self.me, self.engine
        assert me is not None and engine is not None
        read.source_gone = True
        self.detections.append({"verdict": "source_gone", "request_id": rid, "peer": source,
                                "at": time.time(), "detail": detail})
        log.warning("decode %r: handoff %s: %s", me.name, rid, detail)
        read.retryable = True   # the KV was never committed here: the client may run it again
        self._fail_to_client(rid, read, f"prefill {source!r} died mid-handoff: {detail}")
        engine.abort_request(rid, f"prefill {source!r} gone: {detail}")

    def _start(self, source: str, rid: str, pub: Any) -> None:
        from engine_integration.descriptor import HandoffDescriptor

        store, engine = self.store, self.engine
        assert engine is not None
        payload = pub.descriptor or {}
        try:
            descriptor = HandoffDescriptor.from_dict(payload["descriptor"])
            max_new_tokens = int(payload["max_new_tokens"])
            client, client_lease = str(payload["client"]), int(payload["client_lease"])
            if descriptor.source != source or str(descriptor.request_id) != rid:
                raise ValueError(f"descriptor names {descriptor.source}/{descriptor.request_id}")
            prefill_s = float(payload.get("prefill_s", 0.0))
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:  # Infinity, null, a list...
            log.warning("decode %r: refused handoff %s/%s: %s", engine.identity, source, rid, exc)
            self._write_state(source, rid, HandoffState.FAILED, pub.owner_incarnation, f"refused: {exc}")
            return
        read = _Read(source, pub.owner_incarnation, client, client_lease, max_new_tokens,
                     info={"prefill_s": prefill_s})
        try:   # acknowledged by etcd before any read can be posted, and only while the source key is the one seen
            if not store.set_reader_state(source, rid, HandoffState.PULLING, source_incarnation=pub.owner_incarnation,
                                          source_revision=pub.revision):
                return   # the source key changed or went (its lease expired, or it was restored): next poll decides
        except ControlPlaneError as exc:
            log.warning("decode %r: cannot take %s/%s now (%s); next poll", engine.identity, source, rid, exc)
            return
        self._reads[rid] = read
        try:
            engine.add_handoff(descriptor, max_new_tokens)
        except ValueError as exc:
            self._fail_to_client(rid, read, f"decode {engine.identity!r} refused it: {exc}")
            self._write_state(source, rid, HandoffState.FAILED, read.source_incarnation, str(exc))

    def transfer_ready(self, request_id: RequestId, cached_prefix_blocks: int, stats: Any) -> None:
        rid = str(request_id)
        read = self._reads.get(rid)
        if read is None:
            return
        read.info.update(cached_prefix_blocks=cached_prefix_blocks, pulled_blocks=stats.pulled_blocks if stats else 0,
                         pull_s=stats.pull_s if stats else 0.0, decode_queue_s=stats.queue_s if stats else 0.0,
                         admit_seq=stats.admit_seq if stats else 0)

    def read_done(self, request_id: RequestId, failure: str = "") -> None:
        rid = str(request_id)
        read = self._reads.get(rid)
        if read is not None:
            state = HandoffState.FAILED if failure else HandoffState.READ_DONE
            self._write_state(read.source, rid, state, read.source_incarnation, failure)

    def pull_failed(self, request_id: RequestId, reason: str) -> None:
        rid = str(request_id)
        read = self._reads.get(rid)
        if read is not None:
            # nothing of it was committed here (no token reached its client): the client may run it again,
            # whether the source died under the read (the transport may say so before its lease expires),
            # the read tore, or the attempt was fenced; a bounded number of attempts keeps a lasting fault loud
            retried_cause = read.retryable
            read.retryable = True
            # it left this engine (no record of it comes out of a step): kept only until its handoff's keys
            # are cleared, like a finished one. A pull refused at commit by a momentary fence (an etcd
            # election at TTL 2 s) used to stay counted in ``reads`` for ever: no reincarnation cleared it
            read.finished = True
            self._fail_to_client(rid, read, reason if retried_cause else
                                 f"decode {self.me.name if self.me else '?'!r} pulling from prefill "
                                 f"{read.source!r}: {reason}")

    def _write_state(self, source: str, rid: str, state: HandoffState, source_incarnation: str,
                     detail: str = "") -> None:
        read = self._reads.get(rid)
        if read is not None:
            read.state = state

        def write() -> None:
            if not self.store.lease_valid():   # fenced: no write under a lease etcd may have expired; no wait
                self._retry.append(("state", write))
                return
            try:
                self.store.set_reader_state(source, rid, state, source_incarnation=source_incarnation, detail=detail)
            except LeaseLost:
                return   # our incarnation is gone: its state went with its lease
            except ControlPlaneError as exc:
                engine = self.engine
                if engine is not None and engine.shutdown_reason is None:
                    log.warning("decode %r: %s for %s/%s not written (%s); retrying", engine.identity, state.value,
                                source, rid, exc)
                    self._retry.append(("state", write))
        write()

    def _fail_to_client(self, rid: str, read: _Read, error: str) -> None:
        if not read.result_written:
            read.result_written = True
            self._result(read.client, read.client_lease, rid, FAILED, error=error, retryable=read.retryable,
                         revision=read.result_revision)

    def _reader_finished(self, rid: str, record: Mapping[str, Any]) -> None:
        """A request left this decode's step: answer its client (tokens, or the error)."""
        read = self._reads.get(rid)
        if read is None or read.finished:
            return
        read.finished = True   # kept until its handoff's keys are cleared (our reader key may need restoring)
        if "error" in record:
            self._fail_to_client(rid, read, record["error"])
        else:
            read.result_written = True
            self._result(read.client, read.client_lease, rid, DONE, tokens=record["tokens"], info=read.info,
                         revision=read.result_revision)

    def _drop_reads(self, reason: str) -> None:
        """The lost incarnation's pulls and running requests: aborted and failed as retryable (nothing
        of them is committed after its lease)."""
        engine = self.engine
        assert engine is not None
        for rid, read in list(self._reads.items()):
            if read.finished:
                continue
            read.retryable = True
            self._fail_to_client(rid, read, f"{reason} while it held the request")
            engine.abort_request(rid, reason)
        self._reads.clear()
