"""The engine's side of the etcd control plane: ``EtcdPlane``. No coordinator; the state lives in etcd.

``DisaggDynamicInferenceEngine.connect(EtcdPlane.open("etcd://..."), role=..., name=...)``
checks the engine against the live fleet (``policy.fleet_refusal``), registers it under a
fresh lease (``store.EtcdStore``), and from then on, every ``poll_interval_s``, takes one
snapshot of the fleet and acts on the verdicts computed from it
(``FleetView.source_verdicts`` / ``reader_verdicts``), so any process that restarts
reaches the same decisions.

Its jobs live in one module each, composed here (``EtcdPlane`` is their facade):

membership      ``Membership``: registration, the lease, fencing, a lost lease and the new incarnation
prefill_role    ``PrefillRole``: claim requests, route and publish handoffs, act on source verdicts
decode_role     ``DecodeRole``: take handoffs, pull, commit under the lease, act on reader verdicts

This module keeps what they share: the configuration (``open``), the state set up at
construction, one poll's snapshot (``_poll_plane``), answers to clients (``_result``), the
load figures and the writes etcd did not take yet (retried every poll).

Clients (``etcd.client.EtcdGenerationClient``) write requests under their own lease and
read ``results/<client>/``. An attempt whose holder dies, or that fails as retryable, runs
again on a live prefill (the client's choice); each attempt's result is created once, so
each request is answered once.

It builds on the etcd modules below it (``records``, ``requests``, ``store``, ``membership``,
``prefill_role``, ``decode_role``) and loads neither torch nor zmq (tests/engine/test_engine_layout.py);
the package's imports: its row of ``LAYERS`` in tests/project/test_library_layout.py.
"""

from __future__ import annotations

from collections import deque
import logging
import time
from typing import Any, Callable, Mapping, Optional, Sequence
from urllib.parse import parse_qs, urlsplit

from kvxfer.defaults import MAX_TIMEOUT_S, MIN_TIMEOUT_S, SettingError, bounded_float

from engine_integration.control_plane.base import (ControlPlane, ControlPlaneError, ControlPlaneUnavailable,
                                                   PlaneEngine)
from engine_integration.control_plane.etcd.decode_role import DecodeRole
from engine_integration.control_plane.etcd.membership import DECODE, PREFILL, Membership, member
from engine_integration.control_plane.etcd.prefill_role import PrefillRole
from engine_integration.control_plane.etcd.records import FleetView, InstanceRecord
from engine_integration.control_plane.etcd.requests import ResultRecord, stats_body
from engine_integration.control_plane.etcd.store import PLANE_QUERY_KEYS, EtcdStore, LeaseGone, parse_etcd_url

__all__ = ["DECODE", "PREFILL", "EtcdPlane", "member"]

log = logging.getLogger(__name__)


class EtcdPlane(Membership, PrefillRole, DecodeRole, ControlPlane):
    """One engine's membership in an etcd fleet (see the module docstring): its lease (``Membership``) and
    its role (``PrefillRole`` or ``DecodeRole``) over the state they share, set up here."""

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
        self._seen: dict[tuple[str, str], InstanceRecord] = {}        # (name, incarnation) -> its record
        self._retry: list[tuple[str, Callable[[], None]]] = []        # ("state"/"result", write) etcd did not take yet
        self.repair_grace_s = float(store.config.ttl_s)               #: how long a missing source key is waited for
        self.repairs = 0                                              #: handoff keys of ours restored after a deletion
        self.detections: deque[dict[str, Any]] = deque(maxlen=1024)   #: the latest verdicts about dead peers, with times
        self._init_membership()
        self._init_prefill()
        self._init_decode()

    @classmethod
    def open(cls, url: str, *, password_file: Optional[str] = None, secret_file: Optional[str] = None,
             insecure: bool = False, handoff_timeout_s: Optional[float] = None, **config: Any) -> "EtcdPlane":
        """From ``etcd://[user@]host:port[,...]/cluster?ttl=5&poll=0.25&handoff_timeout=120``; ``config``
        overrides ``EtcdConfig`` fields. ``handoff_timeout`` (seconds, in the URL or as an argument) is
        how long a routed handoff may take before its reader counts as stuck; ``prefix_routing=0`` routes
        to the least loaded decode only (no prefix preference)."""
        options = {k: v for k, v in (("password_file", password_file), ("secret_file", secret_file)) if v}
        query = {k: v[-1] for k, v in parse_qs(urlsplit(url).query).items() if k in PLANE_QUERY_KEYS}
        try:
            handoff_timeout_s = bounded_float("handoff_timeout", query.get("handoff_timeout", 120.0)
                                              if handoff_timeout_s is None else handoff_timeout_s,
                                              MIN_TIMEOUT_S, MAX_TIMEOUT_S, unit="seconds")
        except SettingError as exc:  # inf or 1e308 once passed: a stuck reader was never counted stuck
            raise ValueError(f"etcd URL: {exc}") from None
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

    # --- the loop -------------------------------------------------------------------------
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
            return self._act_as_prefill(view)
        return self._act_as_reader(view)

    def _clear(self, source: str, rid: str) -> None:
        try:
            self.store.clear_handoff(source, rid)
        except ControlPlaneError as exc:
            log.warning("%r: could not clear handoff %s/%s (%s); next poll", self.me.name if self.me else "?",
                        source, rid, exc)

    # --- results --------------------------------------------------------------------------
    def finished(self, record: Mapping[str, Any]) -> None:
        rid = str(record["request_id"])
        assert self.engine is not None
        if self.engine.role == PREFILL:   # only refusals come out of a prefill's step
            if "error" in record:
                self._fail_claim(rid, record["error"])
            return
        self._reader_finished(rid, record)

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
