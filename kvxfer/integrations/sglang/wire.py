"""kvxfer's messages on SGLang's per-rank ZMQ sockets (each manager's PULL ``rank_port``).

SGLang's backends push: the decode sends its destination pages and the prefill writes them.
kvxfer pulls, so the flow is turned around on the same sockets, with tagged frames SGLang's
own messages never start with:

======================  =================  ===============================================================
tag                     direction          body (JSON)
======================  =================  ===============================================================
``KVXFER_REG``          decode -> prefill  the decode's endpoint and layout (SGLang's receiver registration)
``KVXFER_HELLO``        prefill -> decode  the prefill's kvxfer metas (pool, aux, state, lease table) and
                                           layout, or the reason it refused the decode's layout
``KVXFER_META``         decode -> prefill  one room: the decode's endpoint, how many decode ranks read the
                                           room from this prefill rank (``readers``), whether this one
                                           is SGLang's dummy pairing (``dummy``: it reads nothing here)
``KVXFER_CHUNK``        prefill -> decode  chunk n (0, 1, ... in the order sent) is ready: source pages,
                                           where they go, lease slot and lease
``KVXFER_FAILED``       decode -> prefill  a room's pull failed or was aborted, and no read of it is in
                                           flight: the room, its lease (None if no chunk came), the
                                           sender's endpoint; or (``chunk`` set) the answer to a chunk the
                                           decode holds no live request for, naming that chunk
``KVXFER_REVOKED``      prefill -> decode  the prefill failed a room and revoked its lease (a chunk it
                                           could not send, a bound passed, an abort): the room, its lease
                                           (None if it had none), the prefill's endpoint, the reason
======================  =================  ===============================================================

Both failure reports are bound to the room's peer: the prefill takes a FAILED only from the room's
decode endpoint with the room's lease (a lease-less one while the room has no lease), the decode takes
a REVOKED only from the room's prefill with the room's lease (or while it holds none); anything
else is dropped and counted. So a frame replayed to another rank (which answers for a room it does not
hold) cannot end a live room. A room's own chunk replayed to its decode after the decode's Success (before the
prefill took the read-done) must not end it either (issue 49): the decode drops a chunk of a room it read whole,
answers one of a room it gave up with a FAILED (its failure report), and one of a room it never held (or no
longer remembers) with a FAILED that names the chunk (``chunk``), which the prefill never takes as the room's
failure. SGLang's own status message is not used: it names no
peer and no lease.

SGLang's sockets carry no authentication. With the cluster key (``KVXFER_SECRET_FILE``) every
kvxfer frame gets one more part: an HMAC-SHA256 over its parts under a key derived for these frames
(``FrameKey``), checked before anything is parsed; without the key they go unsigned, as SGLang's own,
and the lease a chunk names is a random 63-bit value a stranger cannot guess. Signed frames are not
replay-proof: each names its room, its peer and (where it matters) its lease, so a replayed one is stale
or foreign.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from typing import Annotated, Any, Optional

import msgspec

from kvxfer.integrations.sglang.tp import MAX_READERS

REG = b"KVXFER_REG"
HELLO = b"KVXFER_HELLO"
META = b"KVXFER_META"
CHUNK = b"KVXFER_CHUNK"
FAILED = b"KVXFER_FAILED"
REVOKED = b"KVXFER_REVOKED"

#: The largest body accepted (a HELLO carries every registered buffer's meta; a CHUNK one id per page).
MAX_BODY_BYTES = 8 << 20


class WireError(ValueError):
    """A frame with one of kvxfer's tags that does not follow its schema (junk or a stranger's)."""


class _Body(msgspec.Struct, forbid_unknown_fields=False):
    pass


class Reg(_Body):
    endpoint: str
    layout: dict[str, Any]


class Hello(_Body):
    prefill: str
    metas: Optional[dict[str, Any]] = None
    layout: Optional[dict[str, Any]] = None
    refused: Optional[str] = None


class Meta(_Body):
    room: int
    endpoint: str
    # how many decode ranks read this room from this prefill rank (SGLang's ``required_dst_info_num``)
    readers: Annotated[int, msgspec.Meta(ge=1, le=MAX_READERS)] = 1
    dummy: bool = False  # SGLang's dummy pairing (MLA, prefill TP > decode TP): this decode reads nothing here


class Chunk(_Body):
    room: int
    prefill: str
    chunk: int
    src: list[int]
    dst_start: int
    dst_end: int
    last: bool
    slot: int
    lease: int
    aux_index: Optional[int] = None
    state: Optional[list[Optional[list[int]]]] = None


class Failed(_Body):
    room: int
    endpoint: str  # the decode that sends it: the prefill takes it only from the room's decode
    lease: Optional[int] = None
    reason: str = ""
    chunk: Optional[int] = None  # set: the answer to that chunk of the room (which may be a replay), not a report


class Revoked(_Body):
    room: int
    prefill: str  # the prefill that sends it: the decode takes it only from the room's prefill
    lease: Optional[int] = None
    reason: str = ""


SCHEMAS: dict[bytes, type[_Body]] = {REG: Reg, HELLO: Hello, META: Meta, CHUNK: Chunk, FAILED: Failed,
                                     REVOKED: Revoked}
TAGS = tuple(SCHEMAS)


class FrameKey:
    """Signs and checks kvxfer's frames with a key derived from the cluster key (None: unsigned)."""

    def __init__(self, cluster_key: Optional[bytes]) -> None:
        self._key = None if cluster_key is None else hmac.new(cluster_key, b"kvxfer/sglang-frame",
                                                              hashlib.sha256).digest()

    def __repr__(self) -> str:
        return f"FrameKey(signed={self._key is not None})"

    @property
    def signs(self) -> bool:
        return self._key is not None

    def _mac(self, parts: list[bytes]) -> bytes:
        assert self._key is not None
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(8, "big"))
            mac.update(part)
        return mac.digest()

    def sign(self, parts: list[bytes]) -> list[bytes]:
        """``parts`` as sent: with the signature appended when there is a key."""
        return parts if self._key is None else [*parts, self._mac(parts)]

    def open(self, parts: list[bytes], expected: Optional[int] = None) -> list[bytes]:
        """The parts a peer signed (the signature checked and taken off), or ``WireError``: with a key, a
        missing or wrong signature; without, too many parts (``expected``: how many an unsigned message has)."""
        tag = bytes(parts[0][:32]).decode(errors="replace")
        if self._key is None:
            if expected is not None and len(parts) != expected:
                raise WireError(f"{tag}: {len(parts)} frames, expected {expected} (a signed frame? this rank has no "
                                "KVXFER_SECRET_FILE: set the same cluster secret on every rank)")
            return parts
        if ((expected is not None and len(parts) != expected + 1) or len(parts) < 2
                or not hmac.compare_digest(bytes(parts[-1]), self._mac(parts[:-1]))):
            raise WireError(f"{tag}: not signed with this cluster's key (a stranger, or a rank without "
                            "KVXFER_SECRET_FILE or with another secret); dropped before it was read")
        return parts[:-1]


UNSIGNED = FrameKey(None)


def encode(tag: bytes, body: dict[str, Any]) -> list[bytes]:
    """An unsigned frame (``FrameKey.sign`` signs it where it leaves the rank)."""
    return [tag, msgspec.json.encode(body)]


def decode(frames: list[bytes], key: FrameKey = UNSIGNED) -> Optional[tuple[bytes, dict[str, Any]]]:
    """``(tag, body)`` for one of kvxfer's messages, None for anything else (SGLang's own).

    The signature (``key``) is checked first, then the body against its tag's schema, before any
    field is used (sizes bounded, every field typed); a frame that fails raises ``WireError``,
    which the listeners count and drop."""
    if not frames or frames[0] not in SCHEMAS:
        return None
    tag = frames[0]
    if len(frames) < 2:
        raise WireError(f"{tag.decode()}: {len(frames)} frames, expected 2 or 3")
    raw = key.open(frames, expected=2)[1]
    if len(raw) > MAX_BODY_BYTES:
        raise WireError(f"{tag.decode()}: body of {len(raw)} bytes, more than {MAX_BODY_BYTES}")
    try:
        body = msgspec.json.decode(raw, type=SCHEMAS[tag])
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
        raise WireError(f"{tag.decode()}: {exc}") from None
    for name in _ENDPOINTS[tag]:  # where this rank will send (or whom it will trust): a real ip:port
        check_endpoint(getattr(body, name), f"{tag.decode()} {name}")
    return tag, msgspec.structs.asdict(body)


#: The fields of each message that name a rank's ``ip:port``.
_ENDPOINTS: dict[bytes, tuple[str, ...]] = {REG: ("endpoint",), HELLO: ("prefill",), META: ("endpoint",),
                                            CHUNK: ("prefill",), FAILED: ("endpoint",), REVOKED: ("prefill",)}


def check_endpoint(text: str, what: str) -> None:
    """``WireError`` unless ``text`` is ``host:port`` (an IP address or host name, a port 1-65535)."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    ok = bool(sep) and port.isdigit() and 0 < int(port) < 65536 and 0 < len(host) <= 253
    if ok:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            labels = host.split(".")
            ok = all(0 < len(label) <= 63 and label.replace("-", "").isalnum() and label.isascii()
                     for label in labels)
    if not ok:
        raise WireError(f"{what} {text[:80]!r} is not a host:port")


def peer_key(ip: str, port: int) -> str:
    """A manager's name on the wire: its ZMQ endpoint."""
    return f"{ip}:{int(port)}"
