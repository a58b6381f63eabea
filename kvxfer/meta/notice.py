"""The read-done / read-failed notifications every transport sends to a source.

A NIXL notification is an opaque byte string delivered to the remote agent. Ours
is a small versioned JSON object so that a source can tell *which* registration
(``buf``: siblings share one agent, hence one notification stream) and *which*
request it is about, and can refuse anything else instead of misreading it::

    {"v": 5, "kind": "done",   "rid": 42, "buf": 3}
    {"v": 5, "kind": "failed", "rid": "decode-0:7", "buf": 3, "reason": "timed out after 30s"}

(``v`` is the wire version, ``kvxfer.meta.version``.)

``rid`` keeps its JSON type (int or str), so the source gets back exactly the
``request_id`` the decode side passed. Messages that do not parse are *garbage*:
counted and dropped, never raised, because a peer we do not control must not be
able to break the source's drain loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, Optional, Union

import msgspec

from kvxfer.meta.version import WIRE_VERSION

MAX_NOTIFY_BYTES = 4096  # a notification is tiny; anything bigger is not ours
MAX_REASON_CHARS = 512

Kind = Literal["done", "failed"]
_KINDS = ("done", "failed")


@dataclass(frozen=True)
class Notification:
    """One parsed notification."""

    kind: Kind
    request_id: Union[int, str]
    buffer_id: int
    reason: str = ""


def encode(kind: Kind, request_id: Union[int, str], buffer_id: int, reason: str = "") -> bytes:
    """Serialise one notification (compact JSON, UTF-8)."""
    if kind not in _KINDS:
        raise ValueError(f"notification kind must be one of {_KINDS}, got {kind!r}")
    body: dict[str, object] = {"v": WIRE_VERSION, "kind": kind, "rid": request_id, "buf": buffer_id}
    if kind == "failed":
        body["reason"] = reason[:MAX_REASON_CHARS]
    try:
        data = msgspec.json.encode(body)  # compact JSON as json.dumps writes it, ~10x faster (the hot path)
    except (TypeError, UnicodeEncodeError):  # a str or int subclass (numpy.str_), a lone surrogate: json's way
        data = json.dumps(body, separators=(",", ":")).encode()
    if len(data) > MAX_NOTIFY_BYTES:
        raise ValueError(f"request id is too long for a notification ({len(data)} bytes encoded)")
    return data


def decode(message: bytes) -> Optional[Notification]:
    """Parse one notification; ``None`` for anything that is not a valid notice of this wire version."""
    if not isinstance(message, (bytes, bytearray)) or len(message) > MAX_NOTIFY_BYTES:
        return None
    try:
        body = json.loads(message)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: b"[" * 4000 fits the size bound
        return None
    if not isinstance(body, dict) or body.get("v") != WIRE_VERSION or body.get("kind") not in _KINDS:
        return None
    rid, buf, reason = body.get("rid"), body.get("buf"), body.get("reason", "")
    if isinstance(rid, bool) or not isinstance(rid, (int, str)):
        return None
    if isinstance(buf, bool) or not isinstance(buf, int) or not isinstance(reason, str):
        return None
    return Notification(body["kind"], rid, buf, reason[:MAX_REASON_CHARS])
