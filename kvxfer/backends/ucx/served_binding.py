"""The C calls behind served reads (``served.py``): the source's counters and chunked answers
(``kvx_serve_*`` in ``binding_build.py``) and the active-message details a READ's handler needs.

Apart from ``binding.py`` because only served reads use them; they run on the same compiled module
(``binding.load()``, already loaded by the time a worker exists) and, like everything there, under
the worker lock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvxfer.backends.ucx import binding as _ucp


def reply_endpoint(param: Any) -> Any:
    """The endpoint an active message may be answered on (in its handler only), or None."""
    ffi, lib = _ucp.load()
    if not param.recv_attr & lib.UCP_AM_RECV_ATTR_FIELD_REPLY_EP or param.reply_ep == ffi.NULL:
        return None
    return param.reply_ep


def new_serve_pool() -> Any:
    """The source's served-read counters of one worker (``kvx_serve_pool_t``). Kept by the caller until the
    worker is destroyed."""
    ffi = _ucp.load()[0]
    return ffi.new("kvx_serve_pool_t *")


def new_serve_reader(pool: Any) -> Any:
    """One reader's served-read counters (``kvx_serve_reader_t``), in ``pool``."""
    ffi = _ucp.load()[0]
    reader = ffi.new("kvx_serve_reader_t *")
    reader.pool = pool
    return reader


def serve_rows(reader: Any, reply_ep: Any, am_id: int, batch: int, first: int, base: int, rows: np.ndarray,
               nbytes: int, chunk: int) -> Any:
    """Send ``rows`` (n x 2 uint64: offset from ``base``, length; indices from ``first``; ``nbytes`` in all)
    back on ``reply_ep`` as eager AMs of at most ``chunk`` bytes, counted for ``reader`` (``kvx_serve_rows``);
    worker lock held (the READ's handler). The returned serve must stay alive until ``serve.finished`` (or
    the worker is destroyed): its sends' completions count on it."""
    ffi, lib = _ucp.load()
    rows = np.ascontiguousarray(rows, dtype=np.uint64)
    serve = ffi.new("kvx_serve_t *")
    serve.reader, serve.bytes = reader, nbytes
    lib.kvx_serve_rows(serve, reply_ep, am_id, batch, first, base, ffi.cast("const uint64_t *", rows.ctypes.data),
                       rows.shape[0], chunk)
    return serve


def abandon_serve(serve: Any) -> None:
    """Give up on ``serve`` (worker lock held): its sends in flight are counted apart (``kvx_serve_abandon``).
    It must stay alive while any of them is in flight."""
    lib = _ucp.load()[1]
    lib.kvx_serve_abandon(serve)


def refuse(reply_ep: Any, am_id: int, header: bytes, reader: Any, max_reader: int, max_total: int) -> bool:
    """A header-only AM on ``reply_ep`` (in an AM handler), unless ``reader`` has ``max_reader`` such
    answers in flight or its pool ``max_total``; False when it was not sent."""
    lib = _ucp.load()[1]
    return bool(lib.kvx_serve_refuse(reply_ep, am_id, header, len(header), reader, max_reader, max_total))


def endpoint_key(ep: Any) -> int:
    """A raw endpoint handle as an int (a dict key)."""
    ffi = _ucp.load()[0]
    return int(ffi.cast("uintptr_t", ep))


def memmove(address: int, data: Any, length: int) -> None:
    """Copy ``length`` bytes of an AM's ``data`` to ``address`` (host memory)."""
    ffi = _ucp.load()[0]
    ffi.memmove(ffi.cast("void *", address), ffi.cast("const void *", data), length)
