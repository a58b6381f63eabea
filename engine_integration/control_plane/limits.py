"""What a peer may send: JSON bounded in nesting depth and size, checked before it is decoded.

Every structure a peer controls (a ZeroMQ control message, a record in etcd) reaches a
decoder only after ``check_json`` has bounded it: at most ``max_bytes`` bytes and at most
``MAX_DEPTH`` levels of lists/objects. A value nested 2,000 deep used to reach msgspec (or
``json.loads``), whose ``RecursionError`` killed the coordinator and every etcd engine
(issue 21, A6 and A10); now it is a ``TooDeep`` refusal, counted and logged by the caller.

The scan costs a few C-speed passes over the bytes and none at all for a document with
fewer brackets than the limit: escaped backslashes and quotes are removed (so every quote
left delimits a string), the strings are removed, the brackets are kept, and their running
depth is summed with numpy. Real metas are 5 levels deep (local, ucx, nixl measured), a
whole control message with one 7; the limit leaves room for PP/TP/SSM entries and is far
from Python's recursion limit. A typed decoder (msgspec) then checks every field.
"""

from __future__ import annotations

import re

import numpy as np

MAX_DEPTH = 32                 #: levels of lists/objects in one document, the outermost counted
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


class TooDeep(ValueError):
    """A document nested deeper than allowed (or too large): refused before decoding."""


_STEP = np.full(256, -1, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_CHUNK = 1 << 20


def nesting_depth(payload: bytes, *, stop_above: int | None = None) -> int:
    """How deep ``payload``'s lists and objects nest (JSON; brackets inside strings do not count).

    With ``stop_above``, the scan stops as soon as the depth passes it (a refusal need not
    read the rest). Memory stays at a few MiB whatever the size: the running depth is
    summed chunk by chunk. Unbalanced brackets give some depth too; the decoder refuses
    such a document anyway.
    """
    if payload.count(b"[") + payload.count(b"{") == 0:
        return 0
    plain = payload.replace(b"\\\\", b"").replace(b'\\"', b"")   # every quote left delimits a string
    skeleton = np.frombuffer(_STRING.sub(b"", plain).translate(None, _NOT_BRACKET), dtype=np.uint8)
    deepest, level = 0, 0
    for start in range(0, len(skeleton), _CHUNK):
        running = np.cumsum(_STEP[skeleton[start:start + _CHUNK]], dtype=np.int64) + level
        deepest, level = max(deepest, int(running.max())), int(running[-1])
        if stop_above is not None and deepest > stop_above:
            break
    return deepest


def check_json(payload: bytes, *, max_bytes: int, max_depth: int = MAX_DEPTH, what: str = "document") -> bytes:
    """``payload`` unchanged if it is small and shallow enough to decode; ``TooDeep`` otherwise."""
    if len(payload) > max_bytes:
        raise TooDeep(f"{what} of {len(payload)} bytes is larger than {max_bytes}")
    if payload.count(b"[") + payload.count(b"{") > max_depth:   # fewer brackets than the limit: cannot be deeper
        depth = nesting_depth(payload, stop_above=max_depth)
        if depth > max_depth:
            raise TooDeep(f"{what} nested more than {max_depth} levels deep ({depth} or more)")
    return payload
