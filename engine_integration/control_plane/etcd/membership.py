"""The lease and incarnation of one instance in the etcd fleet: ``Membership``, a mixin of ``EtcdPlane``.

One job: being a member. ``attach`` checks the engine against the live fleet
(``policy.fleet_refusal``) and registers it under a fresh lease (``store.EtcdStore``); ``poll``
acts only while that lease is confirmed (self-fencing); a lost lease drops what the lost
incarnation held and registers again. Also ``member`` (an instance record as the policy sees
it), the role names and ``SharedState`` (what the plane's parts read of one another, declared once).

a lost lease (etcd unreachable past the TTL, the process paused, the lease revoked, or etcd gone
back in time: restored from an older snapshot, wiped; either role)
  the instance fences itself (no poll acts, no pull commits, nothing is published past
  its local lease deadline); once etcd says the lease is gone it drops what the lost
  incarnation held (requests not handed off fail as retryable; published handoffs keep
  their pins as orphans until their readers settle; a decode aborts every pull and running
  request) and registers again as a new incarnation, in the same process: it serves again
  without a restart. A name someone else holds by then is not fought for: it stops.

It builds on ``records`` and ``store``, never on the roles or the plane, which build on it
(tests/engine/test_engine_layout.py).
"""

from __future__ import annotations

from collections import deque
import logging
import time
from typing import Any, Callable, Optional

from engine_integration.control_plane import policy
from engine_integration.control_plane.base import ControlPlaneError, Health, PlaneEngine, RegistrationRefused
from engine_integration.control_plane.etcd.records import InstanceRecord
from engine_integration.control_plane.etcd.store import EtcdStore, NameTaken

log = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"


def member(record: InstanceRecord) -> policy.Member:
    """An instance record as the fleet policy sees it."""
    fingerprint = record.extra.get("fingerprint")
    return policy.Member(record.name, record.role, record.capacity_blocks, tuple(record.transfer_meta),
                         fingerprint if isinstance(fingerprint, str) else None)


class SharedState:
    """What the plane's parts (``Membership``, ``PrefillRole``, ``DecodeRole``) read of one another: declared
    here, set up by ``plane.EtcdPlane.__init__`` (and ``me``/``engine`` at ``attach``)."""

    store: EtcdStore
    engine: Optional[PlaneEngine]
    me: Optional[InstanceRecord]
    repair_grace_s: float
    repairs: int
    detections: "deque[dict[str, Any]]"


class Membership(SharedState):
    """Registration, the lease, fencing and reincarnation of one ``EtcdPlane`` (a mixin: its state is the
    plane's; ``prefill_role.PrefillRole`` and ``decode_role.DecodeRole`` drop what a lost incarnation held)."""

    # what it uses of the plane besides ``SharedState``: these, its ``_poll_plane``,
    # ``_publish_stats``, the decode's ``_fence`` and the roles' ``_drop_claims`` / ``_drop_reads``
    insecure: bool
    poll_interval_s: float
    _last_poll: float
    _retry: list[tuple[str, Callable[[], None]]]

    def _init_membership(self) -> None:
        """The lease's state: why it was lost, whether its work was dropped, the counts."""
        self._detached = False
        self._lost: Optional[str] = None                              # why our lease was lost (set by the keepalive)
        self._lost_at = 0.0
        self._dropped = False                                         # the lost incarnation's work was dropped
        self.fenced_polls = 0                                         #: polls skipped with our lease not confirmed
        self.reincarnations: list[dict[str, Any]] = []                #: each re-registration after a lost lease

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

    # --- the loop's gate: fenced, or lost -------------------------------------------------
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
        self.store.check_rewind()   # etcd seen going back in time by any call: the lease counts as lost
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
        reason = f"{old.role} {old.name!r} lost its etcd lease ({why})"
        if old.role == PREFILL:
            self._drop_claims(old, reason)
        else:
            self._drop_reads(reason)
        # state writes of the old incarnation went with its lease; answers to clients (under their leases,
        # created or updated only if still ours) are still owed
        self._retry = [item for item in self._retry if item[0] == "result"]

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
