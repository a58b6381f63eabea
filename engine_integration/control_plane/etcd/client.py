"""A client of the etcd fleet: submit prompts, collect results in input order (no coordinator).

Requests and results live under this client's own lease (``requests/<prefill>/<rid>``,
``results/<client>/<rid>``: ``etcd.requests``); if the client dies, they go. It routes each
request to a prefill itself (``policy.pick_prefill``, over its own requests in flight) and
refuses at submit what the live fleet cannot hold (``policy.admission_problem``), with the
reason.

**Exactly one answer per request, through instance deaths.** Each run of a request is an
*attempt* with its own key id (``<client>.<n>``, then ``<client>.<n>.<k>``). An attempt that
ends because an instance died or lost its lease before any token was committed — its
prefill gone before handing it off (seen from a snapshot: no live prefill incarnation, no
handoff), its prefill gone mid-pull, its decode gone — is given up and the request runs
again on a live prefill (``max_attempts`` in all, default 3). Giving up creates the
attempt's result ("abandoned") unless one exists: the decode that would commit that
attempt's KV creates the same result first (``EtcdPlane._fence``), so exactly one of the two
wins and an abandoned attempt is never served; results of attempts given up are ignored and
removed. A request that cannot run again (no live prefill or decode, attempts spent) fails
with every reason; a refusal or a transport error is not retried.

**A lost lease is replaced, never fatal** (round 6: revoked by an etcd user, or outlived by a
pause past the TTL; before, every later submit raised ``LeaseGone`` and the requests in flight
waited out their timeout in silence). The keepalive thread only notes that etcd says the lease
is gone; the caller's thread (``poll``, ``submit``; also when the lease is past its local
deadline, as after ``SIGSTOP``) takes a new lease and settles each request in flight:

- one an engine was seen holding (its result ``decoding``, its handoff published, or the
  prefill's claim on it still in etcd) fails, saying so: its answer was to be written under
  the lost lease and cannot reach this client any more;
- one nobody was seen holding is sent again as a new attempt under the new lease (its request
  key went with the old one; whatever became of the old attempt, its answer can never reach
  this client: its result key needs the old lease, so the request is still answered once).

etcd seen going back in time (``gateway.Rewind``: restored, wiped) fails every request in flight
with the reason (its keys are gone or stale and every engine registers again) and takes a new
lease; requests submitted afterwards are served by the engines' new incarnations.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from engine_integration.control_plane import policy
from engine_integration.control_plane.base import (ControlPlaneError, ControlPlaneUnavailable, FleetStats,
                                                   GenerationClient, GenerationResult)
from engine_integration.control_plane.etcd.gateway import EtcdError, EtcdUnavailable
from engine_integration.control_plane.etcd.membership import DECODE, PREFILL, member
from engine_integration.control_plane.etcd.records import FleetView, RecordRefused, check_name
from engine_integration.control_plane.etcd.requests import (DECODING, DONE, FAILED, RequestRecord, ResultRecord,
                                                            decode_result, decode_stats)
from engine_integration.control_plane.etcd.store import EtcdStore, LeaseGone

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """One request the client waits for, and its current attempt."""

    rid: str                        #: the current attempt's id (the key of its request and result)
    prompt: tuple[int, ...]
    max_new_tokens: int
    prefill: str
    prefill_incarnation: str
    submitted_at: float
    attempt: int = 1
    reasons: list[str] = field(default_factory=list)   #: why earlier attempts were given up
    held_by: str = ""               #: who was last seen holding the current attempt (its answer needs our lease)


class EtcdGenerationClient(GenerationClient):
    """Submit prompts through etcd and collect results in input order (see the module docstring).

    ``store`` is an unregistered ``EtcdStore`` (or an ``EtcdPlane``, whose store is used): it
    only reads the fleet and signs records.
    """

    def __init__(self, store: Any, *, name: Optional[str] = None, max_attempts: int = 3,
                 abandoned_grace_s: Optional[float] = None) -> None:
        store = getattr(store, "store", store)
        self.store: EtcdStore = store
        self.layout = store.layout
        self.name = check_name("client", name or f"client-{uuid.uuid4().hex[:12]}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.max_attempts = max_attempts
        #: how long the result key of an attempt given up is kept (so that no late writer can create it)
        self.abandoned_grace_s = abandoned_grace_s if abandoned_grace_s is not None else 3.0 * store.config.ttl_s
        sent = time.monotonic()
        self.lease, ttl = store.client.lease_grant(store.config.ttl_s)
        self._lease_deadline = sent + ttl              # past it, the lease is confirmed before it is trusted
        self._lease_problem: Optional[str] = None      # set by the keepalive thread: etcd says the lease is gone
        self._epoch = store.client.epoch               # etcd's rewinds seen by the gateway when the lease was granted
        self.lease_renewals: list[dict[str, Any]] = []   #: each lost lease replaced: why, what failed, what ran again
        self._to_settle: Optional[tuple[int, str, bool]] = None   # (lost lease, why, rewound) until settled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, args=(max(0.5, ttl / 3.0),), daemon=True,
                                        name=f"etcd-lease-{self.name}")
        self._thread.start()
        self._ids = itertools.count(1)
        self._pending: dict[str, _Pending] = {}          # request id (what submit returned) -> its attempt
        self._results: dict[str, Any] = {}
        self._abandoned: dict[str, float] = {}           # attempt id given up -> when
        self._view: Optional[FleetView] = None
        self._view_at = 0.0
        self._known: set[str] = set()
        self.reroutes = 0                                #: attempts run again after an instance died
        self.reroute_log: list[dict[str, Any]] = []      #: (request, old attempt, new attempt, why, when)

    def _keepalive(self, interval: float) -> None:
        """Renew the lease; a lease etcd says is gone is only noted here (the caller's thread replaces it)."""
        while not self._stop.wait(interval):
            lease, sent = self.lease, time.monotonic()
            try:
                ttl = self.store.client.lease_keepalive(lease)
            except Exception as exc:  # noqa: BLE001 - keep trying until closed
                log.warning("client %r: lease keepalive failed: %s", self.name, exc)
                continue
            if lease != self.lease:
                continue   # replaced meanwhile
            if ttl > 0:
                self._lease_deadline = sent + ttl
            elif self._lease_problem is None:
                self._lease_problem = "etcd says it expired or was revoked"
                log.warning("client %r: etcd lease %d is gone: a new one is taken at the next poll or submit",
                            self.name, lease)

    # --- a lost lease ------------------------------------------------------------------------
    def _check_lease(self) -> None:
        """Replace the lease if etcd went back in time, says it is gone, or (past its local deadline: this
        process was paused, or etcd was away) says so when asked now."""
        gateway = self.store.client
        if self._to_settle is not None:   # a lease replaced before etcd let us settle what was in flight
            self._settle(*self._to_settle)
        if gateway.epoch != self._epoch:
            self._renew_lease(f"etcd went back in time: {gateway.last_rewind}", rewound=True)
            return
        why = self._lease_problem
        if why is None and time.monotonic() > self._lease_deadline:
            lease, sent = self.lease, time.monotonic()
            try:
                ttl = gateway.lease_keepalive(lease)
            except EtcdError as exc:   # etcd away: nothing to decide yet
                log.info("client %r: lease %d not confirmed (%s)", self.name, lease, exc)
                return
            if ttl > 0:
                self._lease_deadline = sent + ttl
                return
            why = "etcd says it expired or was revoked"
        if why is not None:
            self._renew_lease(why, rewound=False)

    def _renew_lease(self, why: str, *, rewound: bool) -> None:
        """Take a new lease and settle every request in flight (see the module docstring)."""
        gateway, old = self.store.client, self.lease
        try:
            gateway.lease_revoke(old)   # a restored etcd may have brought it back, with stale requests under it
        except EtcdError as exc:
            log.info("client %r: old lease %d not revoked (%s)", self.name, old, exc)
        sent = time.monotonic()
        try:
            lease, ttl = gateway.lease_grant(self.store.config.ttl_s)
        except EtcdUnavailable as exc:
            raise ControlPlaneUnavailable(f"client {self.name!r} lost its etcd lease ({why}) and cannot take a "
                                          f"new one yet: {exc}") from None
        except EtcdError as exc:
            raise ControlPlaneError(f"client {self.name!r} lost its etcd lease ({why}) and cannot take a new "
                                    f"one: {exc}") from None
        self.lease, self._lease_deadline, self._lease_problem = lease, sent + ttl, None
        self._epoch = gateway.epoch
        self._abandoned.clear()   # their result keys went with the old lease
        self._to_settle = (old, why, rewound)
        self._settle(old, why, rewound)

    def _settle(self, old: int, why: str, rewound: bool) -> None:
        """Fail or send again each request in flight when lease ``old`` was lost (see the module docstring);
        if etcd does not answer meanwhile, the next ``poll`` or ``submit`` settles them."""
        self._view = None
        view = self.view()
        failed, again = [], []
        for rid, pending in list(self._pending.items()):
            holder = "" if rewound else self._holder(pending, view)
            if rewound:
                error = (f"{why}; attempt {pending.rid} (its request, claim, handoff and result keys) is gone or "
                         "stale there and every engine registers again: submit the request again")
            elif holder:
                error = (f"client {self.name!r} lost its etcd lease {old} ({why}) while {holder} held attempt "
                         f"{pending.rid}: its answer was to be written under that lease and can no longer reach "
                         "this client; submit the request again")
            else:
                error = self._send_again(rid, pending, view, f"its request key went with lease {old} ({why}) before "
                                                        "anyone was seen taking it")
                if error is None:
                    again.append(rid)
                    continue
            self._pending.pop(rid)
            self._results[rid] = GenerationResult(None, error)
            failed.append(rid)
        self._to_settle = None
        self.lease_renewals.append({"old": old, "new": self.lease, "why": why, "rewound": rewound, "failed": failed,
                                    "sent_again": again, "at": time.time()})
        log.warning("client %r: etcd lease %d lost (%s): new lease %d; %d request(s) in flight failed, %d sent again",
                    self.name, old, why, self.lease, len(failed), len(again))

    def _holder(self, pending: _Pending, view: FleetView) -> str:
        """Who holds ``pending``'s current attempt ("" if nobody was seen taking it): the decode seen
        decoding it, its prefill while its handoff is published, or its prefill while its claim lives."""
        if pending.held_by:
            return pending.held_by
        if (pending.prefill, pending.rid) in view.handoffs:
            return f"prefill {pending.prefill!r}"
        try:
            claimed = self.store.read(self.layout.claim(pending.prefill, pending.rid)) is not None
        except ControlPlaneError:
            claimed = True   # cannot tell: never risk running it twice
        return f"prefill {pending.prefill!r}" if claimed else ""

    def _send_again(self, rid: str, pending: _Pending, view: FleetView, why: str) -> Optional[str]:
        """Send ``pending`` again as a new attempt under the current lease; None, or why it fails instead."""
        pending.reasons.append(why)
        if pending.attempt >= self.max_attempts:
            return f"{'; '.join(pending.reasons)} ({pending.attempt} attempts made)"
        if not view.live(PREFILL):
            return f"{'; '.join(pending.reasons)} (no live prefill to run it again)"
        pending.attempt += 1
        pending.rid = f"{rid}.{pending.attempt}"
        pending.held_by = ""
        try:
            self._send(pending, view)
        except ControlPlaneError as exc:
            return f"{'; '.join(pending.reasons)} (not sent again: {exc})"
        return None

    def view(self, max_age_s: float = 0.0) -> FleetView:
        if self._view is None or time.monotonic() - self._view_at > max_age_s:
            self._view, self._view_at = self.store.snapshot(), time.monotonic()
        return self._view

    def submit(self, prompt: Sequence[int], max_new_tokens: int, *, wait_for_prefill_s: float = 30.0) -> str:
        rid = f"{self.name}.{next(self._ids)}"
        deadline = time.monotonic() + wait_for_prefill_s
        view = self.view(self.store.config.poll_interval_s)
        while not view.live(PREFILL) and time.monotonic() < deadline:
            time.sleep(self.store.config.poll_interval_s)
            view = self.view()
        why = policy.admission_problem(list(prompt), max_new_tokens, (member(r) for r in view.live()))
        if why is None and not view.live(PREFILL):
            why = f"no live prefill instance in etcd cluster {self.store.config.cluster!r}"
        if why is not None:
            self._results[rid] = GenerationResult(None, f"request refused at submit: {why}")
            return rid
        self._check_lease()
        pending = _Pending(rid, tuple(int(t) for t in prompt), int(max_new_tokens), "", "", time.monotonic())
        try:
            self._send(pending, view)
        except LeaseGone:   # etcd refused a write under our lease: replace it, then send under the new one
            self._lease_problem = "etcd refused a write under it (lease not found)"
            self._check_lease()
            self._send(pending, self.view())
        self._pending[rid] = pending
        return rid

    def _send(self, pending: _Pending, view: FleetView) -> None:
        """Write the current attempt for the live prefill with the fewest of our requests in flight."""
        prefills = {p.name: p for p in view.live(PREFILL)}
        load = {name: 0 for name in prefills}
        for other in self._pending.values():
            if other.prefill in load and other is not pending:
                load[other.prefill] += 1
        prefill = prefills[policy.pick_prefill(load)]  # type: ignore[index]
        rec = RequestRecord(pending.rid, self.name, self.lease, prefill.name, prefill.incarnation, pending.prompt,
                            pending.max_new_tokens)
        self.store.put_record(self.layout.request(prefill.name, pending.rid), rec.body(), self.lease)
        pending.prefill, pending.prefill_incarnation = prefill.name, prefill.incarnation

    def poll(self) -> None:
        """One look at the fleet (first) and at our results (second): deliver, run again, or fail."""
        if not self._pending and not self._abandoned:
            return
        view = self.view()   # before the results: a holder's last word is then never missed
        self._check_lease()   # after it: that range is where a rewind of etcd shows
        view = self._view if self._view is not None else self.view()
        current: dict[str, tuple[ResultRecord, Any]] = {}
        for kv in self.store.range_raw(f"{self.layout.results}{self.name}/"):
            key = kv.key.decode(errors="replace")
            try:
                rec = decode_result(key, kv.value, kv.lease, self.layout, self.store.cluster_key,
                                    allow_unauthenticated=self.store.config.allow_unauthenticated)
            except RecordRefused as exc:
                log.warning("client %r: refused result %s: %s", self.name, key, exc)
                continue
            current[rec.request_id] = (rec, kv)
        attempts = {p.rid: rid for rid, p in self._pending.items()}
        for attempt, (rec, kv) in current.items():   # late answers to attempts given up, or to nothing of ours
            if attempt not in attempts and attempt not in self._abandoned:
                self.store.delete(self.layout.result(self.name, attempt))
        now = time.monotonic()
        for attempt, since in list(self._abandoned.items()):
            if now - since > self.abandoned_grace_s:
                del self._abandoned[attempt]
                self.store.delete(self.layout.result(self.name, attempt))
        for rid, pending in list(self._pending.items()):
            found = current.get(pending.rid)
            rec = found[0] if found is not None else None
            if rec is not None and rec.state in (DONE, FAILED):
                if rec.state == FAILED and rec.retryable:
                    self._run_again(rid, pending, view, rec.error or f"attempt {pending.rid} failed on {rec.by!r}")
                    continue
                self._deliver(rid, rec)
                continue
            if rec is not None:   # decoding: held by that decode incarnation
                pending.held_by = f"decode {rec.by!r}"
                if not view.is_live(rec.by, rec.by_incarnation):
                    self._run_again(rid, pending, view, f"decode {rec.by!r} died while decoding (its etcd lease "
                                                        "expired or it restarted)")
            elif not view.is_live(pending.prefill, pending.prefill_incarnation) \
                    and (pending.prefill, pending.rid) not in view.handoffs:
                self._run_again(rid, pending, view, f"prefill {pending.prefill!r} died before handing the request "
                                                    "off (its etcd lease expired or it restarted)")
            elif (pending.prefill, pending.rid) in view.handoffs and not pending.held_by:
                pending.held_by = f"prefill {pending.prefill!r}"   # a decode seen decoding it stays its holder

    def _deliver(self, rid: str, rec: ResultRecord) -> None:
        pending = self._pending.pop(rid)
        error = rec.error or None if rec.state == FAILED else None
        if rec.state == FAILED and not error:
            error = f"request {rid} failed on {rec.by!r}"
        if error and pending.reasons:
            error = f"{error} (after {pending.attempt} attempts; before: {'; '.join(pending.reasons)})"
        self._results[rid] = GenerationResult(
            rec.tokens, error, {k: float(v) for k, v in rec.info.items() if isinstance(v, (int, float))},
            int(rec.info.get("cached_prefix_blocks", 0)), int(rec.info.get("pulled_blocks", 0)),
            rec.by if rec.state == DONE else None)
        self.store.delete(self.layout.result(self.name, pending.rid))

    def _run_again(self, rid: str, pending: _Pending, view: FleetView, why: str) -> None:
        """Give the current attempt up (its result created as abandoned, unless it exists) and run the
        request again on a live prefill; or fail it, with every reason, when it cannot run again."""
        old = pending.rid
        key = self.layout.result(self.name, old)
        tombstone = ResultRecord(old, self.name, self.lease, FAILED, self.name, "", error=f"abandoned: {why}")
        try:
            if self.store.create_record(key, tombstone.body(), self.lease) is None:
                found = self.store.read(key)
                if found is not None:
                    rec = decode_result(key, found.value, found.lease, self.layout, self.store.cluster_key,
                                        allow_unauthenticated=self.store.config.allow_unauthenticated)
                    if rec.state == DECODING and view.is_live(rec.by, rec.by_incarnation) or rec.state == DONE:
                        return   # a live decode committed it meanwhile: its answer comes
        except (ControlPlaneError, RecordRefused) as exc:
            log.warning("client %r: attempt %s not given up now (%s); next poll", self.name, old, exc)
            return
        self.store.delete(self.layout.request(pending.prefill, old))   # not taken yet: nobody will
        self._abandoned[old] = time.monotonic()
        pending.reasons.append(why)
        live = {PREFILL: view.live(PREFILL), DECODE: view.live(DECODE)}
        missing = [role for role, records in live.items() if not records]
        if pending.attempt >= self.max_attempts or missing:
            self._pending.pop(rid)
            not_again = (f"{pending.attempt} attempts made" if pending.attempt >= self.max_attempts
                         else f"no live {' or '.join(missing)} to run it again")
            self._results[rid] = GenerationResult(None, f"{'; '.join(pending.reasons)} ({not_again})")
            return
        pending.attempt += 1
        pending.rid = f"{rid}.{pending.attempt}"
        pending.held_by = ""
        self._send(pending, view)
        self.reroutes += 1
        self.reroute_log.append({"request": rid, "from": old, "to": pending.rid, "prefill": pending.prefill,
                                 "why": why, "at": time.time()})
        log.warning("client %r: request %s runs again as attempt %s on prefill %r: %s", self.name, rid, pending.rid,
                    pending.prefill, why)

    def collect(self, ids: Sequence[str], timeout_s: float) -> list[Any]:
        """The results of ``ids`` (submit's), waiting up to ``timeout_s``. etcd out of reach for a while
        (a leader election, a member lost) is waited out like a slow answer: the requests are in etcd."""
        deadline = time.monotonic() + timeout_s
        while any(i in self._pending for i in ids) and time.monotonic() < deadline:
            try:
                self.poll()
            except ControlPlaneUnavailable as exc:
                log.warning("client %r: etcd did not answer (%s); waiting on", self.name, exc)
            if any(i in self._pending for i in ids):
                time.sleep(self.store.config.poll_interval_s)
        out = []
        for i in ids:
            if i in self._pending:
                self._pending.pop(i)
                out.append(GenerationResult(None, f"no result within {timeout_s}s"))
            else:
                out.append(self._results.pop(i))
        return out

    def ready(self) -> list[str]:
        """The submitted ids whose results are here: ``collect`` returns them without waiting."""
        return list(self._results)

    def holders(self) -> dict[str, str]:
        """The requests in flight an engine was seen holding (as of the last ``poll``): id -> who."""
        return {rid: p.held_by for rid, p in self._pending.items() if p.held_by}

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def engine_stats(self) -> dict[str, dict[str, Any]]:
        """Each instance's last published load figures, with ``alive`` from the live set."""
        view = self.view()
        out: dict[str, dict[str, Any]] = {}
        for kv in self.store.range_raw(self.layout.stats):
            try:
                name, incarnation, figures = decode_stats(kv.key.decode(errors="replace"), kv.value, kv.lease,
                                                          self.layout, self.store.cluster_key)
            except RecordRefused:
                continue
            figures.pop("evicted", None)   # routing's business, not a load figure
            out[name] = {**figures, "alive": view.is_live(name, incarnation), "incarnation": incarnation}
        for inst in view.live():
            out.setdefault(inst.name, {"alive": True, "incarnation": inst.incarnation})
            self._known.add(inst.name)
        for name in self._known - set(out):   # gone with its lease: known dead
            out[name] = {"alive": False}
        return out

    def stats(self) -> FleetStats:
        """Each engine's published figures and the requests in flight (the coordinator's ``Stats`` shape)."""
        engines = self.engine_stats()
        return FleetStats(engines=engines, requests_in_flight=self.in_flight + len(self.view().handoffs))

    def close(self) -> None:
        """Stop the keepalive and revoke our lease: our requests and results go with it."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.store.client.lease_revoke(self.lease)
        except Exception as exc:  # noqa: BLE001 - it expires anyway
            log.info("client %r: lease not revoked (%s); it expires", self.name, exc)
