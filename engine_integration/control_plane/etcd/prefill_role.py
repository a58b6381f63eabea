"""The prefill role of an ``EtcdPlane``: ``PrefillRole``, a mixin.

One job: being a prefill in the etcd fleet, from one snapshot of it per poll:

prefill
  claims the requests clients routed to it (``requests/<me>/<rid>``, one revision-guarded
  transaction each: never run twice, never lost to a repeated call), refuses what the
  fleet cannot hold (``policy.admission_problem``), computes, pins, picks a decode
  (``policy.pick_decode``, from the snapshot, the decodes' published free blocks and the
  prefixes routed there before) and publishes the handoff under its lease. Verdict
  ``read_done`` / ``failed``: unpin, clear the handoff. ``reader_dead`` (the decode's lease
  expired, it said goodbye or restarted): fail the attempt to its client as retryable (it
  runs again) and unpin when the descriptor carries block generations (a zombie reader
  fails its torn-read check), else only once the death is *confirmed* (registered again
  under its name, or same host and its pid is gone), as the coordinator does.

Handoffs an incarnation of ours published before it lost its lease keep their pins as
orphans until their readers settle (``_settle_orphans``).

It builds on ``records``, ``requests``, ``store`` and ``membership``, never on ``decode_role`` or ``plane``
(tests/engine/test_engine_layout.py).
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from engine_integration.control_plane import policy
from engine_integration.control_plane.base import ControlPlaneError, RequestId
from engine_integration.control_plane.etcd.membership import DECODE, SharedState, member
from engine_integration.control_plane.etcd.records import FleetView, InstanceRecord, RecordRefused
from engine_integration.control_plane.etcd.requests import FAILED, RequestRecord, decode_request, decode_stats

log = logging.getLogger(__name__)


@dataclass
class _Claimed:
    """Prefill: a request taken from the store, until its handoff ends."""

    request: RequestRecord
    taken_at: float
    reader: str = ""
    reader_incarnation: str = ""
    checked: bool = False          #: its descriptor carries block generations (torn-read checked)
    prefill_s: float = 0.0
    descriptor: Any = None
    payload: Optional[dict[str, Any]] = None   #: what was published (restored if someone deletes it)
    published_revision: int = 0    #: the store's revision once it was published
    published_at: float = 0.0      #: when it was routed (monotonic): a reader that never finishes is bounded from here
    stuck: bool = False            #: its reader did not finish within handoff_timeout_s: failed to its client


@dataclass
class _Orphan:
    """Prefill: a handoff published by an incarnation of ours that lost its lease; its pins wait for its reader."""

    reader: str
    reader_incarnation: str
    incarnation: str               #: ours, the lost one
    checked: bool
    absent_since: Optional[float] = None   #: when its reader key was first seen missing


@dataclass
class _DecodeLoad:
    """Prefill: what it knows of one decode incarnation's room, for routing."""

    free_blocks: Optional[int] = None    #: from its last published load figures
    stats_revision: int = 0              #: etcd revision of that figure
    routed_blocks: int = 0               #: blocks routed there since that figure
    routed_since_view: int = 0           #: handoffs routed there since the last snapshot
    prefixes: policy.RoutedPrefixes = field(default_factory=policy.RoutedPrefixes)


class PrefillRole(SharedState):
    """What an ``EtcdPlane`` does as a prefill (a mixin: its state is the plane's)."""

    # what it uses of the plane besides ``SharedState``: its ``_result`` and ``_clear``, and these
    view: Optional[FleetView]
    prefix_routing: bool
    publish_timeout_s: float
    handoff_timeout_s: float
    _seen: dict[tuple[str, str], InstanceRecord]

    def _init_prefill(self) -> None:
        """The prefill's state: claimed requests, handoffs to publish, orphans, decode loads."""
        self._claimed: dict[RequestId, _Claimed] = {}
        self._unpublished: list[tuple[RequestId, Any]] = []
        self._awaiting_death: dict[RequestId, tuple[str, str]] = {}   # rid -> (reader, incarnation): pins kept
        self._loads: dict[tuple[str, str], _DecodeLoad] = {}          # (decode, incarnation) -> what we know
        self._loads_view: Optional[FleetView] = None                  # the snapshot the figures were read for
        self._orphans: dict[RequestId, _Orphan] = {}                  # prefill: handoffs of a lost incarnation
        self.taken = 0                                                #: prefill: requests claimed

    def _act_as_prefill(self, view: FleetView) -> int:
        """One poll's prefill work on ``view``: claim, publish, act on verdicts, repair, bound, settle."""
        return (self._take_requests(view) + self._publish_pending() + self._act_as_source(view)
                + self._restore_published(view) + self._bound_stuck_readers(view) + self._settle_orphans(view))

    # --- prefill --------------------------------------------------------------------------
    def _take_requests(self, view: FleetView) -> int:
        store, me, engine = self.store, self.me, self.engine
        assert me is not None and engine is not None
        taken = 0
        for kv in store.range_raw(f"{store.layout.requests}{me.name}/"):
            key = kv.key.decode(errors="replace")
            try:
                request = decode_request(key, kv.value, kv.lease, store.layout, store.cluster_key,
                                         allow_unauthenticated=store.config.allow_unauthenticated)
            except RecordRefused as exc:
                log.warning("prefill %r: refused request record %s: %s", me.name, key, exc)
                store.delete(key)
                continue
            if request.prefill_incarnation != me.incarnation or request.request_id in self._claimed:
                continue   # routed to an earlier incarnation of this name: its client fails it
            if not store.claim(key, kv.mod_revision, request.request_id):
                continue   # taken back by its client (re-routed), or rewritten since we read it
            taken += 1
            self.taken += 1
            why = policy.admission_problem(request.prompt, request.max_new_tokens, (member(r) for r in view.live()))
            if why is not None:
                self._result(request.client, request.client_lease, request.request_id, FAILED,
                             error=f"request refused at submit: {why}")
                store.release_claim(request.request_id)
                continue
            self._claimed[request.request_id] = _Claimed(request, time.monotonic())
            engine.add_request(request.request_id, request.prompt, request.max_new_tokens)
        return taken

    def publish(self, request_id: RequestId, descriptor: Any, prefill_s: float) -> None:
        """Pinned: route to a decode and publish under our lease (or keep it until a decode fits)."""
        claim = self._claimed.get(request_id)
        if claim is None:   # not a request of ours (cannot happen through the store): unpin
            assert self.engine is not None
            self.engine.release_handoff(request_id)
            return
        claim.prefill_s = prefill_s
        claim.descriptor = descriptor
        self._unpublished.append((request_id, descriptor))
        self._publish_pending()

    def _publish_pending(self) -> int:
        store = self.store
        if not self._unpublished or not store.lease_valid():
            return 0
        view = self.view if self.view is not None else store.snapshot()
        if self._loads_view is not view:   # once per snapshot: the decodes' figures change at most every 0.2 s
            self._loads_view = view
            self.refresh_loads(view)
        published = 0
        for request_id, descriptor in list(self._unpublished):
            claim = self._claimed[request_id]
            rec = claim.request
            tokens = len(rec.prompt) + rec.max_new_tokens - 1
            decode = self.route(view, descriptor.block_hashes, tokens)
            if decode is None:
                if view.live(DECODE):   # live decodes, none can hold it: refuse now, as the coordinator does
                    why = policy.admission_problem(rec.prompt, rec.max_new_tokens, (member(r) for r in view.live()))
                    self._unpublished.remove((request_id, descriptor))
                    self._fail_claim(request_id, "request refused: " + (why or "no live decode pool can hold it"))
                elif time.monotonic() - claim.taken_at >= self.publish_timeout_s:
                    self._unpublished.remove((request_id, descriptor))
                    self._fail_claim(request_id, f"no live decode instance could take it within "
                                                 f"{self.publish_timeout_s:.0f}s")
                continue
            payload = {"descriptor": descriptor.to_dict(), "max_new_tokens": rec.max_new_tokens,
                       "client": rec.client, "client_lease": str(rec.client_lease), "prefill_s": claim.prefill_s}
            self._unpublished.remove((request_id, descriptor))
            claim.reader, claim.reader_incarnation, claim.payload = decode.name, decode.incarnation, payload
            claim.published_at = time.monotonic()
            claim.checked = bool(descriptor.generations)
            try:
                claim.published_revision = store.publish_handoff(str(request_id), reader=decode.name,
                                                                 reader_incarnation=decode.incarnation,
                                                                 descriptor=payload)
            except ControlPlaneError as exc:
                # Unanswered is not unwritten: the put may have been applied and its answer lost, and the
                # reader may start on it. So the handoff counts as published (pins kept); a snapshot that
                # does not show it makes ``_restore_published`` write it again (the same value).
                claim.published_revision = 0
                log.warning("prefill %r: handoff %s to %r not confirmed by etcd (%s); kept as published",
                            self.me.name if self.me else "?", request_id, decode.name, exc)
            published += 1
            self.routed(decode, descriptor.block_hashes,
                        policy.reserved_blocks(tokens, policy.tokens_per_block(decode.transfer_meta)))
        return published

    # --- routing (the decision is ``policy.pick_decode``'s) -------------------------------------
    def refresh_loads(self, view: FleetView) -> None:
        """The live decodes' last published free blocks (one range over ``stats/``)."""
        store = self.store
        live = {(r.name, r.incarnation) for r in view.live(DECODE)}
        self._loads = {k: v for k, v in self._loads.items() if k in live}
        try:
            kvs = store.range_raw(store.layout.stats)
        except ControlPlaneError as exc:
            log.debug("load figures not read (%s); routing on what is known", exc)
            return
        for kv in kvs:
            try:
                name, incarnation, figures = decode_stats(kv.key.decode(errors="replace"), kv.value, kv.lease,
                                                          store.layout, store.cluster_key,
                                                          allow_unauthenticated=store.config.allow_unauthenticated)
            except RecordRefused:
                continue
            if (name, incarnation) not in live or not isinstance(figures.get("free_blocks"), int):
                continue
            load = self._loads.setdefault((name, incarnation), _DecodeLoad())
            if kv.mod_revision != load.stats_revision:   # a new figure: what we routed before is in it
                load.free_blocks, load.stats_revision, load.routed_blocks = figures["free_blocks"], kv.mod_revision, 0
                evictions = figures.get("evictions", 0)
                load.prefixes.evicted(evictions if isinstance(evictions, int) else 0, figures.get("evicted", []))

    def route(self, view: FleetView, block_hashes: Sequence[int], tokens: int) -> Optional[InstanceRecord]:
        """The live decode ``policy.pick_decode`` chooses for a request holding ``tokens`` tokens there."""
        pulling: dict[str, int] = {}
        for pair in view.handoffs.values():
            if pair.source is not None and not (pair.reader is not None and pair.reader.state.terminal):
                pulling[pair.source.reader] = pulling.get(pair.source.reader, 0) + 1
        decodes = {r.name: r for r in view.live(DECODE)}
        candidates = []
        for name, record in decodes.items():
            load = self._loads.get((name, record.incarnation), _DecodeLoad())
            free = load.free_blocks - load.routed_blocks if load.free_blocks is not None else None
            candidates.append(policy.DecodeCandidate(name, record.capacity_blocks,
                                                     policy.tokens_per_block(record.transfer_meta), free,
                                                     load.prefixes.expected_prefix(block_hashes),
                                                     pulling.get(name, 0) + load.routed_since_view))
        choice = policy.pick_decode(candidates, tokens, prefix_aware=self.prefix_routing)
        return decodes[choice.name] if choice is not None else None

    def routed(self, decode: InstanceRecord, block_hashes: Sequence[int], blocks: int) -> None:
        """Remember a handoff routed to ``decode`` (its prefix, and the ``blocks`` it will take from its
        free pool: ``policy.reserved_blocks``) until the next figures."""
        load = self._loads.setdefault((decode.name, decode.incarnation), _DecodeLoad())
        load.prefixes.add(block_hashes)
        load.routed_blocks += blocks
        load.routed_since_view += 1

    def _fail_claim(self, request_id: RequestId, error: str) -> None:
        claim = self._claimed.pop(request_id, None)
        assert self.engine is not None
        self.engine.release_handoff(request_id)
        self.store.release_claim(str(request_id))
        if claim is not None:
            self._result(claim.request.client, claim.request.client_lease, str(request_id), FAILED, error=error)

    def _act_as_source(self, view: FleetView) -> int:
        me, engine = self.me, self.engine
        assert me is not None and engine is not None
        acted = 0
        for verdict in view.source_verdicts(me.name, me.incarnation):
            acted += 1
            rid = verdict.request_id
            claim = self._claimed.pop(rid, None)
            if verdict.action in ("read_done", "failed"):   # the reader says no read is in flight
                engine.release_handoff(rid)
            elif verdict.action == "reader_dead":
                pub = verdict.record
                reader, incarnation = pub.reader, pub.reader_incarnation  # type: ignore[union-attr]
                self.detections.append({"verdict": "reader_dead", "request_id": rid, "peer": reader,
                                        "at": time.time(), "detail": verdict.detail})
                log.warning("prefill %r: handoff %s: %s", me.name, rid, verdict.detail)
                client, lease = self._client_of(claim, pub)
                if client and not (claim is not None and claim.stuck):   # no KV committed there: run it again
                    self._result(client, lease, rid, FAILED, retryable=True,
                                 error=f"decode {reader!r} died mid-handoff: {verdict.detail}")
                checked = claim.checked if claim is not None else bool(
                    ((pub.descriptor or {}).get("descriptor") or {}).get("generations"))  # type: ignore[union-attr]
                if checked or self._death_confirmed(reader, incarnation, view):
                    engine.release_handoff(rid)
                else:   # read without generations: a silent reader may still read; keep the pins
                    self._awaiting_death[rid] = (reader, incarnation)
            self._clear(verdict.source, rid)
        for rid, (reader, incarnation) in list(self._awaiting_death.items()):
            if self._death_confirmed(reader, incarnation, view):
                del self._awaiting_death[rid]
                engine.release_handoff(rid)
                acted += 1
        return acted

    def _bound_stuck_readers(self, view: FleetView) -> int:
        """Fail the handoffs a live reader has not finished within ``handoff_timeout_s``, and bound their pins.

        A reader whose lease lives but which never reads (a hung engine loop, a bug) would hold
        the request and its source pins forever. Past the timeout the request fails to its
        client; its pins are freed when its reads are torn-read checked (a read that lands later
        fails its check and is never committed, as for a reader whose lease expired), else kept
        until the reader reports or dies (load figure ``stuck``). The handoff stays published, so
        a reader that recovers still reports and the usual verdicts clear it.
        """
        me, engine = self.me, self.engine
        assert me is not None and engine is not None
        now, acted = time.monotonic(), 0
        for rid, claim in self._claimed.items():
            if not claim.reader or claim.stuck or now - claim.published_at <= self.handoff_timeout_s:
                continue
            pair = view.handoffs.get((me.name, str(rid)))
            if pair is not None and pair.reader is not None and pair.reader.state.terminal:
                continue   # finished: its verdict is acted on this poll
            acted += 1
            claim.stuck = True
            waited = now - claim.published_at
            freed = claim.checked
            log.warning("prefill %r: decode %r has not finished reading handoff %s %.1fs after it was routed (stuck "
                        "reader): the request fails; its pins %s", me.name, claim.reader, rid, waited,
                        "are freed (a late read fails its torn-read check)" if freed else
                        "stay until the reader reports or dies (no generation counters)")
            self._result(claim.request.client, claim.request.client_lease, str(rid), FAILED,
                         error=f"decode {claim.reader!r} did not finish reading the request within "
                               f"{self.handoff_timeout_s:.0f}s (stuck reader)")
            if freed:
                engine.release_handoff(rid)
        return acted

    def _restore_published(self, view: FleetView) -> int:
        """Publish again every handoff of ours whose source key is gone from a snapshot taken after it was
        written: someone deleted it (issue 21, A11). Its reader waits for it (``source_missing``) and
        its verdicts resume; without it the client would wait for nothing and the pins stay forever."""
        me = self.me
        assert me is not None
        restored = 0
        for rid, claim in list(self._claimed.items()):
            if not claim.reader or claim.payload is None or claim.published_revision > view.revision:
                continue
            pair = view.handoffs.get((me.name, str(rid)))
            if pair is not None and pair.source is not None:
                continue
            try:
                claim.published_revision = self.store.publish_handoff(
                    str(rid), reader=claim.reader, reader_incarnation=claim.reader_incarnation, descriptor=claim.payload)
            except ControlPlaneError as exc:
                log.warning("prefill %r: handoff %s lost its source key and could not be restored (%s); next poll",
                            me.name, rid, exc)
                continue
            restored += 1
            self.repairs += 1
            log.warning("prefill %r: the source key of handoff %s was deleted by someone else: restored", me.name, rid)
        return restored

    def _death_confirmed(self, reader: str, incarnation: str, view: FleetView) -> bool:
        now = view.instances.get(reader)
        if now is not None and now.incarnation != incarnation:
            return True   # the same name registered again: the old process is gone
        seen = self._seen.get((reader, incarnation))
        return seen is not None and seen.host == socket.gethostname() and policy.process_gone(seen.pid)

    @staticmethod
    def _client_of(claim: Optional[_Claimed], pub: Any) -> tuple[str, int]:
        if claim is not None:
            return claim.request.client, claim.request.client_lease
        payload = (pub.descriptor or {}) if pub is not None else {}
        try:
            return str(payload.get("client", "")), int(payload.get("client_lease", 0))
        except (TypeError, ValueError):
            return "", 0

    # --- a lost incarnation's handoffs -----------------------------------------------------
    def _drop_claims(self, old: InstanceRecord, reason: str) -> None:
        """The lost incarnation's requests: a published handoff becomes an orphan (its pins wait for its
        reader, ``_settle_orphans``); one not handed off is aborted, unpinned and failed as retryable."""
        engine = self.engine
        assert engine is not None
        for rid, claim in list(self._claimed.items()):
            if claim.reader:
                self._orphans[rid] = _Orphan(claim.reader, claim.reader_incarnation, old.incarnation,
                                             claim.checked)
                continue
            engine.abort_request(rid, reason)
            engine.release_handoff(rid)   # pinned and never published: no reader knows it
            self._result(claim.request.client, claim.request.client_lease, str(rid), FAILED, retryable=True,
                         error=f"{reason} before handing the request off")
        self._claimed.clear()
        self._unpublished.clear()

    def _settle_orphans(self, view: FleetView) -> int:
        """Release the pins of handoffs our lost incarnation published, once no read of them can matter.

        Their source keys went with the old lease, and a reader writes ``PULLING`` only while the
        source key it saw exists (a guarded write), so from then on the reader key tells all: a
        terminal one (the reader settled), a dead reader (torn-read-checked pins go now, others at
        its confirmed death), or none at all (it never started, or finished and cleaned up; unchecked
        pins wait ``repair_grace_s`` more, in case someone deleted the key and its reader restores it).
        """
        me, engine = self.me, self.engine
        assert me is not None and engine is not None
        now, acted = time.monotonic(), 0
        for rid, orphan in list(self._orphans.items()):
            pair = view.handoffs.get((me.name, str(rid)))
            reader = pair.reader if pair is not None else None
            if reader is not None and (reader.source_incarnation != orphan.incarnation
                                       or reader.reader_incarnation != orphan.reader_incarnation):
                reader = None
            if reader is not None and not reader.state.terminal:
                orphan.absent_since = None
                continue   # still pulling: it sees our old incarnation gone, aborts, and writes FAILED when safe
            if reader is None and view.is_live(orphan.reader, orphan.reader_incarnation):
                orphan.absent_since = orphan.absent_since or now
                if not orphan.checked and now - orphan.absent_since < self.repair_grace_s:
                    continue
                engine.release_handoff(rid)
            elif reader is None and not (orphan.checked or self._death_confirmed(orphan.reader,
                                                                                 orphan.reader_incarnation, view)):
                self._awaiting_death[rid] = (orphan.reader, orphan.reader_incarnation)
            else:
                engine.release_handoff(rid)
            del self._orphans[rid]
            self._clear(me.name, str(rid))
            acted += 1
        return acted
