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

import json
from typing import Any, Optional

REG = b"KVXFER_REG"
HELLO = b"KVXFER_HELLO"
META = b"KVXFER_META"
CHUNK = b"KVXFER_CHUNK"
FAILED = b"KVXFER_FAILED"
TAGS = (REG, HELLO, META, CHUNK, FAILED)


def encode(tag: bytes, body: dict[str, Any]) -> list[bytes]:
    return [tag, json.dumps(body, separators=(",", ":")).encode()]


def decode(frames: list[bytes]) -> Optional[tuple[bytes, dict[str, Any]]]:
    """``(tag, body)`` for one of kvxfer's messages, None for anything else (SGLang's own)."""
    if len(frames) != 2 or frames[0] not in TAGS:
        return None
    body = json.loads(frames[1])
    if not isinstance(body, dict):
        raise ValueError(f"{frames[0].decode()}: body is not an object")
    return frames[0], body


def peer_key(ip: str, port: int) -> str:
    """A manager's name on the wire: its ZMQ endpoint."""
    return f"{ip}:{int(port)}"
