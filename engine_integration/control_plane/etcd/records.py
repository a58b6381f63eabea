"""Records the fleet keeps in its store, their key layout, signing and verification.

Key layout (``<root>`` is ``/kvxfer/<cluster>``; names and request ids are ``[A-Za-z0-9._-]``)::

    <root>/instances/<name>                       InstanceRecord, lease = that instance's
    <root>/handoffs/<source>/<request_id>/source  HandoffRecord (published), lease = the prefill's
    <root>/handoffs/<source>/<request_id>/reader  HandoffRecord (reserved..failed), lease = the decode's
    <root>/claims/<prefill>/<request_id>          a prefill's mark on a request it took, lease = the prefill's

Why each piece:

- One key per instance, keyed by its *name*: a restart under the same name overwrites
  it with a new incarnation and a new lease, so the old lease's later expiry cannot
  delete the new record, and readers see the incarnation change at once.
- Each side of a handoff writes only its own key, under its own lease: a dead decode's
  reservation vanishes with its lease (the prefill may then free pins), a dead prefill's
  publication vanishes with its lease (the decode fails the pull before its timeout).
- Everything is under one prefix per handoff so the source clears it in one delete.

Nothing a writer without the cluster key stores is acted on: every record is sealed and
signed (``kvxfer.meta.seal``, under a key derived from the cluster key for
records, so a record and a transport meta never verify as each other), names its own key
path and the lease it was written under (a record copied to another key, or replayed
under another lease, fails), and every transfer meta inside an instance record is
checked with ``check_meta_seal`` against the cluster key as well. A handoff record is
believed only while its writer is a live instance whose lease it carries. Without a
cluster key records are sealed unsigned and accepted only from this host (the same rule
as unsigned metas), unless unauthenticated records are allowed by name.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from engine_integration.control_plane.limits import TooDeep, check_json
from kvxfer.errors import PeerMetadataError
from kvxfer.meta.seal import HOST_FIELD, check_meta_seal, host_identity, seal_meta

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


class HandoffState(str, enum.Enum):
    """A handoff's states; ``PUBLISHED`` is the source's, the rest are the reader's."""

    PUBLISHED = "published"   #: source: blocks pinned, descriptor routed to one reader
    RESERVED = "reserved"     #: reader: destination blocks reserved, no read posted yet
    PULLING = "pulling"       #: reader: one-sided reads may be in flight (written *before* posting)
    READ_DONE = "read_done"   #: reader: every read completed; the source may unpin
    FAILED = "failed"         #: reader: the pull failed and no read can still be in flight

    @property
    def side(self) -> str:
        return "source" if self is HandoffState.PUBLISHED else "reader"

    @property
    def terminal(self) -> bool:
        return self in (HandoffState.READ_DONE, HandoffState.FAILED)


@dataclass(frozen=True)
class Change:
    """One difference between two consecutive snapshots (``EtcdStore.poll_changes``)."""

    kind: str                 #: ``instance_up``, ``instance_down``, ``handoff``, ``handoff_gone``
    name: str                 #: instance name, or ``source/request_id`` for handoffs
    record: Any = None        #: the new record (``InstanceRecord`` / ``HandoffPair``), the old one when gone
    reason: str = ""          #: for ``instance_down``: ``lease expired or deregistered`` / ``restarted``
INSTANCE_KIND = "kvxfer/instance/1"
HANDOFF_KIND = "kvxfer/handoff/1"
GENERATIONS_META_KEY = "generations"     # same as engine_integration.descriptor (kept import-free of torch)
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
#: The largest value read as a record (etcd's own request limit is 1.5 MiB): bigger is refused unread.
MAX_RECORD_BYTES = 1 << 20


def check_name(what: str, value: str) -> str:
    """``value`` if it is a safe key segment; else ``ValueError`` naming ``what``."""
    if not isinstance(value, str) or not _NAME.match(value) or value in (".", ".."):
        raise ValueError(f"{what} must be 1-128 characters of [A-Za-z0-9._-], got {value!r}")
    return value


def record_key(cluster_key: Optional[bytes]) -> Optional[bytes]:
    """The key records are signed with: derived from the cluster key, distinct from the metas' key."""
    if cluster_key is None:
        return None
    return hmac.new(cluster_key, b"kvxfer/etcd-record", hashlib.sha256).digest()


@dataclass(frozen=True)
class KeyLayout:
    """Where each record lives under ``/kvxfer/<cluster>``."""

    cluster: str = "default"

    def __post_init__(self) -> None:
        check_name("cluster", self.cluster)

    @property
    def root(self) -> str:
        return f"/kvxfer/{self.cluster}/"

    @property
    def instances(self) -> str:
        return self.root + "instances/"

    @property
    def handoffs(self) -> str:
        return self.root + "handoffs/"

    def instance(self, name: str) -> str:
        return self.instances + check_name("instance name", name)

    @property
    def requests(self) -> str:
        return self.root + "requests/"

    @property
    def results(self) -> str:
        return self.root + "results/"

    @property
    def stats(self) -> str:
        return self.root + "stats/"

    def request(self, prefill: str, request_id: str) -> str:
        """A client's request routed to ``prefill`` (under the client's lease; the prefill takes it once)."""
        return f"{self.requests}{check_name('prefill', prefill)}/{check_name('request id', request_id)}"

    def result(self, client: str, request_id: str) -> str:
        """A request's progress and outcome for its client (always under the client's lease)."""
        return f"{self.results}{check_name('client', client)}/{check_name('request id', request_id)}"

    def stat(self, name: str) -> str:
        """An engine's load figures (pins, queue, running), under its own lease."""
        return self.stats + check_name("instance name", name)

    @property
    def claims(self) -> str:
        return self.root + "claims/"

    def claim(self, prefill: str, request_id: str) -> str:
        """A prefill's mark on a request it took (under its own lease): what a repeated claim reads back."""
        return f"{self.claims}{check_name('prefill', prefill)}/{check_name('request id', request_id)}"

    def handoff_prefix(self, source: str, request_id: str) -> str:
        return f"{self.handoffs}{check_name('source', source)}/{check_name('request id', request_id)}/"

    def handoff(self, source: str, request_id: str, side: str) -> str:
        if side not in ("source", "reader"):
            raise ValueError(f"side must be 'source' or 'reader', got {side!r}")
        return self.handoff_prefix(source, request_id) + side

    def parse_handoff(self, key: str) -> Optional[tuple[str, str, str]]:
        """(source, request_id, side) of a handoff key, or None if it is not one."""
        if not key.startswith(self.handoffs):
            return None
        parts = key[len(self.handoffs):].split("/")
        if len(parts) != 3 or parts[2] not in ("source", "reader"):
            return None
        return parts[0], parts[1], parts[2]


@dataclass(frozen=True)
class InstanceRecord:
    """One live instance: who, which incarnation, and its verified transfer metas."""

    name: str
    role: str
    incarnation: str
    lease: int
    host: str
    pid: int
    capacity_blocks: int
    transfer_meta: tuple[dict[str, Any], ...]
    started_at: float
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"kind": INSTANCE_KIND, "name": self.name, "role": self.role, "incarnation": self.incarnation,
                "lease": str(self.lease), "host": self.host, "pid": self.pid,
                "capacity_blocks": self.capacity_blocks, "transfer_meta": [dict(m) for m in self.transfer_meta],
                "started_at": self.started_at, "extra": dict(self.extra)}


@dataclass(frozen=True)
class HandoffRecord:
    """One side's state of one handoff."""

    source: str
    request_id: str
    state: HandoffState
    owner: str                     #: the writer: the source for PUBLISHED, the reader otherwise
    owner_incarnation: str
    lease: int
    source_incarnation: str
    reader: str
    reader_incarnation: str
    descriptor: Optional[dict[str, Any]] = None   #: source side only
    detail: str = ""
    revision: int = 0              #: the store's revision of this record (set by a snapshot; not stored)

    @property
    def side(self) -> str:
        return self.state.side

    def body(self) -> dict[str, Any]:
        return {"kind": HANDOFF_KIND, "source": self.source, "request_id": self.request_id,
                "state": self.state.value, "owner": self.owner, "owner_incarnation": self.owner_incarnation,
                "lease": str(self.lease), "source_incarnation": self.source_incarnation, "reader": self.reader,
                "reader_incarnation": self.reader_incarnation, "descriptor": self.descriptor, "detail": self.detail}


def encode_record(body: dict[str, Any], cluster_key: Optional[bytes]) -> bytes:
    """Seal (and with a cluster key sign) a record body; the stored value."""
    sealed = dict(body)
    sealed[HOST_FIELD] = host_identity()
    seal_meta(sealed, record_key(cluster_key))
    return json.dumps(sealed, sort_keys=True, separators=(",", ":")).encode()


class RecordRefused(ValueError):
    """A stored value that failed verification: logged, counted, never acted on."""


def refusing(decode: Callable[..., Any]) -> Callable[..., Any]:
    """Make every way ``decode`` can fail on a stored value a ``RecordRefused``.

    A record signed with the cluster key may still carry fields that are not what its kind
    says (a name that is no key segment, a prompt of strings): the check that finds it
    raises ``ValueError`` or ``TypeError``, and a caller that refuses only ``RecordRefused``
    would die of it (issue 21, A13).
    """
    @functools.wraps(decode)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return decode(*args, **kwargs)
        except RecordRefused:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            raise RecordRefused(f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return wrapper


def _load(value: bytes, cluster_key: Optional[bytes], allow_unauthenticated: bool) -> dict[str, Any]:
    """The verified body of a stored value. Size and nesting depth are bounded before it is parsed
    (``control_plane.limits``): anyone with the etcd password can write any value."""
    try:
        raw = json.loads(check_json(value, max_bytes=MAX_RECORD_BYTES, what="record"))
    except TooDeep as exc:
        raise RecordRefused(str(exc)) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise RecordRefused(f"not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(raw, dict):
        raise RecordRefused(f"a record is a JSON object, not {type(raw).__name__}")
    try:
        return check_meta_seal(raw, record_key(cluster_key), allow_unauthenticated=allow_unauthenticated)
    except PeerMetadataError as exc:
        raise RecordRefused(str(exc)) from None


def _field(view: Mapping[str, Any], name: str, kind: Any) -> Any:
    value = view.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        wanted = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
        raise RecordRefused(f"field {name!r} must be {wanted}, got {type(value).__name__}")
    return value


def _lease_matches(view: Mapping[str, Any], lease: int) -> None:
    if lease == 0 or str(lease) != view.get("lease"):
        raise RecordRefused(f"written under lease {lease}, signed for lease {view.get('lease')!r} (replayed?)")


@refusing
def decode_instance(key: str, value: bytes, lease: int, layout: KeyLayout, cluster_key: Optional[bytes], *,
                    allow_unauthenticated: bool = False) -> InstanceRecord:
    """Verify and parse an instance record stored at ``key`` under ``lease``; ``RecordRefused`` if anything is off."""
    view = _load(value, cluster_key, allow_unauthenticated)
    if view.get("kind") != INSTANCE_KIND:
        raise RecordRefused(f"kind {view.get('kind')!r} is not {INSTANCE_KIND!r}")
    name = _field(view, "name", str)
    if key != layout.instances + name:
        raise RecordRefused(f"record names instance {name!r} but is stored at {key!r}")
    _lease_matches(view, lease)
    role = _field(view, "role", str)
    if role not in ROLES:
        raise RecordRefused(f"role {role!r} is not one of {ROLES}")
    metas = _field(view, "transfer_meta", list)
    for i, meta in enumerate(metas):
        if not isinstance(meta, dict):
            raise RecordRefused(f"transfer_meta[{i}] is not a dict")
        try:   # the transport metas carry their exporter's seal: check them with the cluster key itself
            check_meta_seal({k: v for k, v in meta.items() if k != GENERATIONS_META_KEY}, cluster_key,
                            allow_unauthenticated=allow_unauthenticated)
            if meta.get(GENERATIONS_META_KEY) is not None:
                check_meta_seal(meta[GENERATIONS_META_KEY], cluster_key, allow_unauthenticated=allow_unauthenticated)
        except PeerMetadataError as exc:
            raise RecordRefused(f"transfer_meta[{i}]: {exc}") from None
    return InstanceRecord(name=name, role=role, incarnation=_field(view, "incarnation", str), lease=lease,
                          host=_field(view, "host", str), pid=_field(view, "pid", int),
                          capacity_blocks=_field(view, "capacity_blocks", int), transfer_meta=tuple(metas),
                          started_at=float(_field(view, "started_at", (int, float))),
                          extra=_field(view, "extra", dict))


@refusing
def decode_handoff(key: str, value: bytes, lease: int, layout: KeyLayout, cluster_key: Optional[bytes], *,
                   allow_unauthenticated: bool = False) -> HandoffRecord:
    """Verify and parse one side's handoff record; ``RecordRefused`` if anything is off."""
    where = layout.parse_handoff(key)
    if where is None:
        raise RecordRefused(f"{key!r} is not a handoff key")
    view = _load(value, cluster_key, allow_unauthenticated)
    if view.get("kind") != HANDOFF_KIND:
        raise RecordRefused(f"kind {view.get('kind')!r} is not {HANDOFF_KIND!r}")
    try:
        state = HandoffState(view.get("state"))
    except ValueError:
        raise RecordRefused(f"unknown state {view.get('state')!r}") from None
    record = HandoffRecord(
        source=_field(view, "source", str), request_id=_field(view, "request_id", str), state=state,
        owner=_field(view, "owner", str), owner_incarnation=_field(view, "owner_incarnation", str), lease=lease,
        source_incarnation=_field(view, "source_incarnation", str), reader=_field(view, "reader", str),
        reader_incarnation=_field(view, "reader_incarnation", str), descriptor=view.get("descriptor"),
        detail=_field(view, "detail", str))
    if (record.source, record.request_id, state.side) != where:
        raise RecordRefused(f"record for {record.source}/{record.request_id} ({state.side}) stored at {key!r}")
    expected_owner = record.source if state.side == "source" else record.reader
    if record.owner != expected_owner:
        raise RecordRefused(f"{state.side} record written by {record.owner!r}, not {expected_owner!r}")
    _lease_matches(view, lease)
    return record


@dataclass(frozen=True)
class HandoffPair:
    """Both sides of one handoff as seen in one snapshot (either may be missing)."""

    source: Optional[HandoffRecord] = None
    reader: Optional[HandoffRecord] = None


@dataclass(frozen=True)
class Verdict:
    """What one side should do about one handoff now."""

    source: str
    request_id: str
    action: str      #: source: ``read_done``/``failed``/``reader_dead``; reader: ``start``/``source_gone``/
                     #: ``source_missing`` (key deleted while the source lives)/``cleanup``
    detail: str = ""
    record: Optional[HandoffRecord] = None


@dataclass
class FleetView:
    """A verified snapshot of the fleet at one store revision, with the per-side decisions.

    The decisions are pure functions of the snapshot, so whoever restarts (or any
    process reading the store) reaches the same ones: no kvxfer process holds state.
    """

    revision: int
    instances: dict[str, InstanceRecord]
    handoffs: dict[tuple[str, str], HandoffPair]
    refused: list[tuple[str, str]] = field(default_factory=list)   #: (key, reason)

    def live(self, role: Optional[str] = None) -> list[InstanceRecord]:
        return sorted((r for r in self.instances.values() if role is None or r.role == role), key=lambda r: r.name)

    def is_live(self, name: str, incarnation: str) -> bool:
        record = self.instances.get(name)
        return record is not None and record.incarnation == incarnation

    def source_verdicts(self, name: str, incarnation: str) -> list[Verdict]:
        """Prefill ``name``: the handoffs it published whose pins it may now release, and why."""
        out = []
        for (source, rid), pair in sorted(self.handoffs.items()):
            pub = pair.source
            if source != name or pub is None or pub.owner_incarnation != incarnation:
                continue
            reader = pair.reader
            if reader is not None and reader.reader_incarnation == pub.reader_incarnation \
                    and reader.source_incarnation == incarnation:
                if reader.state is HandoffState.READ_DONE:
                    out.append(Verdict(source, rid, "read_done", record=reader))
                    continue
                if reader.state is HandoffState.FAILED:
                    out.append(Verdict(source, rid, "failed", reader.detail, record=reader))
                    continue
            if not self.is_live(pub.reader, pub.reader_incarnation):
                now = self.instances.get(pub.reader)
                why = (f"reader {pub.reader!r} restarted (incarnation {pub.reader_incarnation} -> {now.incarnation})"
                       if now is not None else f"reader {pub.reader!r} lease expired or deregistered")
                out.append(Verdict(source, rid, "reader_dead", why, record=pub))
        return out

    def reader_verdicts(self, name: str, incarnation: str) -> list[Verdict]:
        """Decode ``name``: handoffs routed to it to start, and its pulls whose source is gone."""
        out = []
        for (source, rid), pair in sorted(self.handoffs.items()):
            pub, mine = pair.source, pair.reader
            if mine is not None and (mine.owner != name or mine.owner_incarnation != incarnation):
                mine = None
            source_alive = pub is not None and self.is_live(source, pub.owner_incarnation)
            if mine is None:
                if source_alive and pub.reader == name and pub.reader_incarnation == incarnation:  # type: ignore[union-attr]
                    out.append(Verdict(source, rid, "start", record=pub))
                continue
            now = self.instances.get(source)
            if pub is None and now is not None and now.incarnation == mine.source_incarnation:
                # the source lives, and it clears a handoff's two keys in one transaction, never its own alone:
                # its key was deleted by someone else. It restores it at its next poll, then acts on our state
                # (a terminal one frees its pins); meanwhile a pull goes on and a finished read is kept
                out.append(Verdict(source, rid, "source_missing", f"the source key of {source}/{rid} is gone "
                                   f"while {source!r} lives", record=mine))
                continue
            if mine.state.terminal:
                if pub is None or pub.owner_incarnation != mine.source_incarnation:
                    out.append(Verdict(source, rid, "cleanup", "source acted or is gone", record=mine))
                continue
            if not source_alive or pub.owner_incarnation != mine.source_incarnation:  # type: ignore[union-attr]
                why = (f"source {source!r} restarted" if now is not None and now.incarnation != mine.source_incarnation
                       else f"source {source!r} lease expired or deregistered" if now is None
                       else f"source {source!r} withdrew the handoff")
                out.append(Verdict(source, rid, "source_gone", why, record=mine))
        return out


def diff_views(old: Optional[FleetView], new: FleetView) -> list[Change]:
    """Changes from ``old`` to ``new``, instances first, in name order."""
    before_i = old.instances if old is not None else {}
    before_h = old.handoffs if old is not None else {}
    changes: list[Change] = []
    for name in sorted(set(before_i) | set(new.instances)):
        was, now = before_i.get(name), new.instances.get(name)
        if was is not None and (now is None or now.incarnation != was.incarnation):
            changes.append(Change("instance_down", name, was,
                                  "restarted" if now is not None else "lease expired or deregistered"))
        if now is not None and (was is None or now.incarnation != was.incarnation):
            changes.append(Change("instance_up", name, now))
    for key in sorted(set(before_h) | set(new.handoffs)):
        was, now = before_h.get(key), new.handoffs.get(key)
        label = f"{key[0]}/{key[1]}"
        if now is None:
            changes.append(Change("handoff_gone", label, was))
        elif was != now:
            changes.append(Change("handoff", label, now))
    return changes
