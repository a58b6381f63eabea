"""kvxfer's messages on SGLang's per-rank ZMQ sockets (each manager's PULL ``rank_port``).

SGLang's backends push: the decode sends its destination pages and the prefill writes them.
kvxfer pulls, so the flow is turned around on the same sockets, with tagged frames SGLang's
own messages never start with:

======================  ===============  =================================================================
tag                     direction        body (JSON)
======================  ===============  =================================================================
``KVXFER_REG``          decode -> prefill  the decode's endpoint and layout (SGLang's receiver registration)
``KVXFER_HELLO``        prefill -> decode  the prefill's kvxfer metas (pool, aux, state, lease table) and
                                           layout, or the reason it refused the decode's layout
``KVXFER_META``         decode -> prefill  one room: destination pages, aux row, state slots
``KVXFER_CHUNK``        prefill -> decode  one chunk is ready: source pages, where they go, lease slot
``KVXFER_FAILED``       decode -> prefill  a room's pull failed or was aborted, and no read of it is in flight
======================  ===============  =================================================================

Terminal failures the prefill reports go through SGLang's own status message, so SGLang's
decode records their reason the way it does for its own backends.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

REG = b"KVXFER_REG"
HELLO = b"KVXFER_HELLO"
META = b"KVXFER_META"
CHUNK = b"KVXFER_CHUNK"
FAILED = b"KVXFER_FAILED"

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
    lease: Optional[int] = None
    reason: str = ""


SCHEMAS: dict[bytes, type[_Body]] = {REG: Reg, HELLO: Hello, META: Meta, CHUNK: Chunk, FAILED: Failed}
TAGS = tuple(SCHEMAS)


def encode(tag: bytes, body: dict[str, Any]) -> list[bytes]:
    return [tag, msgspec.json.encode(body)]


def decode(frames: list[bytes]) -> Optional[tuple[bytes, dict[str, Any]]]:
    """``(tag, body)`` for one of kvxfer's messages, None for anything else (SGLang's own).

    The body is checked against its tag's schema before any field is used (sizes bounded, every
    field typed); one that fails raises ``WireError``, which the listeners count and drop."""
    if not frames or frames[0] not in SCHEMAS:
        return None
    tag = frames[0]
    if len(frames) != 2:
        raise WireError(f"{tag.decode()}: {len(frames)} frames, expected 2")
    raw = frames[1]
    if len(raw) > MAX_BODY_BYTES:
        raise WireError(f"{tag.decode()}: body of {len(raw)} bytes, more than {MAX_BODY_BYTES}")
    try:
        body = msgspec.json.decode(raw, type=SCHEMAS[tag])
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
        raise WireError(f"{tag.decode()}: {exc}") from None
    return tag, msgspec.structs.asdict(body)


def peer_key(ip: str, port: int) -> str:
    """A manager's name on the wire: its ZMQ endpoint."""
    return f"{ip}:{int(port)}"
