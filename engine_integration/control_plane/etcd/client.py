"""A client of the etcd fleet: submit prompts, collect results in input order (no coordinator).

Requests and results live under this client's own lease (``requests/<prefill>/<rid>``,
``results/<client>/<rid>``: ``etcd.requests``); if the client dies, they go. It routes each
request to a prefill itself (``policy.pick_prefill``, over its own requests in flight) and
refuses at submit what the live fleet cannot hold (``policy.admission_problem``), with the
reason. A request whose holder dies is failed from the same snapshot that shows the death.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from engine_integration.control_plane import policy
from engine_integration.control_plane.base import FleetStats, GenerationClient, GenerationResult
from engine_integration.control_plane.etcd.plane import PREFILL, member
from engine_integration.control_plane.etcd.records import FleetView, RecordRefused, check_name
from engine_integration.control_plane.etcd.requests import (DONE, FAILED, RequestRecord, ResultRecord,
                                                            decode_result, decode_stats)
from engine_integration.control_plane.etcd.store import EtcdStore

log = logging.getLogger("kvxfer.engine.etcd")


@dataclass
class _Pending:
    prefill: str
    prefill_incarnation: str
    submitted_at: float


class EtcdGenerationClient(GenerationClient):
    """Submit prompts through etcd and collect results in input order (see the module docstring).

    ``store`` is an unregistered ``EtcdStore`` (or an ``EtcdPlane``, whose store is used): it
    only reads the fleet and signs records.
    """

    def __init__(self, store: Any, *, name: Optional[str] = None) -> None:
        store = getattr(store, "store", store)
        self.store: EtcdStore = store
        self.layout = store.layout
        self.name = check_name("client", name or f"client-{uuid.uuid4().hex[:12]}")
        self.lease, ttl = store.client.lease_grant(store.config.ttl_s)
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
        prefills = {p.name: p for p in view.live(PREFILL)}
        why = policy.admission_problem(list(prompt), max_new_tokens, (member(r) for r in view.live()))
        if why is None and not prefills:
            why = f"no live prefill instance in etcd cluster {self.store.config.cluster!r}"
        if why is not None:
            self._results[rid] = GenerationResult(None, f"request refused at submit: {why}")
            return rid
        load = {name: 0 for name in prefills}
        for pending in self._pending.values():
            if pending.prefill in load:
                load[pending.prefill] += 1
        prefill = prefills[policy.pick_prefill(load)]  # type: ignore[index]
        rec = RequestRecord(rid, self.name, self.lease, prefill.name, prefill.incarnation,
                            tuple(int(t) for t in prompt), int(max_new_tokens))
        self.store.put_record(self.layout.request(prefill.name, rid), rec.body(), self.lease)
        self._pending[rid] = _Pending(prefill.name, prefill.incarnation, time.monotonic())
        return rid

    def poll(self) -> None:
        """One look at the fleet (first) and at our results (second): deliver, or fail orphans."""
        if not self._pending:
            return
        view = self.view()   # before the results: a holder's last word is then never missed
        current: dict[str, ResultRecord] = {}
        for kv in self.store.range_raw(f"{self.layout.results}{self.name}/"):
            key = kv.key.decode(errors="replace")
            try:
                rec = decode_result(key, kv.value, kv.lease, self.layout, self.store.cluster_key,
                                    allow_unauthenticated=self.store.config.allow_unauthenticated)
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
                self.store.delete(self.layout.result(self.name, rid))
                continue
            if rec is not None:   # decoding: held by that decode incarnation
                if not view.is_live(rec.by, rec.by_incarnation):
                    error = f"decode {rec.by!r} died while decoding (its etcd lease expired or it restarted)"
            elif not view.is_live(pending.prefill, pending.prefill_incarnation) \
                    and (pending.prefill, rid) not in view.handoffs:
                error = (f"prefill {pending.prefill!r} died before handing the request off "
                         "(its etcd lease expired or it restarted)")
                self.store.delete(self.layout.request(pending.prefill, rid))
            if error is not None:
                self._results[rid] = GenerationResult(None, error)
                del self._pending[rid]
                self.store.delete(self.layout.result(self.name, rid))

    def collect(self, ids: Sequence[str], timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        while any(i in self._pending for i in ids) and time.monotonic() < deadline:
            self.poll()
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
