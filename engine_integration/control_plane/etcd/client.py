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
from engine_integration.control_plane.etcd.membership import DECODE, PREFILL, member
from engine_integration.control_plane.etcd.records import FleetView, RecordRefused, check_name
from engine_integration.control_plane.etcd.requests import (DECODING, DONE, FAILED, RequestRecord, ResultRecord,
                                                            decode_result, decode_stats)
from engine_integration.control_plane.etcd.store import EtcdStore

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
        self.lease, ttl = store.client.lease_grant(store.config.ttl_s)
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
        while not self._stop.wait(interval):
            try:
                self.store.client.lease_keepalive(self.lease)
            except Exception as exc:  # noqa: BLE001 - keep trying until closed
                log.warning("client %r: lease keepalive failed: %s", self.name, exc)

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
        pending = _Pending(rid, tuple(int(t) for t in prompt), int(max_new_tokens), "", "", time.monotonic())
        self._send(pending, view)
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
                if not view.is_live(rec.by, rec.by_incarnation):
                    self._run_again(rid, pending, view, f"decode {rec.by!r} died while decoding (its etcd lease "
                                                        "expired or it restarted)")
            elif not view.is_live(pending.prefill, pending.prefill_incarnation) \
                    and (pending.prefill, pending.rid) not in view.handoffs:
                self._run_again(rid, pending, view, f"prefill {pending.prefill!r} died before handing the request "
                                                    "off (its etcd lease expired or it restarted)")

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
