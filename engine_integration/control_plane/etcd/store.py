"""The fleet's state in etcd: this instance's lease, its records, the verified snapshot.

``EtcdStore`` is what an etcd-plane process holds: registration under a lease (a
restart under the same name is a new incarnation, with fresh metas, never the old ones;
a name a live instance holds is never taken over), a verified ``FleetView`` per
``snapshot``, each side's handoff key written under its own lease (``publish_handoff`` /
``set_reader_state``), ``clear_handoff``, and the request/result/stats keys beside them
(``claim``, ``put_record``, ``create_record``, ``update_record``, ``range_raw``). The
engine logic on top is ``etcd.plane.EtcdPlane``; clients use ``etcd.client``.

Every write that decides something is one revision-guarded transaction, so a write
repeated after a lost answer is recognised (it reads back its own value) and two writers
never both win: registration (guarded on the revision of the name's key it checked),
the claim of a request (delete it and write our claim together, guarded on its
revision), the repair of our own record, a reader's ``PULLING`` (guarded on the source
key it saw), and a result created once per attempt.

Each instance holds one etcd lease (``ttl_s``, kept alive every ``ttl_s / 3`` by a
daemon thread) and writes under it its instance record and its side of each handoff
(``records`` has the key layout). Readers poll one range per snapshot
(``poll_interval_s``); so an instance that dies (``kill -9``, host lost, partition) is
seen gone within ``ttl_s`` + etcd's expiry sweep (~0.5 s) + one poll, by every reader,
with no kvxfer process in the loop: the state lives in etcd, which is replicated.

Self-fencing: a process cut off from etcd cannot learn its lease expired, so it keeps a
conservative local deadline (the last acknowledged keepalive's *send* time + TTL);
``lease_valid()`` turns False at that deadline, never later than etcd's own expiry.
A decode must not commit a pull then (the source may already have freed the blocks;
the torn-read check is the second line). Once etcd answers that the lease is gone,
``lease_lost`` is set and ``on_lease_lost`` called: the instance re-registers as a new
incarnation (``register`` again) and treats everything of the old one as failed.

etcd going back in time (restored from an older snapshot, wiped and secured again, another
cluster behind the endpoint: ``gateway.Rewind``) counts as a lost lease too: what the fleet
wrote since is gone or stale, and a handoff record of the old incarnation could name blocks
long reused. The instance registers again as a new incarnation, so that every record of the
old one is ignored by every reader, and revokes its old lease if the restore brought it back.

Polling rather than etcd's streaming watch: one range per poll is simple, stateless
and self-healing across reconnects and compactions (a watch must resume from a
revision and handle compaction); the cost is one small request per poll per process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import ssl
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence
from urllib.parse import parse_qs, urlsplit

from kvxfer.defaults import ETCD_POLL_S, ETCD_TTL_S, SettingError, bounded_float, bounded_int

from engine_integration.control_plane.base import ControlPlaneError, ControlPlaneUnavailable, Health
from engine_integration.control_plane.etcd.gateway import (KV, EtcdError, EtcdHttpClient, EtcdUnavailable, TxnResult,
                                                           delete_op, if_absent, if_mod_revision, prefix_end, put_op,
                                                           range_op)
from engine_integration.control_plane.etcd.records import (MAX_RECORD_BYTES, ROLES, Change, FleetView, HandoffPair,
                                                           HandoffRecord, HandoffState, InstanceRecord, KeyLayout,
                                                           RecordRefused, check_name, decode_handoff,
                                                           decode_instance, diff_views, encode_record)
from engine_integration.control_plane.limits import check_json

log = logging.getLogger(__name__)


class LeaseLost(ControlPlaneError):
    """This instance's lease expired (or was revoked): it is dead to the fleet and must
    re-register as a new incarnation; nothing it holds under the old lease may be trusted."""


class LeaseGone(ControlPlaneError):
    """A put under someone else's lease (a client's) failed because that lease no longer exists."""


class NameTaken(ControlPlaneError):
    """Another live instance holds the name we register under: a live name is never taken over."""


#: environment variable naming a file that holds the etcd user's password (never in argv or URLs)
PASSWORD_FILE_ENV = "KVXFER_ETCD_PASSWORD_FILE"
#: URL query keys the engine's side reads (``etcd.plane.EtcdPlane.open``), not the store
PLANE_QUERY_KEYS = ("handoff_timeout", "prefix_routing")


@dataclass(frozen=True)
class EtcdConfig:
    """How to reach etcd and how fast deaths are noticed.

    ``ttl_s`` trades detection speed for tolerance of pauses: an instance that cannot
    reach etcd for ``ttl_s`` is dead to the fleet. 5 s is well above a GC or scheduling
    stall and makes a decode's death free its source pins in about 5.5-6 s; etcd's floor
    is 2 s with its default election timeout.
    """

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    cluster: str = "default"
    user: Optional[str] = None
    password: Optional[str] = field(default=None, repr=False)
    password_file: Optional[str] = None        #: else ``$KVXFER_ETCD_PASSWORD_FILE``
    ttl_s: int = 5
    keepalive_interval_s: Optional[float] = None   #: default ``ttl_s / 3``
    poll_interval_s: float = 0.25
    timeout_s: float = 3.0                     #: per call, all endpoints and retries together
    cluster_key: Optional[bytes] = field(default=None, repr=False)   #: else ``$KVXFER_SECRET_FILE``
    secret_file: Optional[str] = None
    allow_unauthenticated: bool = False        #: accept unsigned records/metas from other hosts (trusted nets only)
    #: TLS to etcd: the CA that signed etcd's certificate; with ``cert_file``/``key_file`` a client
    #: certificate too (etcd's ``--client-cert-auth``; with no ``user`` etcd takes its common name as the user)
    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    #: how long ``register`` waits for a live holder of our name to go (its lease to expire) before it refuses;
    #: default ``ttl_s + 1``: a restart on another host registers as soon as the old lease is gone
    name_wait_s: Optional[float] = None

    def tls_context(self) -> Optional[ssl.SSLContext]:
        """The ``ssl.SSLContext`` for etcd's client port (``None``: plain HTTP)."""
        if not (self.ca_file or self.cert_file):
            return None
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("a client certificate needs both cert_file and key_file")
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            from engine_integration.control_plane.etcd.certs import check_certificate_dates

            check_certificate_dates(self.cert_file, "etcd client certificate")  # etcd would say "bad certificate"
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


def parse_etcd_url(url: str, **overrides: Any) -> EtcdConfig:
    """``etcd://[user@]host:port[,host:port...][/cluster][?ttl=5&poll=0.25&ca=...&cert=...&key=...]`` -> ``EtcdConfig``.

    A password in the URL is refused (URLs end up in argv and logs): use
    ``password_file`` or ``$KVXFER_ETCD_PASSWORD_FILE``. ``ca``, ``cert`` and ``key`` are
    *paths* (TLS: etcd's CA, a client certificate and its key). Query keys other than these
    and the engine's own (``EtcdPlane.open``: ``handoff_timeout``, ``prefix_routing``) are refused.
    """
    parts = urlsplit(url)
    if parts.scheme != "etcd":
        raise ValueError(f"control plane URL must start with etcd://, got {url!r}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if ":" in userinfo:
        raise ValueError("put the etcd password in a file ($KVXFER_ETCD_PASSWORD_FILE), not in the URL")
    endpoints = tuple(h for h in hosts.split(",") if h)
    if not endpoints:
        raise ValueError(f"no etcd endpoint in {url!r}")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    kwargs: dict[str, Any] = {"endpoints": endpoints, "user": userinfo or None}
    if parts.path.strip("/"):
        kwargs["cluster"] = parts.path.strip("/")
    try:  # the same ranges as the command line's (kvxfer.defaults): inf or 10**11 once reached the lease
        if "ttl" in query:
            kwargs["ttl_s"] = bounded_int("ttl", query["ttl"], *ETCD_TTL_S, unit="a whole number of seconds")
        if "poll" in query:
            kwargs["poll_interval_s"] = bounded_float("poll", query["poll"], *ETCD_POLL_S, unit="seconds")
    except SettingError as exc:
        raise ValueError(f"etcd URL: {exc}") from None
    for name, field_name in (("ca", "ca_file"), ("cert", "cert_file"), ("key", "key_file")):
        if name in query:
            kwargs[field_name] = query[name]
    unknown = set(query) - {"ttl", "poll", "ca", "cert", "key"} - set(PLANE_QUERY_KEYS)
    if unknown:
        raise ValueError(f"unknown etcd URL option(s) {sorted(unknown)}: known are ttl, poll, ca, cert, key, "
                         + ", ".join(PLANE_QUERY_KEYS))
    kwargs.update(overrides)
    return EtcdConfig(**kwargs)


def _resolve_password(config: EtcdConfig) -> Optional[str]:
    if config.user is None:
        return None
    if config.password is not None:
        return config.password
    path = config.password_file or os.environ.get(PASSWORD_FILE_ENV)
    if not path:
        raise ControlPlaneError(f"etcd user {config.user!r} needs a password: set password_file or "
                                f"${PASSWORD_FILE_ENV}")
    with open(path) as f:
        return f.read().strip()


def _resolve_cluster_key(config: EtcdConfig) -> Optional[bytes]:
    if config.cluster_key is not None:
        return config.cluster_key
    from kvxfer.security.auth import load_secret
    from kvxfer.meta.seal import meta_key_from_env

    return load_secret(secret_file=config.secret_file) if config.secret_file else meta_key_from_env()


class EtcdStore:
    """One process's view of and writes to the fleet in etcd (see the module docstring for the lease and fencing rules)."""

    backend = "etcd"

    def __init__(self, config: EtcdConfig, *, on_lease_lost: Optional[Callable[[str], None]] = None) -> None:
        if config.ttl_s < 2:
            raise ValueError(f"ttl_s must be at least 2 (etcd's minimum with default timing), got {config.ttl_s}")
        self.config = config
        self.layout = KeyLayout(config.cluster)
        self._key = _resolve_cluster_key(config)
        if self._key is None and not config.allow_unauthenticated:
            log.warning("etcd control plane without a cluster key: records are unsigned and only those "
                        "from this host are accepted (set KVXFER_SECRET_FILE)")
        self.client = EtcdHttpClient(config.endpoints, user=config.user, password=_resolve_password(config),
                                     timeout_s=config.timeout_s, tls=config.tls_context())
        self.on_lease_lost = on_lease_lost
        self.record: Optional[InstanceRecord] = None
        self._lease_ttl = 0
        self._lease_deadline = 0.0            # monotonic; conservative local expiry
        self._lease_lost = False
        self._superseded = False
        self._last_error = ""
        self._refused_total = 0
        self._refused_seen: set[tuple[str, str]] = set()
        self._last_view: Optional[FleetView] = None
        self._epoch = 0                       # the gateway's rewind epoch our lease was granted in
        self._rewound = False                 # the lease was given up because etcd went back in time
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._mutex = threading.Lock()
        self.counters: dict[str, int] = {"puts": 0, "txns": 0, "snapshots": 0, "keepalives": 0,
                                         "keepalive_errors": 0, "repairs": 0, "awaiting_repair": 0}
        self._last_instances: dict[str, InstanceRecord] = {}   # the previous snapshot's live instances
        self._awaiting_repair: set[tuple[str, str]] = set()      # (name, incarnation) logged as awaiting repair

    def __repr__(self) -> str:
        who = f"{self.record.name}/{self.record.incarnation}" if self.record else "unregistered"
        return f"EtcdStore({','.join(self.config.endpoints)}, cluster={self.config.cluster!r}, {who})"

    # --- registration and lease -------------------------------------------------------------
    def register(self, *, name: str, role: str, transfer_meta: Sequence[dict[str, Any]], capacity_blocks: int,
                 extra: Optional[dict[str, Any]] = None) -> InstanceRecord:
        """Grant a lease, write our record under it, start keeping it alive.

        Calling it again (after ``LeaseLost``, or to restart) makes a *new* incarnation
        with a new lease; the previous lease is revoked if it still exists.

        A name held by another *live* instance is not taken over (``NameTaken``, after waiting
        ``name_wait_s`` for its lease to go), the coordinator's rule: a holder on this host whose
        process is gone has restarted and is replaced at once; elsewhere its lease must expire
        first. Taking over a live name would make every peer treat the live holder's handoffs
        as dead while it still reads them (issue 21, A7). The record is written with one
        transaction guarded on the revision the check saw, so two registrants never both win.
        """
        check_name("instance name", name)
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self._stop_keepalive()
        old = self.record
        key = self.layout.instance(name)
        wait = self.config.name_wait_s if self.config.name_wait_s is not None else self.config.ttl_s + 1.0
        deadline = time.monotonic() + wait
        try:
            if old is not None and (not self._lease_lost or self._rewound):
                self._revoke_old(old)
            while True:
                holder, revision = self._name_holder(name, old)
                if holder is None:
                    epoch = self.client.epoch   # a rewind seen from here on concerns this new lease
                    sent = time.monotonic()
                    lease, ttl = self.client.lease_grant(self.config.ttl_s)
                    record = InstanceRecord(name=name, role=role, incarnation=uuid.uuid4().hex[:16], lease=lease,
                                            host=socket.gethostname(), pid=os.getpid(),
                                            capacity_blocks=int(capacity_blocks),
                                            transfer_meta=tuple(dict(m) for m in transfer_meta),
                                            started_at=time.time(), extra=dict(extra or {}))
                    if self._guarded_put(key, record.body(), lease, if_mod_revision(key.encode(), revision)):
                        break
                    self.client.lease_revoke(lease)   # someone registered meanwhile: look again
                    continue
                if time.monotonic() >= deadline:
                    raise NameTaken(f"cannot register {role} {name!r}: {holder.role} {name!r} incarnation "
                                    f"{holder.incarnation} (host {holder.host}, pid {holder.pid}) is registered and "
                                    f"its lease is alive; a live instance's name is not taken over: stop it, or "
                                    f"wait for its lease ({self.config.ttl_s}s) to expire")
                time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
        except EtcdUnavailable as exc:
            raise ControlPlaneUnavailable(f"cannot register {name!r}: {exc}") from None
        except EtcdError as exc:
            raise ControlPlaneError(f"cannot register {name!r}: {exc}") from None
        with self._mutex:
            self.record, self._lease_ttl = record, ttl
            self._lease_deadline = sent + ttl
            self._lease_lost = self._superseded = self._rewound = False
            self._epoch = epoch
        self._stop.clear()
        self._thread = threading.Thread(target=self._keepalive_loop, name=f"etcd-lease-{name}", daemon=True)
        self._thread.start()
        log.info("registered %s %r incarnation %s under lease %d (TTL %ds)", role, name, record.incarnation, lease, ttl)
        return record

    def _revoke_old(self, old: InstanceRecord) -> None:
        """Revoke our previous lease: every key of the old incarnation goes with it. After a rewind the
        restore may have brought that lease back with stale records under it; if it is gone, fine."""
        try:
            self.client.lease_revoke(old.lease)
        except EtcdError as exc:
            if not self._rewound:
                raise
            log.info("previous lease %d of %r not revoked (%s); it expires", old.lease, old.name, exc)

    def check_rewind(self) -> bool:
        """True if etcd went back in time since our lease was granted (``gateway.Rewind``); the lease is
        then given up (``lease_lost``, ``on_lease_lost`` called once) and ``register`` must run again."""
        record = self.record
        if record is None or self.client.epoch == self._epoch:
            return False
        with self._mutex:
            if self._lease_lost:
                return self._rewound
            self._rewound = True
        self._lose(record, f"etcd went back in time ({self.client.last_rewind})")
        return True

    def _name_holder(self, name: str, old: Optional[InstanceRecord]) -> tuple[Optional[InstanceRecord], int]:
        """(the live instance holding ``name`` that we may not replace, or None; the key's mod revision)."""
        from engine_integration.control_plane.policy import process_gone

        key = self.layout.instance(name)
        _, kvs = self.client.range(key.encode())
        if not kvs:
            return None, 0
        kv = kvs[0]
        try:
            holder = decode_instance(key, kv.value, kv.lease, self.layout, self._key,
                                     allow_unauthenticated=self.config.allow_unauthenticated)
        except RecordRefused as exc:   # not believed by anyone: nothing to take over
            log.warning("registering %r over an instance record that does not verify (%s)", name, exc)
            return None, kv.mod_revision
        if old is not None and holder.incarnation == old.incarnation:
            return None, kv.mod_revision   # our own previous incarnation
        if self.client.lease_ttl(holder.lease) <= 0:
            return None, kv.mod_revision   # its lease is gone: the key goes with it any moment
        if holder.host == socket.gethostname() and process_gone(holder.pid):
            log.warning("%s %r registers again; incarnation %s (pid %d, exited) is replaced: its handoffs are "
                        "treated as dead", holder.role, name, holder.incarnation, holder.pid)
            return None, kv.mod_revision
        return holder, kv.mod_revision

    def _put(self, key: str, body: dict[str, Any], lease: int) -> int:
        """Seal and store ``body``; the store's revision once it is written."""
        revision = self.client.put(key.encode(), encode_record(body, self._key), lease=lease)
        self.counters["puts"] += 1
        return revision

    def _guarded_put(self, key: str, body: dict[str, Any], lease: int, condition: dict[str, Any]) -> Optional[int]:
        """Seal and store ``body`` only if ``condition`` holds (one transaction); the revision, or None.

        A transaction repeated after a lost answer reports failure even when its first attempt
        was applied: the key is read back in the same transaction, and holding exactly the
        value we wrote means it was ours."""
        value = encode_record(body, self._key)
        res = self._txn([condition], [put_op(key.encode(), value, lease)], [range_op(key.encode())])
        if res.succeeded:
            return res.revision
        found = res.kvs(0)
        if res.retried and found and found[0].value == value:
            return found[0].mod_revision
        return None

    def _txn(self, compare: Sequence[dict[str, Any]], success: Sequence[dict[str, Any]],
             failure: Sequence[dict[str, Any]] = ()) -> TxnResult:
        result = self.client.txn(compare, success, failure)
        self.counters["txns"] += 1
        return result

    def _keepalive_loop(self) -> None:
        interval = self.config.keepalive_interval_s or self._lease_ttl / 3.0
        record = self.record
        assert record is not None
        while not self._stop.wait(interval):
            sent = time.monotonic()
            try:   # no longer than one interval: a keepalive stuck on a dead link must not delay the next one
                ttl = self.client.lease_keepalive(record.lease, timeout_s=max(0.5, interval))
                owner = self._own_record(record) if ttl > 0 else None
            except EtcdError as exc:
                self.counters["keepalive_errors"] += 1
                self._last_error = str(exc)
                log.warning("lease %d of %r not renewed (%s); valid locally for %.1fs more", record.lease,
                            record.name, exc, max(0.0, self._lease_deadline - time.monotonic()))
                continue
            self.counters["keepalives"] += 1
            if self.check_rewind():
                return
            if ttl <= 0:
                self._lose(record, "etcd says the lease expired or was revoked")
                return
            with self._mutex:
                self._lease_deadline = sent + ttl
                self._last_error = ""
                if owner is not None and owner.incarnation != record.incarnation and not self._superseded:
                    self._superseded = True
                    log.error("%r was registered again by another process (incarnation %s): this incarnation %s "
                              "is superseded and must stop", record.name, owner.incarnation, record.incarnation)
            if self._superseded:
                self._lose(record, "superseded by a newer incarnation")
                return

    def _own_record(self, record: InstanceRecord) -> Optional[InstanceRecord]:
        """The verified record at our key, after repairing it if it was deleted or overwritten.

        Anyone with the etcd password can delete or rewrite our instance record; until it is
        back the fleet cannot route to us (issue 21, A12). A missing record, or one that does
        not verify as a record of this cluster, is rewritten (ours, under our lease) and
        logged. Only a *verified* record of another incarnation (someone holding the cluster
        key registered our name) supersedes us.
        """
        key = self.layout.instance(record.name)
        _, kvs = self.client.range(key.encode())
        why = "deleted"
        if kvs:
            try:
                found = decode_instance(key, kvs[0].value, kvs[0].lease, self.layout, self._key,
                                        allow_unauthenticated=self.config.allow_unauthenticated)
            except RecordRefused as exc:
                why = f"overwritten with a record that does not verify ({exc})"
            else:
                if found.incarnation == record.incarnation and found.lease == record.lease:
                    return found
                if found.incarnation != record.incarnation:
                    return found   # registered again, by a process holding the cluster key
                why = f"rewritten under lease {found.lease}"
        else:
            why = "deleted"
        if self._guarded_put(key, record.body(), record.lease,
                             if_mod_revision(key.encode(), kvs[0].mod_revision if kvs else 0)) is None:
            return None   # the key changed under us: look again at the next keepalive
        self.counters["repairs"] += 1
        log.warning("the instance record of %s %r incarnation %s was %s: rewritten under our lease %d", record.role,
                    record.name, record.incarnation, why, record.lease)
        return record

    def _lose(self, record: InstanceRecord, why: str) -> None:
        with self._mutex:
            self._lease_lost = True
            self._lease_deadline = 0.0
        log.error("%s %r incarnation %s lost its lease %d: %s", record.role, record.name, record.incarnation,
                  record.lease, why)
        if self.on_lease_lost is not None:
            try:
                self.on_lease_lost(why)
            except Exception:  # a callback bug must not kill the keepalive thread silently
                log.exception("on_lease_lost callback failed")

    @property
    def superseded(self) -> bool:
        """Another process registered our name with the cluster key (never re-register over it)."""
        return self._superseded

    @property
    def lease_lost(self) -> bool:
        return self._lease_lost

    def lease_valid(self) -> bool:
        """Our lease is confirmed: not lost, renewed within its TTL, and etcd not seen going back in time since
        it was granted (a commit after a rewind would rest on state etcd no longer has)."""
        with self._mutex:
            return (self.record is not None and not self._lease_lost
                    and time.monotonic() < self._lease_deadline and self.client.epoch == self._epoch)

    def _require_lease(self) -> InstanceRecord:
        if self.record is None:
            raise ControlPlaneError("register first")
        if self._lease_lost:
            raise LeaseLost(f"{self.record.name!r} incarnation {self.record.incarnation} lost its lease; "
                            "register again as a new incarnation")
        return self.record

    def deregister(self) -> None:
        record = self.record
        self._stop_keepalive()
        if record is not None and not self._lease_lost:
            try:
                self.client.lease_revoke(record.lease)   # every key under it goes at once
            except EtcdError as exc:
                log.warning("could not revoke lease %d of %r (%s); it expires in %ds", record.lease, record.name,
                            exc, self._lease_ttl)
        with self._mutex:
            self._lease_lost = True

    def _stop_keepalive(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.config.timeout_s + 1.0)

    def close(self) -> None:
        self._stop_keepalive()
        self.client.close()

    # --- reading ----------------------------------------------------------------------------
    def snapshot(self) -> FleetView:
        """One range over our cluster's prefix, every record verified (refused ones listed, never used)."""
        try:
            # handoffs/ .. instances/ only: requests, results and stats (etcd.plane, etcd.client)
            # live beside them and are read by whoever needs them, not by every poll of every instance
            revision, kvs = self.client.range(self.layout.handoffs.encode(),
                                              prefix_end(self.layout.instances.encode()))
        except EtcdUnavailable as exc:
            raise ControlPlaneUnavailable(str(exc)) from None
        except EtcdError as exc:
            raise ControlPlaneError(str(exc)) from None
        if self.check_rewind():   # nothing of what etcd holds now may be acted on by this incarnation
            raise LeaseLost(f"{self.record.name if self.record else '?'!r}: {self.client.last_rewind}; "
                            "register again")
        self.counters["snapshots"] += 1
        instances: dict[str, InstanceRecord] = {}
        raw_handoffs: list[tuple[str, HandoffRecord]] = []
        refused: list[tuple[str, str]] = []
        opts = {"allow_unauthenticated": self.config.allow_unauthenticated}
        for kv in kvs:
            key = kv.key.decode(errors="replace")
            try:
                if key.startswith(self.layout.instances):
                    record = decode_instance(key, kv.value, kv.lease, self.layout, self._key, **opts)
                    instances[record.name] = record
                elif key.startswith(self.layout.handoffs):
                    rec = decode_handoff(key, kv.value, kv.lease, self.layout, self._key, **opts)
                    raw_handoffs.append((key, dataclasses.replace(rec, revision=kv.mod_revision)))
                else:
                    raise RecordRefused("unknown key")
            except RecordRefused as exc:
                refused.append((key, str(exc)))
            except Exception as exc:  # noqa: BLE001 - no stored value may stop a snapshot; refused like the rest
                refused.append((key, f"unreadable: {type(exc).__name__}: {str(exc)[:200]}"))
        self._carry_vanished(instances)
        handoffs: dict[tuple[str, str], HandoffPair] = {}
        for key, rec in raw_handoffs:
            owner = instances.get(rec.owner)
            if owner is None or owner.incarnation != rec.owner_incarnation or owner.lease != rec.lease:
                continue   # its writer is gone or restarted: the record is about to vanish, never act on it
            pair = handoffs.get((rec.source, rec.request_id), HandoffPair())
            handoffs[(rec.source, rec.request_id)] = (HandoffPair(rec, pair.reader) if rec.side == "source"
                                                      else HandoffPair(pair.source, rec))
        for item in refused:   # log and count each refused (key, reason) once, not once per poll
            if item not in self._refused_seen:
                if len(self._refused_seen) > 10_000:
                    self._refused_seen.clear()
                self._refused_seen.add(item)
                self._refused_total += 1
                log.warning("refused etcd record %s: %s", *item)
        return FleetView(revision, instances, handoffs, refused)

    def _carry_vanished(self, instances: dict[str, InstanceRecord]) -> None:
        """Keep live an instance whose record vanished while its lease lives (``instances`` updated).

        An instance's record goes with its lease when it dies or says goodbye; a record that
        is gone (or no longer verifies) while its lease still lives was deleted or rewritten
        by someone else, and its owner rewrites it at its next keepalive (``_own_record``).
        Until then the fleet keeps acting on the record it verified last: its handoffs are
        not declared dead, and no pin is freed for it. One lease lookup per vanished record
        per snapshot, only while it is missing.
        """
        carried = set()
        for name, previous in self._last_instances.items():
            if name in instances:
                continue
            try:
                alive = self.client.lease_ttl(previous.lease) > 0
            except EtcdError:
                alive = False
            if not alive:
                continue
            instances[name] = previous
            carried.add((name, previous.incarnation))
            self.counters["awaiting_repair"] += 1
            if (name, previous.incarnation) not in self._awaiting_repair:
                log.warning("the instance record of %s %r vanished while its lease %d lives (deleted or rewritten "
                            "by someone else): still treated as live until its owner rewrites it",
                            previous.role, name, previous.lease)
        self._awaiting_repair = carried
        self._last_instances = dict(instances)

    def poll_changes(self) -> list[Change]:
        view = self.snapshot()
        changes = diff_views(self._last_view, view)
        self._last_view = view
        return changes

    @property
    def last_view(self) -> Optional[FleetView]:
        return self._last_view

    # --- handoff state ----------------------------------------------------------------------
    def publish_handoff(self, request_id: str, *, reader: str, reader_incarnation: str,
                        descriptor: dict[str, Any]) -> int:
        """Prefill: the handoff's source key, under our lease; the store's revision once written.

        A plain put: repeated, it writes the same value. ``ControlPlaneUnavailable`` means it
        may or may not have been written: the caller must treat the handoff as published."""
        me = self._require_lease()
        rec = HandoffRecord(source=me.name, request_id=check_name("request id", request_id),
                            state=HandoffState.PUBLISHED, owner=me.name, owner_incarnation=me.incarnation,
                            lease=me.lease, source_incarnation=me.incarnation, reader=check_name("reader", reader),
                            reader_incarnation=reader_incarnation, descriptor=dict(descriptor))
        return self._write(self.layout.handoff(me.name, request_id, "source"), rec)

    def set_reader_state(self, source: str, request_id: str, state: HandoffState, *, source_incarnation: str,
                         detail: str = "", source_revision: Optional[int] = None) -> bool:
        """Decode: our side of a handoff. With ``source_revision`` it is written only while the source's key
        is still the one we saw at that revision (one transaction); False if it was not written.

        That guard is what lets a prefill that lost its lease free its pins (``EtcdPlane``): its
        source keys went with the lease, so no reader can write ``PULLING`` for them afterwards,
        and "no reader key" then means "no read in flight"."""
        me = self._require_lease()
        state = HandoffState(state)
        if state.side != "reader":
            raise ValueError(f"{state.value!r} is the source's state; a reader writes reserved/pulling/read_done/failed")
        rec = HandoffRecord(source=check_name("source", source), request_id=check_name("request id", request_id),
                            state=state, owner=me.name, owner_incarnation=me.incarnation, lease=me.lease,
                            source_incarnation=source_incarnation, reader=me.name,
                            reader_incarnation=me.incarnation, detail=detail[:512])
        key = self.layout.handoff(source, request_id, "reader")
        if source_revision is None:
            self._write(key, rec)
            return True
        condition = if_mod_revision(self.layout.handoff(source, request_id, "source").encode(), source_revision)
        return self._guarded(lambda: self._guarded_put(key, rec.body(), rec.lease, condition), rec) is not None

    def _write(self, key: str, rec: HandoffRecord) -> int:
        return self._guarded(lambda: self._put(key, rec.body(), rec.lease), rec)

    def _guarded(self, write: Callable[[], Any], rec: HandoffRecord) -> Any:
        """Run a write under our lease, its failures as the plane's errors (``LeaseLost`` if etcd says the lease is gone)."""
        try:
            return write()
        except EtcdUnavailable as exc:
            raise ControlPlaneUnavailable(f"{rec.state.value} for {rec.source}/{rec.request_id}: {exc}") from None
        except EtcdError as exc:
            if "lease not found" in exc.message:
                assert self.record is not None
                self._lose(self.record, "etcd refused a write under it")
                raise LeaseLost(f"{rec.owner!r}: lease {rec.lease} is gone; register again") from None
            raise ControlPlaneError(str(exc)) from None

    def clear_handoff(self, source: str, request_id: str) -> None:
        """Delete the handoff's keys and the source's claim on the request, in one transaction."""
        prefix = self.layout.handoff_prefix(source, request_id).encode()
        try:
            self._txn([], [delete_op(prefix, prefix_end(prefix)),
                           delete_op(self.layout.claim(source, request_id).encode())])
        except EtcdUnavailable as exc:
            raise ControlPlaneUnavailable(str(exc)) from None
        except EtcdError as exc:
            raise ControlPlaneError(str(exc)) from None

    # --- requests: claimed once ------------------------------------------------------------
    def claim(self, key: str, revision: int, request_id: str) -> bool:
        """Prefill: take the request stored at ``key`` (last written at ``revision``); True if it is ours now.

        One transaction, guarded on that revision: delete the request and write our claim
        (``claims/<me>/<rid>``, under our lease) together. Of concurrent takers at most one
        wins; a claim repeated after a lost answer (the first attempt applied, then the
        connection broke) reads back its own mark and still counts as taken, so a request is
        neither lost nor taken twice. The claim goes with ``clear_handoff`` (or our lease).
        """
        me = self._require_lease()
        mark = f"{me.incarnation}:{revision}".encode()
        claim_key = self.layout.claim(me.name, request_id).encode()
        try:
            res = self._txn([if_mod_revision(key.encode(), revision)],
                            [delete_op(key.encode()), put_op(claim_key, mark, me.lease)], [range_op(claim_key)])
        except EtcdUnavailable as exc:
            raise ControlPlaneUnavailable(str(exc)) from None
        except EtcdError as exc:
            if "lease not found" in exc.message:
                self._lose(me, "etcd refused a claim under it")
                raise LeaseLost(f"{me.name!r}: lease {me.lease} is gone; register again") from None
            raise ControlPlaneError(str(exc)) from None
        if res.succeeded:
            return True
        found = res.kvs(0)
        return bool(res.retried and found and found[0].value == mark)

    def release_claim(self, request_id: str) -> None:
        """Prefill: drop our claim on a request that ended here without a handoff (refused, failed)."""
        if self.record is None:
            return
        try:
            self.client.delete(self.layout.claim(self.record.name, request_id).encode())
        except EtcdError as exc:
            log.debug("claim of %s not released (%s); it goes with our lease", request_id, exc)

    # --- records beside the fleet's (requests, results, stats: etcd.plane, etcd.client) ----
    @property
    def cluster_key(self) -> Optional[bytes]:
        return self._key

    def put_record(self, key: str, body: dict[str, Any], lease: int) -> int:
        """Seal (sign) ``body`` and store it at ``key`` under ``lease``; its revision. ``LeaseGone`` if that
        lease no longer exists."""
        return self._record_write(key, lambda: self._put(key, body, lease), lease)

    def create_record(self, key: str, body: dict[str, Any], lease: int) -> Optional[int]:
        """Store ``body`` at ``key`` only if ``key`` does not exist (one transaction); its revision, or None.

        What makes a request's result written once per attempt: the decode's commit and the
        client's abandonment of an attempt both create the result, and only one can."""
        return self._record_write(key, lambda: self._guarded_put(key, body, lease, if_absent(key.encode())), lease)

    def update_record(self, key: str, body: dict[str, Any], lease: int, revision: int) -> Optional[int]:
        """Store ``body`` at ``key`` only if ``key`` is still at ``revision`` (what we wrote last); revision or None."""
        return self._record_write(key, lambda: self._guarded_put(key, body, lease, if_mod_revision(key.encode(),
                                                                                                  revision)), lease)

    def _record_write(self, key: str, write: Callable[[], Any], lease: int) -> Any:
        try:
            return write()
        except EtcdUnavailable as exc:
            raise ControlPlaneUnavailable(f"put {key}: {exc}") from None
        except EtcdError as exc:
            if "lease not found" in exc.message:
                raise LeaseGone(f"put {key}: lease {lease} is gone") from None
            raise ControlPlaneError(str(exc)) from None

    def read(self, key: str) -> Optional[KV]:
        """The value at ``key`` (unverified), or None."""
        try:
            _, kvs = self.client.range(key.encode())
        except EtcdUnavailable as exc:
            raise ControlPlaneUnavailable(str(exc)) from None
        except EtcdError as exc:
            raise ControlPlaneError(str(exc)) from None
        return kvs[0] if kvs else None

    def range_raw(self, prefix: str) -> list[KV]:
        """Every stored value under ``prefix``, unverified (the caller verifies each)."""
        try:
            return self.client.range_prefix(prefix.encode())[1]
        except EtcdUnavailable as exc:
            raise ControlPlaneUnavailable(str(exc)) from None
        except EtcdError as exc:
            raise ControlPlaneError(str(exc)) from None

    def delete(self, key: str) -> None:
        try:
            self.client.delete(key.encode())
        except EtcdError as exc:
            raise ControlPlaneError(str(exc)) from None

    # --- health -----------------------------------------------------------------------------
    def health(self) -> Health:
        endpoint = ",".join(self.config.endpoints)
        record = self.record
        version, ok, detail = "", True, ""
        try:
            health = self.client.get("/health")
            ok = str(health.get("health")) == "true"
            detail = "" if ok else f"etcd unhealthy: {health.get('reason') or health}"
            version = str(self.client.status().get("version", ""))
        except EtcdError as exc:
            ok, detail = False, str(exc)
        with self._mutex:
            remaining = max(0.0, self._lease_deadline - time.monotonic()) if record else 0.0
            lost, superseded = self._lease_lost, self._superseded
        if record is not None and (lost or remaining <= 0):
            ok = False
            detail = detail or ("lease lost" if lost else f"lease not renewed: {self._last_error}")
        return Health(backend=self.backend, endpoint=endpoint, ok=ok, detail=detail, server_version=version,
                      name=record.name if record else "", incarnation=record.incarnation if record else "",
                      lease_id=record.lease if record else 0, lease_ttl_s=float(self._lease_ttl),
                      lease_remaining_s=remaining, lease_lost=lost, superseded=superseded,
                      refused_records=self._refused_total,
                      counters=dict(self.counters, reconnects=self.client.reconnects, failovers=self.client.failovers,
                                    retried_calls=self.client.retried_calls,
                                    unavailable_answers=self.client.unavailable_answers,
                                    token_drops=self.client.token_drops, rewinds=self.client.epoch))
