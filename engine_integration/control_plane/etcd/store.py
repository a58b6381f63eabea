"""The fleet's state in etcd: this instance's lease, its records, the verified snapshot.

``EtcdStore`` is what an etcd-plane process holds: registration under a lease (a
restart under the same name is a new incarnation, with fresh metas, never the old ones),
a verified ``FleetView`` per ``snapshot``, each side's handoff key written under its own
lease (``publish_handoff`` / ``set_reader_state``), ``clear_handoff``, and the
request/result/stats keys beside them (``put_record``, ``range_raw``, ``take``). The engine
logic on top is ``etcd.plane.EtcdPlane``; clients use ``etcd.client``.

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

Polling rather than etcd's streaming watch: one range per poll is simple, stateless
and self-healing across reconnects and compactions (a watch must resume from a
revision and handle compaction); the cost is one small request per poll per process.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence
from urllib.parse import parse_qs, urlsplit

from engine_integration.control_plane.base import ControlPlaneError, ControlPlaneUnavailable, Health
from engine_integration.control_plane.etcd.gateway import KV, EtcdError, EtcdHttpClient, EtcdUnavailable, prefix_end
from engine_integration.control_plane.etcd.records import (MAX_RECORD_BYTES, ROLES, Change, FleetView, HandoffPair,
                                                           HandoffRecord, HandoffState, InstanceRecord, KeyLayout,
                                                           RecordRefused, check_name, decode_handoff,
                                                           decode_instance, diff_views, encode_record)
from engine_integration.control_plane.limits import check_json

log = logging.getLogger("kvxfer.engine.control_plane.etcd")


class LeaseLost(ControlPlaneError):
    """This instance's lease expired (or was revoked): it is dead to the fleet and must
    re-register as a new incarnation; nothing it holds under the old lease may be trusted."""


class LeaseGone(ControlPlaneError):
    """A put under someone else's lease (a client's) failed because that lease no longer exists."""

#: environment variable naming a file that holds the etcd user's password (never in argv or URLs)
PASSWORD_FILE_ENV = "KVXFER_ETCD_PASSWORD_FILE"


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


def parse_etcd_url(url: str, **overrides: Any) -> EtcdConfig:
    """``etcd://[user@]host:port[,host:port...][/cluster][?ttl=5&poll=0.25]`` -> ``EtcdConfig``.

    A password in the URL is refused (URLs end up in argv and logs): use
    ``password_file`` or ``$KVXFER_ETCD_PASSWORD_FILE``.
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
    if "ttl" in query:
        kwargs["ttl_s"] = int(query["ttl"])
    if "poll" in query:
        kwargs["poll_interval_s"] = float(query["poll"])
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
    from kvxfer.security.meta_seal import meta_key_from_env

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
                                     timeout_s=config.timeout_s)
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
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._mutex = threading.Lock()
        self.counters: dict[str, int] = {"puts": 0, "snapshots": 0, "keepalives": 0, "keepalive_errors": 0,
                                         "repairs": 0, "awaiting_repair": 0}
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
        """
        check_name("instance name", name)
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self._stop_keepalive()
        old = self.record
        try:
            if old is not None and not self._lease_lost:
                self.client.lease_revoke(old.lease)
            sent = time.monotonic()
            lease, ttl = self.client.lease_grant(self.config.ttl_s)
            record = InstanceRecord(name=name, role=role, incarnation=uuid.uuid4().hex[:16], lease=lease,
                                    host=socket.gethostname(), pid=os.getpid(), capacity_blocks=int(capacity_blocks),
                                    transfer_meta=tuple(dict(m) for m in transfer_meta), started_at=time.time(),
                                    extra=dict(extra or {}))
            previous = self._instance_at(name)
            self._put(self.layout.instance(name), record.body(), lease)
        except EtcdUnavailable as exc:
            raise ControlPlaneUnavailable(f"cannot register {name!r}: {exc}") from None
        except EtcdError as exc:
            raise ControlPlaneError(f"cannot register {name!r}: {exc}") from None
        if previous is not None:
            log.warning("%s %r registered as incarnation %s; it replaces incarnation %s (lease %d): that one's "
                        "handoffs are treated as dead", role, name, record.incarnation, previous[0], previous[1])
        with self._mutex:
            self.record, self._lease_ttl = record, ttl
            self._lease_deadline = sent + ttl
            self._lease_lost = self._superseded = False
        self._stop.clear()
        self._thread = threading.Thread(target=self._keepalive_loop, name=f"etcd-lease-{name}", daemon=True)
        self._thread.start()
        log.info("registered %s %r incarnation %s under lease %d (TTL %ds)", role, name, record.incarnation, lease, ttl)
        return record

    def _instance_at(self, name: str) -> Optional[tuple[str, int]]:
        """(incarnation, lease) of whatever is registered under ``name`` now, unverified (for the log line)."""
        import json

        _, kvs = self.client.range(self.layout.instance(name).encode())
        if not kvs:
            return None
        try:
            return str(json.loads(check_json(kvs[0].value, max_bytes=MAX_RECORD_BYTES)).get("incarnation")), kvs[0].lease
        except (ValueError, AttributeError, RecursionError):   # TooDeep is a ValueError
            return "?", kvs[0].lease

    def _put(self, key: str, body: dict[str, Any], lease: int) -> int:
        """Seal and store ``body``; the store's revision once it is written."""
        revision = self.client.put(key.encode(), encode_record(body, self._key), lease=lease)
        self.counters["puts"] += 1
        return revision

    def _keepalive_loop(self) -> None:
        interval = self.config.keepalive_interval_s or self._lease_ttl / 3.0
        record = self.record
        assert record is not None
        while not self._stop.wait(interval):
            sent = time.monotonic()
            try:
                ttl = self.client.lease_keepalive(record.lease)
                owner = self._own_record(record) if ttl > 0 else None
            except EtcdError as exc:
                self.counters["keepalive_errors"] += 1
                self._last_error = str(exc)
                log.warning("lease %d of %r not renewed (%s); valid locally for %.1fs more", record.lease,
                            record.name, exc, max(0.0, self._lease_deadline - time.monotonic()))
                continue
            self.counters["keepalives"] += 1
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
        self._put(key, record.body(), record.lease)
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

    def lease_valid(self) -> bool:
        with self._mutex:
            return (self.record is not None and not self._lease_lost
                    and time.monotonic() < self._lease_deadline)

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
                    raw_handoffs.append((key, decode_handoff(key, kv.value, kv.lease, self.layout, self._key, **opts)))
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
        """Prefill: the handoff's source key, under our lease; the store's revision once written."""
        me = self._require_lease()
        rec = HandoffRecord(source=me.name, request_id=check_name("request id", request_id),
                            state=HandoffState.PUBLISHED, owner=me.name, owner_incarnation=me.incarnation,
                            lease=me.lease, source_incarnation=me.incarnation, reader=check_name("reader", reader),
                            reader_incarnation=reader_incarnation, descriptor=dict(descriptor))
        return self._write(self.layout.handoff(me.name, request_id, "source"), rec)

    def set_reader_state(self, source: str, request_id: str, state: HandoffState, *, source_incarnation: str,
                         detail: str = "") -> None:
        me = self._require_lease()
        state = HandoffState(state)
        if state.side != "reader":
            raise ValueError(f"{state.value!r} is the source's state; a reader writes reserved/pulling/read_done/failed")
        rec = HandoffRecord(source=check_name("source", source), request_id=check_name("request id", request_id),
                            state=state, owner=me.name, owner_incarnation=me.incarnation, lease=me.lease,
                            source_incarnation=source_incarnation, reader=me.name,
                            reader_incarnation=me.incarnation, detail=detail[:512])
        self._write(self.layout.handoff(source, request_id, "reader"), rec)

    def _write(self, key: str, rec: HandoffRecord) -> int:
        try:
            return self._put(key, rec.body(), rec.lease)
        except EtcdUnavailable as exc:
            raise ControlPlaneUnavailable(f"{rec.state.value} for {rec.source}/{rec.request_id}: {exc}") from None
        except EtcdError as exc:
            if "lease not found" in exc.message:
                assert self.record is not None
                self._lose(self.record, "etcd refused a write under it")
                raise LeaseLost(f"{rec.owner!r}: lease {rec.lease} is gone; register again") from None
            raise ControlPlaneError(str(exc)) from None

    def clear_handoff(self, source: str, request_id: str) -> None:
        try:
            self.client.delete_prefix(self.layout.handoff_prefix(source, request_id).encode())
        except EtcdUnavailable as exc:
            raise ControlPlaneUnavailable(str(exc)) from None
        except EtcdError as exc:
            raise ControlPlaneError(str(exc)) from None

    # --- records beside the fleet's (requests, results, stats: etcd.plane, etcd.client) ----
    @property
    def cluster_key(self) -> Optional[bytes]:
        return self._key

    def put_record(self, key: str, body: dict[str, Any], lease: int) -> None:
        """Seal (sign) ``body`` and store it at ``key`` under ``lease``; ``LeaseGone`` if that lease no longer exists."""
        try:
            self._put(key, body, lease)
        except EtcdUnavailable as exc:
            raise ControlPlaneUnavailable(f"put {key}: {exc}") from None
        except EtcdError as exc:
            if "lease not found" in exc.message:
                raise LeaseGone(f"put {key}: lease {lease} is gone") from None
            raise ControlPlaneError(str(exc)) from None

    def range_raw(self, prefix: str) -> list[KV]:
        """Every stored value under ``prefix``, unverified (the caller verifies each)."""
        try:
            return self.client.range_prefix(prefix.encode())[1]
        except EtcdUnavailable as exc:
            raise ControlPlaneUnavailable(str(exc)) from None
        except EtcdError as exc:
            raise ControlPlaneError(str(exc)) from None

    def take(self, key: str) -> Optional[KV]:
        """Delete ``key`` and return what it held, or None if it was gone: one atomic claim (at most one taker)."""
        try:
            return self.client.take(key.encode())
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
                      counters=dict(self.counters, reconnects=self.client.reconnects))
