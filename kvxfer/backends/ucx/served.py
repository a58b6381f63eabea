"""Reads the source serves with active messages, where UCX would emulate ``ucp_get`` in software.

Why: a transport with no hardware GET (tcp, the path between hosts without an RDMA NIC, and
on one host when ``UCX_TLS`` leaves only tcp) makes UCX emulate every ``ucp_get``: the
reader sends a GET request, and the source's UCX answers it from ``ucp_get_req_handler``
(``src/ucp/rma/rma_sw.c``) through ``ucp_request_send``, which has no error path: when the
reader is gone by the time the source answers (SIGKILLed, or its backend closed, while the
source was stalled), the send fails and UCX calls ``ucs_fatal`` (``ucp_request.inl:356
unexpected error: Endpoint timeout``): the *source* aborts, whatever either endpoint's error
handling mode. Measured over tcp: 5 of 5 runs.

So on such an endpoint kvxfer asks instead: one ``READ`` active message per request (up to
``ROWS_PER_MESSAGE`` rows: source offset and length, relative to the source's pool) names a
token that only the source's meta carries, and the source answers every row with eager active
messages of at most ``CHUNK_BYTES`` headed (batch, row, offset), sent on the reply endpoint by
UCX's protocol layer, which completes a failed send with an error instead of aborting. The
reader copies each chunk into place in its handler. Nothing is ever read from the source's
memory but rows inside its registered pool (checked by the source, as an rkey would).

Storage safety is simpler than with gets: every byte lands in the reader's handler, under the
worker lock, so a batch that is cancelled (dropped from the table) can never be written again.
What it costs: the source's CPU copies the bytes, as UCX's emulation did; Python runs once per
chunk on the reader (a 256 KiB chunk: tens of microseconds per ~100 us of tcp time).
"""

from __future__ import annotations

import logging
import secrets
import struct
from typing import Any

import numpy as np

from kvxfer.backends.ucx import binding as _ucp

logger = logging.getLogger("kvxfer.backends.ucx")

READ_AM_ID = 0x4B57   # reader -> source: "send me these rows"
DATA_AM_ID = 0x4B58   # source -> reader: one chunk of one row, or a refusal
CHUNK_BYTES = 256 << 10
ROWS_PER_MESSAGE = 4096
TOKEN_BYTES = 16
#: Transports whose gets UCX runs without the source's CPU; an endpoint with none of them is served.
HARDWARE_GET_TRANSPORTS = frozenset({"cma", "knem", "xpmem", "rc_verbs", "rc_mlx5", "dc_mlx5", "cuda_ipc",
                                     "gdr_copy", "cuda_copy", "srd", "efa"})
_REQUEST = struct.Struct("<16sQQ")   # token, batch id, first row index of this message
_CHUNK = struct.Struct("<QQQ")       # batch id, row, offset in the row; kvx_served_hdr_t
_REFUSED = struct.Struct("<QQQq")    # batch id, ~0, 0, a negative ucs status: the source refused
_REFUSED_ROW = (1 << 64) - 1


def needs_serving(transports: list[tuple[str, str]]) -> bool:
    """True when no lane of an endpoint can GET without the source's CPU (UCX would emulate it)."""
    return not any(name in HARDWARE_GET_TRANSPORTS for name, _ in transports)


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


class Server:
    """Source side: answers READ messages from the pool at ``base`` (``length`` bytes)."""

    def __init__(self, worker: _ucp.Worker, token: bytes, base: int, length: int) -> None:
        self.token, self.base, self.length = token, base, length
        self.rows_served = 0
        self.refused = 0
        worker.set_am_handler(READ_AM_ID, self._on_read)

    def _on_read(self, header: bytes, data: Any, length: int, param: Any) -> None:
        reply_ep = _ucp.reply_endpoint(param)
        if reply_ep is None or len(header) != _REQUEST.size or length % 16:
            self.refused += 1
            return  # not one of ours: nobody to answer
        token, batch, first = _REQUEST.unpack(header)
        if length // 16 > ROWS_PER_MESSAGE:  # every row is sent from this handler: a bounded number per message
            outside, rows = True, None
        else:
            rows = np.frombuffer(_ucp.data_bytes(data, length), dtype=np.uint64).reshape(-1, 2)
            ends = rows[:, 0] + rows[:, 1]
            outside = bool((ends < rows[:, 0]).any() or (ends > self.length).any())
        if not secrets.compare_digest(token, self.token) or outside:
            self.refused += 1
            logger.warning("ucx: refused a served read (%s)", "wrong token" if not secrets.compare_digest(
                token, self.token) else "rows outside the registered pool, or too many rows")
            _ucp.answer(reply_ep, DATA_AM_ID, _REFUSED.pack(batch, _REFUSED_ROW, 0, -1))
            return
        failed = _ucp.serve_rows(reply_ep, DATA_AM_ID, batch, first, self.base, rows, CHUNK_BYTES)
        self.rows_served += rows.shape[0]
        if failed:
            logger.info("ucx: %d chunk(s) of a served read could not be sent (the reader is gone?)", failed)


class ServedBatch:
    """Reader side: one pull's rows, asked of the source and landing chunk by chunk.

    Same surface as ``GetBatch`` (``done``, ``status``, ``cancel``, ``release``, ``abandon``),
    so a handle treats both alike.
    """

    def __init__(self, reads: "ServedReads", endpoint: _ucp.Endpoint, token: bytes, local_base: int,
                 src_offsets: np.ndarray, dst_offsets: np.ndarray, lengths: np.ndarray) -> None:
        self.reads = reads
        self.worker = endpoint.worker
        # random: a chunk is taken only for the id its source was sent, and no other peer can guess it
        self.id = secrets.randbits(64)
        while self.id in reads.batches or self.id == 0:
            self.id = secrets.randbits(64)
        self._landed: set[tuple[int, int]] = set()  # (row, chunk index) written: each counts once
        self.dst = local_base + np.asarray(dst_offsets, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.left = int(self.lengths.sum())
        self._status = _ucp.code("UCS_OK")
        self.released = False
        self._cancelled = False
        rows = np.empty((self.lengths.size, 2), dtype=np.uint64)
        rows[:, 0] = np.asarray(src_offsets, dtype=np.int64)
        rows[:, 1] = self.lengths
        with self.worker.lock:
            self.worker.inflight += 1
            if self.left == 0:
                return
            reads.batches[self.id] = self
            try:
                for first in range(0, rows.shape[0], ROWS_PER_MESSAGE):
                    part = np.ascontiguousarray(rows[first:first + ROWS_PER_MESSAGE])
                    request = _ucp.send_request(endpoint, READ_AM_ID, _REQUEST.pack(token, self.id, first),
                                                data=part, reply=True)
                    if request is not None:
                        reads.keep_send(request, part)
            except _ucp.UcpError as exc:
                self._finish(exc.status)

    def on_chunk(self, row: int, offset: int, data: Any, length: int) -> None:
        """Worker lock held (the DATA handler). The source sends each row in ``CHUNK_BYTES`` pieces from
        offset 0 (``kvx_serve_rows``): anything else fails the batch; a piece seen before is not counted
        again (the batch is done only when every piece of every row landed)."""
        if (row == _REFUSED_ROW or row >= self.lengths.size or offset % CHUNK_BYTES or offset >= self.lengths[row]
                or length != min(CHUNK_BYTES, int(self.lengths[row]) - offset)):
            self._finish(_ucp.code("UCS_ERR_INVALID_PARAM"))
            return
        piece = (row, offset // CHUNK_BYTES)
        if piece in self._landed:
            return
        self._landed.add(piece)
        _ucp.memmove(int(self.dst[row]) + offset, data, length)
        self.left -= length
        if self.left <= 0:
            self._finish(_ucp.code("UCS_OK"))

    def _finish(self, status: int) -> None:
        """No byte lands after this (the batch leaves the table under the worker lock)."""
        self.reads.batches.pop(self.id, None)
        if self._status == _ucp.code("UCS_OK"):
            self._status = status
        self.left = 0

    @property
    def done(self) -> bool:
        return self.left <= 0

    @property
    def status(self) -> int:
        return self._status

    def cancel(self) -> int:
        with self.worker.lock:
            if self.done:
                return 0
            self._finish(_ucp.code("UCS_ERR_CANCELED"))
            return 1

    def release(self) -> None:
        with self.worker.lock:
            if self.released:
                return
            self._finish(_ucp.code("UCS_ERR_CANCELED"))
            self.released = True
            self.worker.inflight -= 1

    abandon = release


class ServedReads:
    """Reader side: the batches in flight, and the READ requests UCX has not completed yet."""

    def __init__(self, worker: _ucp.Worker) -> None:
        self.worker = worker
        self.batches: dict[int, ServedBatch] = {}
        self._sends: list[tuple[Any, np.ndarray]] = []
        worker.set_am_handler(DATA_AM_ID, self._on_data)

    def keep_send(self, request: Any, buffer: np.ndarray) -> None:
        self._sends.append((request, buffer))

    def reap(self) -> None:
        """Worker lock held: free READ requests UCX has completed (their row buffers with them)."""
        if self._sends:
            self._sends = [(r, b) for r, b in self._sends if _ucp.in_progress(_ucp.request_status(self.worker, r))]

    def give_up(self, deadline: float) -> None:
        """Closing: release what is still pending (UCX frees each when it completes); their row
        buffers stay referenced here, since UCX may still read them until the worker is gone."""
        for request, _ in self._sends:
            self.worker.wait_request(request, deadline, give_up=True)
        self._kept_until_worker_gone = [buffer for _, buffer in self._sends]
        self._sends = []

    def _on_data(self, header: bytes, data: Any, length: int, param: Any) -> None:
        if len(header) == _REFUSED.size:
            batch_id, row, _, _ = _REFUSED.unpack(header)
        elif len(header) == _CHUNK.size:
            batch_id, row, offset = _CHUNK.unpack(header)
        else:
            return
        batch = self.batches.get(batch_id)
        if batch is None:
            return  # a cancelled or finished batch: late chunks land nowhere
        if len(header) == _REFUSED.size:
            batch._finish(_ucp.code("UCS_ERR_REJECTED"))
            return
        batch.on_chunk(row, offset, data, length)


def make_batch(reads: ServedReads, endpoint: _ucp.Endpoint, token: bytes, local_base: int, plan: Any) -> ServedBatch:
    return ServedBatch(reads, endpoint, token, local_base, plan.src_offsets, plan.dst_offsets, plan.lengths)

