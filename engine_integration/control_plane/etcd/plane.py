"""The engine's side of the etcd control plane: ``EtcdPlane``. No coordinator; the state lives in etcd.

``DisaggDynamicInferenceEngine.connect(EtcdPlane.open("etcd://..."), role=..., name=...)``
checks the engine against the live fleet (``policy.fleet_refusal``), registers it under a
fresh lease (``store.EtcdStore``), and from then on, every ``poll_interval_s``, takes one
snapshot of the fleet and acts on the verdicts computed from it
(``FleetView.source_verdicts`` / ``reader_verdicts``), so any process that restarts
reaches the same decisions:

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
a lost lease (etcd unreachable past the TTL, the process paused; either role)
  the instance fences itself (no poll acts, no pull commits, nothing is published past
  its local lease deadline); once etcd says the lease is gone it drops what the lost
  incarnation held (requests not handed off fail as retryable; published handoffs keep
  their pins as orphans until their readers settle; a decode aborts every pull and running
  request) and registers again as a new incarnation, in the same process: it serves again
  without a restart. A name someone else holds by then is not fought for: it stops.

Clients (``etcd.client.EtcdGenerationClient``) write requests under their own lease and
read ``results/<client>/``. An attempt whose holder dies, or that fails as retryable, runs
again on a live prefill (the client's choice); each attempt's result is created once, so
each request is answered once.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence
from urllib.parse import parse_qs, urlsplit

from engine_integration.control_plane import policy
from engine_integration.control_plane.base import (ControlPlane, ControlPlaneError, ControlPlaneUnavailable, Health,
                                                   PlaneEngine, RegistrationRefused, RequestId)
from engine_integration.control_plane.etcd.records import (FleetView, HandoffState, InstanceRecord, RecordRefused)
from engine_integration.control_plane.etcd.requests import (DECODING, DONE, FAILED, RequestRecord, ResultRecord,
                                                            decode_request, decode_stats, stats_body)
from engine_integration.control_plane.etcd.store import (PLANE_QUERY_KEYS, EtcdStore, LeaseGone, LeaseLost,
                                                         NameTaken, parse_etcd_url)

log = logging.getLogger("kvxfer.engine.etcd")

PREFILL, DECODE = "prefill", "decode"


def member(record: InstanceRecord) -> policy.Member:
    """An instance record as the fleet policy sees it."""
    fingerprint = record.extra.get("fingerprint")
    return policy.Member(record.name, record.role, record.capacity_blocks, tuple(record.transfer_meta),
                         fingerprint if isinstance(fingerprint, str) else None)


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


class EtcdPlane(ControlPlane):
    """One engine's membership in an etcd fleet (see the module docstring)."""

    kind = "etcd"
    supports_push = False
    #: Megatron's push order (docs/engine_integration.md, "Push backends") needs a message from the decode,
    #: once its receives are posted, relayed to the prefill in post order per pair of ranks: the
    #: coordinator's SendKV -> PushKV. etcd keys carry state, not an ordered stream between two engines.
    push_refused_because = ("a push needs the decode's receives posted before the prefill sends (Megatron's order), "
                            "which the ZeroMQ coordinator relays in post order; etcd carries no such message")

    def __init__(self, store: EtcdStore, *, insecure: bool = False, publish_timeout_s: float = 60.0,
                 stats_interval_s: float = 0.2, handoff_timeout_s: float = 120.0,
                 prefix_routing: bool = True) -> None:
        self.store = store
        #: route a request to the decode expected to cache its prefix while it has room (``policy.pick_decode``);
        #: False: least loaded only (URL ``prefix_routing=0``; the benchmark's baseline)
        self.prefix_routing = prefix_routing
        self.insecure = insecure
        self.poll_interval_s = store.config.poll_interval_s
        self.publish_timeout_s = publish_timeout_s   #: a computed request waits this long for a live decode
        #: a live reader that has not finished a handoff this long after it was routed is stuck: the request
        #: fails to its client, its pins are freed if torn-read checked, else kept until it reports or dies
        self.handoff_timeout_s = handoff_timeout_s
        self.stats_interval_s = stats_interval_s
        self.engine: Optional[PlaneEngine] = None
        self.me: Optional[InstanceRecord] = None
        self.view: Optional[FleetView] = None
        self._last_poll = 0.0
        self._last_stats = 0.0
        self._last_figures: Optional[dict[str, int]] = None
        self._claimed: dict[RequestId, _Claimed] = {}
        self._unpublished: list[tuple[RequestId, Any]] = []
        self._awaiting_death: dict[RequestId, tuple[str, str]] = {}   # rid -> (reader, incarnation): pins kept
        self._loads: dict[tuple[str, str], _DecodeLoad] = {}          # (decode, incarnation) -> what we know
        self._loads_view: Optional[FleetView] = None                  # the snapshot the figures were read for
        self._reads: dict[RequestId, _Read] = {}
        self._peer_incarnations: dict[str, str] = {}
        self._seen: dict[tuple[str, str], InstanceRecord] = {}        # (name, incarnation) -> its record
        self._retry: list[tuple[str, Callable[[], None]]] = []        # ("state"/"result", write) etcd did not take yet
        self._detached = False
        self.repair_grace_s = float(store.config.ttl_s)               #: how long a missing source key is waited for
        self.repairs = 0                                              #: handoff keys of ours restored after a deletion
        self.detections: list[dict[str, Any]] = []                    #: verdicts about dead peers, with times
        self._lost: Optional[str] = None                              # why our lease was lost (set by the keepalive)
        self._lost_at = 0.0
        self._dropped = False                                         # the lost incarnation's work was dropped
        self._orphans: dict[RequestId, _Orphan] = {}                  # prefill: handoffs of a lost incarnation
        self.fenced_polls = 0                                         #: polls skipped with our lease not confirmed
        self.taken = 0                                                #: prefill: requests claimed
        self.commits = 0                                              #: decode: pulls committed (result created)
        self.refused_commits = 0                                      #: decode: completed pulls not committed
        self.reincarnations: list[dict[str, Any]] = []                #: each re-registration after a lost lease

    @classmethod
    def open(cls, url: str, *, password_file: Optional[str] = None, secret_file: Optional[str] = None,
             insecure: bool = False, handoff_timeout_s: Optional[float] = None, **config: Any) -> "EtcdPlane":
        """From ``etcd://[user@]host:port[,...]/cluster?ttl=5&poll=0.25&handoff_timeout=120``; ``config``
        overrides ``EtcdConfig`` fields. ``handoff_timeout`` (seconds, in the URL or as an argument) is
        how long a routed handoff may take before its reader counts as stuck; ``prefix_routing=0`` routes
        to the least loaded decode only (no prefix preference)."""
        options = {k: v for k, v in (("password_file", password_file), ("secret_file", secret_file)) if v}
        query = {k: v[-1] for k, v in parse_qs(urlsplit(url).query).items() if k in PLANE_QUERY_KEYS}
        if handoff_timeout_s is None:
            handoff_timeout_s = float(query.get("handoff_timeout", 120.0))
        if handoff_timeout_s <= 0:
            raise ValueError(f"handoff_timeout must be > 0 seconds, got {handoff_timeout_s}")
        prefix_routing = query.get("prefix_routing", "1")
        if prefix_routing not in ("0", "1"):
            raise ValueError(f"prefix_routing must be 0 or 1 in the etcd URL, got {prefix_routing!r}")
        return cls(EtcdStore(parse_etcd_url(url, **options, **config)), insecure=insecure,
                   handoff_timeout_s=handoff_timeout_s, prefix_routing=prefix_routing == "1")

    @property
    def config(self) -> Any:
        return self.store.config

    def __repr__(self) -> str:
        return f"EtcdPlane({self.store!r})"

    # --- registration ---------------------------------------------------------------------
    def attach(self, engine: PlaneEngine, *, timeout_s: float) -> None:
        store, role, name = self.store, engine.role or "", engine.identity
        if store.cluster_key is None and not self.insecure:
            from kvxfer.security.auth import SECRET_FILE_ENV

            raise RegistrationRefused(f"{name!r}: the etcd control plane needs the cluster key "
                                      f"(secret_file or ${SECRET_FILE_ENV}), or insecure=True")
        try:
            view = store.snapshot()
        except ControlPlaneError as exc:
            raise RegistrationRefused(f"{name!r}: cannot reach the control plane: {exc}") from None
        me = policy.Member(name, role, engine.capacity_blocks, tuple(engine.transfer_meta), engine.model_fingerprint)
        why = policy.fleet_refusal(me, (member(r) for r in view.live()))
        if why is not None:
            raise RegistrationRefused(f"etcd fleet refused {role} {name!r}: {why}")
        try:
            self.me = store.register(name=name, role=role, transfer_meta=engine.transfer_meta,
                                     capacity_blocks=engine.capacity_blocks,
                                     extra={"fingerprint": engine.model_fingerprint, "backend": engine.backend_name})
        except ControlPlaneError as exc:
            raise RegistrationRefused(f"{name!r}: {exc}") from None
        self.engine = engine
        store.on_lease_lost = self._on_lease_lost
        if role == DECODE:
            engine.set_commit_guard(self._fence)
        self._publish_stats(force=True)

    def _on_lease_lost(self, why: str) -> None:
        """The keepalive thread (or a refused write) learned our lease is gone: the engine's own loop acts
        (``poll``), so the engine is never touched from two threads. Superseded (someone holding the
        cluster key registered our name): stop, never fight for the name."""
        self._lost = why
        if self.store.superseded and self.engine is not None:
            self.engine.shutdown_reason = f"lost its etcd lease: {why}"

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

    # --- the loop -------------------------------------------------------------------------
    def poll(self) -> int:
        """One snapshot and the actions it calls for, when a poll is due; how many actions.

        Fenced (our lease not confirmed by etcd within its TTL: cut off, or this process was
        paused) it does nothing at all: what it knows may be stale and etcd may already count us
        dead. Once etcd says the lease is gone it drops the lost incarnation's work and
        registers again (``_reincarnate``)."""
        engine = self.engine
        if engine is None or engine.shutdown_reason is not None:
            return 0
        now = time.monotonic()
        if now - self._last_poll < self.poll_interval_s:
            return 0
        self._last_poll = now
        if self._lost is not None or self.store.lease_lost:
            return self._reincarnate(self._lost or "lease lost")
        if not self.store.lease_valid():
            self.fenced_polls += 1
            return 0
        try:
            return self._poll_plane()
        except ControlPlaneError as exc:   # etcd away: no verdict, nothing freed; fencing covers the rest
            log.warning("%s %r: control plane poll failed: %s", engine.role, engine.identity, exc)
            return 0

    # --- a lost lease: fence, drop, register again --------------------------------------
    def _reincarnate(self, why: str) -> int:
        """Our lease is gone (etcd unreachable past the TTL, this process paused, or refused by etcd):
        every peer already treats this incarnation as dead. Drop what it held (once), then register
        again as a new incarnation (retried every poll until etcd takes it); the engine keeps running.

        Before the new registration appears, every pull of the old incarnation has been aborted (none
        is committed: the commit guard also refuses while fenced), so "registered again" still means
        what a restart means to the prefills: no read of the old incarnation will be used.
        """
        engine, old = self.engine, self.me
        assert engine is not None and old is not None
        if not self._dropped:
            self._drop_incarnation(old, why)
            self._dropped = True
            self._lost_at = time.monotonic()
        try:
            self.me = self.store.register(name=old.name, role=old.role, transfer_meta=engine.transfer_meta,
                                          capacity_blocks=engine.capacity_blocks, extra=dict(old.extra))
        except NameTaken as exc:   # someone else registered our name meanwhile: never fight for it
            engine.shutdown_reason = f"lost its etcd lease ({why}) and cannot register again: {exc}"
            log.error("%s %r: %s", old.role, old.name, engine.shutdown_reason)
            return 0
        except ControlPlaneError as exc:
            log.warning("%s %r: lost its etcd lease (%s); registering again failed (%s): next poll", old.role,
                        old.name, why, exc)
            return 0
        self._lost, self._dropped = None, False
        self.reincarnations.append({"lost": old.incarnation, "new": self.me.incarnation, "why": why,
                                    "at": time.time(), "dropped_to_registered_s": time.monotonic() - self._lost_at})
        log.warning("%s %r lost its etcd lease (%s): registered again as incarnation %s (was %s)", old.role, old.name,
                    why, self.me.incarnation, old.incarnation)
        self._publish_stats(force=True)
        return 1

    def _drop_incarnation(self, old: InstanceRecord, why: str) -> None:
        """Fail what the lost incarnation held, so nothing of it is ever served twice or served stale.

        prefill: requests not handed off are aborted and failed to their clients as retryable (they run
        again elsewhere); a published handoff keeps its pins as an orphan until its reader says no read
        can be in flight (``_settle_orphans``). decode: every pull and every running request is aborted
        and failed as retryable (nothing of the old incarnation's pulls is committed after its lease)."""
        engine = self.engine
        assert engine is not None
        reason = f"{old.role} {old.name!r} lost its etcd lease ({why})"
        if old.role == PREFILL:
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
        else:
            for rid, read in list(self._reads.items()):
                if read.finished:
                    continue
                read.retryable = True
                self._fail_to_client(rid, read, f"{reason} while it held the request")
                engine.abort_request(rid, reason)
            self._reads.clear()
        # state writes of the old incarnation went with its lease; answers to clients (under their leases,
        # created or updated only if still ours) are still owed
        self._retry = [item for item in self._retry if item[0] == "result"]

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

    def wait_s(self) -> float:
        return max(0.0, self._last_poll + self.poll_interval_s - time.monotonic())

    def tick(self) -> None:
        self._publish_stats(force=False)

    def _poll_plane(self) -> int:
        assert self.me is not None and self.engine is not None
        view = self.store.snapshot()
        self.view = view
        for load in self._loads.values():
            load.routed_since_view = 0
        for record in view.instances.values():
            self._seen[(record.name, record.incarnation)] = record
        if len(self._seen) > 4096:
            self._seen = {k: v for k, v in self._seen.items() if view.is_live(*k)}
        retries, self._retry = self._retry, []
        for _, retry in retries:
            retry()
        if self.engine.role == PREFILL:
            return (self._take_requests(view) + self._publish_pending() + self._act_as_source(view)
                    + self._restore_published(view) + self._bound_stuck_readers(view) + self._settle_orphans(view))
        return self._act_as_reader(view)

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

    def _clear(self, source: str, rid: str) -> None:
        try:
            self.store.clear_handoff(source, rid)
        except ControlPlaneError as exc:
            log.warning("%r: could not clear handoff %s/%s (%s); next poll", self.me.name if self.me else "?",
                        source, rid, exc)

    # --- decode ---------------------------------------------------------------------------
    def _act_as_reader(self, view: FleetView) -> int:
        me, engine = self.me, self.engine
        assert me is not None and engine is not None
        acted = 0
        for inst in view.live(PREFILL):
            if self._peer_incarnations.get(inst.name) != inst.incarnation:
                engine.add_peer_transfer_meta(inst.name, inst.transfer_meta)   # a new incarnation: fresh metas
                self._peer_incarnations[inst.name] = inst.incarnation
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
                self._reads.pop(rid, None)
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
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("decode %r: refused handoff %s/%s: %s", engine.identity, source, rid, exc)
            self._write_state(source, rid, HandoffState.FAILED, pub.owner_incarnation, f"refused: {exc}")
            return
        read = _Read(source, pub.owner_incarnation, client, client_lease, max_new_tokens,
                     info={"prefill_s": float(payload.get("prefill_s", 0.0))})
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
        # the result ``decoding`` was created by the commit guard (``_fence``), before the KV was committed

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

    # --- results --------------------------------------------------------------------------
    def finished(self, record: Mapping[str, Any]) -> None:
        rid = str(record["request_id"])
        assert self.engine is not None
        if self.engine.role == PREFILL:   # only refusals come out of a prefill's step
            if "error" in record:
                self._fail_claim(rid, record["error"])
            return
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

    def _result(self, client: str, lease: int, rid: str, state: str, *, tokens: Optional[Sequence[int]] = None,
                error: str = "", info: Optional[dict[str, Any]] = None, retryable: bool = False,
                revision: int = 0) -> None:
        """Answer one attempt to its client: created if no answer exists yet, or (``revision``: the one we
        created at commit) updated only if it is still ours. So an attempt the client gave up, or one
        another instance answered first, keeps that answer; a write etcd did not take is retried."""
        store, me = self.store, self.me
        assert me is not None
        rec = ResultRecord(rid, client, lease, state, me.name, me.incarnation,
                           tuple(int(t) for t in tokens) if tokens is not None else None, error, dict(info or {}),
                           retryable)
        key = store.layout.result(client, rid)

        def write() -> None:
            if not store.lease_valid():   # fenced (etcd may be out of reach): later, without blocking the loop
                self._retry.append(("result", write))
                return
            try:
                done = (store.update_record(key, rec.body(), lease, revision) if revision
                        else store.create_record(key, rec.body(), lease))
            except LeaseGone:
                log.info("%r: client %r is gone; result of %s dropped", me.name, client, rid)
            except ControlPlaneUnavailable as exc:
                log.warning("%r: result of %s for %r not written (%s); retrying", me.name, rid, client, exc)
                self._retry.append(("result", write))
            except (ControlPlaneError, ValueError) as exc:
                log.warning("%r: result of %s for %r not written: %s", me.name, rid, client, exc)
            else:
                if done is None:
                    log.info("%r: result %s of %s for %r not written: the attempt is answered or given up already",
                             me.name, state, rid, client)
        write()

    # --- load figures ---------------------------------------------------------------------
    def figures(self) -> dict[str, int]:
        return {"published": sum(1 for c in self._claimed.values() if c.reader) + len(self._orphans),
                "stuck": sum(1 for c in self._claimed.values() if c.stuck and not c.checked),
                "awaiting_death": len(self._awaiting_death), "reincarnations": len(self.reincarnations),
                "taken": self.taken, "commits": self.commits, "refused_commits": self.refused_commits,
                "reads": sum(1 for r in self._reads.values() if not r.finished)}

    def _publish_stats(self, *, force: bool) -> None:
        store, me, engine = self.store, self.me, self.engine
        if me is None or engine is None or engine.shutdown_reason is not None or not store.lease_valid():
            return
        now = time.monotonic()
        if not force and now - self._last_stats < self.stats_interval_s:
            return
        figures = engine.handoff_stats()
        if not force and figures == self._last_figures and now - self._last_stats < 2.0:
            return
        self._last_stats, self._last_figures = now, figures
        try:
            evicted = engine.recent_evictions() if engine.role == DECODE else ()
            store.put_record(store.layout.stat(me.name), stats_body(me.name, me.incarnation, me.lease, figures,
                                                                    evicted), me.lease)
        except ControlPlaneError as exc:
            log.debug("%r: stats not published: %s", me.name, exc)

    def health(self) -> Health:
        return self.store.health()

    def detach(self, reason: str = "") -> None:
        """Goodbye (the lease is revoked: every key of ours goes at once) and close; idempotent."""
        if self._detached:
            return
        self._detached = True
        try:
            if self.me is not None:
                self.store.deregister()
        finally:
            self.store.close()

    def close(self) -> None:
        """Close without goodbye (a plane never attached, or one whose lease should simply expire)."""
        self._detached = True
        self.store.close()

