"""Reads the source serves with active messages, where UCX would emulate ``ucp_get`` in software.

Why: a transport with no hardware GET (tcp, the path between hosts without an RDMA NIC, and
on one host when ``UCX_TLS`` leaves only tcp) makes UCX emulate every ``ucp_get``: the
reader sends a GET request, and the source's UCX answers it from ``ucp_get_req_handler``
(``src/ucp/rma/rma_sw.c``) through ``ucp_request_send``, which has no error path: when the
reader is gone by the time the source answers (SIGKILLed, or its backend closed, while the
source was stalled), the send fails and UCX calls ``ucs_fatal`` (``ucp_request.inl:356
unexpected error: Endpoint timeout``): the *source* aborts, whatever either endpoint's error
handling mode. Measured over tcp: 5 of 5 runs.

So on such an endpoint kvxfer asks instead: ``READ`` active messages (source offset and length
of each row, relative to the source's pool) name a token that only the source's meta carries,
and the source answers every row with eager active messages of at most ``CHUNK_BYTES`` headed
(batch, row, offset), sent on the reply endpoint by UCX's protocol layer, which completes a
failed send with an error instead of aborting. The reader copies each chunk into place in its
handler. Nothing is ever read from the source's memory but rows inside its registered pool
(checked by the source, as an rkey would).

A reader cannot exhaust its source (issue 39). Before, one 64 KiB READ could ask for 64 GiB
(4,096 rows of a whole 16 MiB pool), and its handler posted every chunk at once: 8 such READs
grew the source from 251 to 1,278 MiB. Now the source accepts a READ only within bounds, and
refuses it otherwise with a reason the reader reports (``REFUSALS``):

- per READ: ``ROWS_PER_MESSAGE`` rows and ``MAX_READ_BYTES`` bytes;
- per reader (a reply endpoint), in flight (posted, not yet completed by UCX):
  ``READER_READS`` READs, ``READER_INFLIGHT_BYTES`` bytes, ``READER_SENDS`` chunk sends;
- in all: ``MAX_SERVES`` READs, ``TOTAL_INFLIGHT_BYTES`` bytes, ``MAX_SENDS`` sends.

The flow control is the READ: a source posts an accepted READ's chunks in its handler, and a
reader keeps at most half of those per-reader bounds asked of one source (``READ_AHEAD_*``),
sending its next READs as earlier ones land, so the chunks of a pull are posted as earlier ones
complete. (Posting on a reply endpoint outside its READ's handler, from a send's completion,
stalled for good over tcp with UCX 1.22: the sends stayed posted and unwritten, the socket
empty; so the source never does.) A reader whose chunks in flight do not move for
``SERVE_STALL_S`` (stopped, or gone in a way UCX never reports) is given up: its READs stop
counting against the bounds, the few sends UCX keeps for it counted apart
(``MAX_ABANDONED_SENDS``).

Storage safety is simpler than with gets: every byte lands in the reader's handler, under the
worker lock, so a batch that is cancelled (dropped from the table) can never be written again.
What it costs: the source's CPU copies the bytes, as UCX's emulation did; Python runs once per
chunk on the reader (a 256 KiB chunk: tens of microseconds per ~100 us of tcp time).
"""

from __future__ import annotations

import bisect
import logging
import secrets
import struct
import time
import weakref
from collections import Counter, deque
from typing import Any, Optional

import numpy as np

from kvxfer.backends.ucx import binding as _ucp
from kvxfer.backends.ucx import served_binding as _serve

logger = logging.getLogger(__name__)

READ_AM_ID = 0x4B57    # reader -> source: "send me these rows"
DATA_AM_ID = 0x4B58    # source -> reader: one chunk of one row, or a refusal
CHUNK_BYTES = 256 << 10
TOKEN_BYTES = 16

#: The most rows one READ may name. Why: the source checks every row of a READ in its handler, and each
#: row is at least one send.
ROWS_PER_MESSAGE = 4096
#: The most bytes one READ may ask for (the sum of its rows). Why: a READ's chunks are all posted at once;
#: without a bound one 64 KiB message asked for 64 GiB (4,096 rows of a 16 MiB pool, round 5). A reader
#: splits longer rows and pulls into several READs. A multiple of ``CHUNK_BYTES``.
MAX_READ_BYTES = 4 << 20
#: The most READs of one reader (one reply endpoint) in flight at once. Why: each is a serve the source
#: tracks until its last send completed.
READER_READS = 16
#: The most bytes of one reader's READs in flight (posted, not all completed). Why: UCX keeps every chunk
#: posted and not yet written; a reader that does not drain holds at most this much of the source's sends.
READER_INFLIGHT_BYTES = 32 << 20
#: The most chunk sends of one reader in flight. Why: each is a UCX request (measured ~512 B: 262,144 of
#: them were the +128 MiB of one round-5 READ); a READ of many small rows is many sends for few bytes.
READER_SENDS = 8192
#: In all, readers together (endpoints cost a reader nothing, so the per-reader bounds alone would not
#: bound the source): READs being served, bytes and sends in flight. Past one, a READ is refused as busy.
#: 32,768 sends are ~16 MiB of UCX requests; 256 MiB of pool is only referenced, never copied ahead.
MAX_SERVES = 256
TOTAL_INFLIGHT_BYTES = 256 << 20
MAX_SENDS = 32768
#: Refusals in flight to one reader, and in all (header-only answers UCX has not sent yet). Why: a
#: reader flooding refused READs without draining would otherwise queue one answer per READ; past
#: these a READ is dropped unanswered (counted in ``refusals_dropped``; its reader times out).
READER_REFUSALS = 64
MAX_REFUSALS = 4096
#: Reader side: the most READs, bytes and sends kept asked of one source (sent and not all landed): half
#: of the source's per-reader bounds. Why half: a READ the reader gave up on (cancelled, timed out) still
#: counts at the source until its sends completed; the other half is room for those.
READ_AHEAD_READS = READER_READS // 2
READ_AHEAD_BYTES = READER_INFLIGHT_BYTES // 2
READ_AHEAD_SENDS = READER_SENDS // 2
#: A reader that has chunks in flight and completes none of them for this long is taken for stuck, and its
#: READs are given up: they stop counting against the bounds above, and the sends UCX still holds for them
#: are counted apart (``sends_abandoned``). Why: UCX does not fail those sends when such a reader is gone
#: (measured over tcp, UCX 1.22: a reader SIGKILLed, or closing its worker, while stopped mid-read left the
#: source's sends posted for the 140 s watched, the connection closed), and a stuck reader must not hold
#: its share of ``MAX_SERVES`` and the rest for ever. Why 10 s: a live reader drains continuously (its
#: progress thread), so 10 s without a completed chunk is a reader stopped or cut off; giving it up changes
#: only what is counted (its sends stay posted, and land if it comes back), and a reader cut off for longer
#: (a 12 s link cut in ``tests/backends/test_netns_link.py``) then finds its own budget free when the link returns,
#: instead of being pushed back (``BACK_PRESSURE``) past its pulls' timeout by READs of pulls long failed.
SERVE_STALL_S = 10.0
#: The most sends given up on (above) that UCX may still hold; past it the source refuses new READs as
#: stalled. Why: each stuck reader leaves at most its sends in flight behind (``READER_SENDS``; in practice
#: a few dozen, ~512 B each): 16,384 of them are ~8 MiB, the most stuck readers may cost a source.
MAX_ABANDONED_SENDS = 16384
#: The source logs refusals at WARNING at most this often (with the count since), at DEBUG otherwise.
REFUSAL_LOG_INTERVAL_S = 10.0

#: Transports whose gets UCX runs without the source's CPU; an endpoint with none of them is served.
HARDWARE_GET_TRANSPORTS = frozenset({"cma", "knem", "xpmem", "rc_verbs", "rc_mlx5", "dc_mlx5", "cuda_ipc",
                                     "gdr_copy", "cuda_copy", "srd", "efa"})
_REQUEST = struct.Struct("<16sQQ")    # token, batch id, first row index of this message
_CHUNK = struct.Struct("<QQQ")        # batch id, row, offset in the row; kvx_served_hdr_t
_REFUSED = struct.Struct("<QQQqQQ")   # batch id, ~0, reason, the refused READ's first row, what was asked, the bound
_REFUSED_ROW = (1 << 64) - 1

#: Why a source refuses a READ: code -> (name, the reader's words; ``{asked}`` and ``{limit}`` filled).
REFUSALS = {
    1: ("wrong_token", "its read token is not this source's (a meta of another registration, or forged)"),
    2: ("outside_pool", "it names rows outside the source's registered pool"),
    3: ("malformed", "its rows are not (offset, length) pairs"),
    4: ("too_many_rows", "it names {asked} rows; a READ may name at most {limit} (served.ROWS_PER_MESSAGE)"),
    5: ("read_too_large", "it asks for {asked} bytes; a READ may ask for at most {limit} (served.MAX_READ_BYTES)"),
    6: ("reader_reads", "this reader has {asked} READs in flight; at most {limit} (served.READER_READS)"),
    7: ("reader_bytes", "this reader would have {asked} bytes in flight; at most {limit} "
                        "(served.READER_INFLIGHT_BYTES)"),
    8: ("reader_sends", "this reader would have {asked} chunk sends in flight; at most {limit} "
                        "(served.READER_SENDS)"),
    9: ("busy_reads", "the source is serving {asked} READs, its most (served.MAX_SERVES = {limit}); try again"),
    10: ("busy_bytes", "the source would have {asked} bytes in flight, over its most (served.TOTAL_INFLIGHT_BYTES "
                       "= {limit}); try again"),
    11: ("busy_sends", "the source would have {asked} chunk sends in flight, over its most (served.MAX_SENDS = "
                       "{limit}); try again"),
    12: ("stalled", "the source holds {asked} sends for readers that stopped taking them, its most "
                    "(served.MAX_ABANDONED_SENDS = {limit})"),
    13: ("closing", "the source is closing"),
}
_CODES = {name: code for code, (name, _) in REFUSALS.items()}
#: Refusals that say "not now", not "never": the source counts this reader's (or everyone's) READs in flight
#: over a bound. A reader's own pacing (``READ_AHEAD_*``) keeps it under its bounds, but the source counts
#: READs until their sends completed: after a batch failed (a link cut, a timeout) its READs still count
#: there until their sends end, and the next pull would be refused. So the reader asks again after a pause
#: (``BACK_PRESSURE_MIN_S`` doubling to ``BACK_PRESSURE_MAX_S``), within the pull's own timeout.
BACK_PRESSURE = frozenset(_CODES[name] for name in ("reader_reads", "reader_bytes", "reader_sends", "busy_reads",
                                                     "busy_bytes", "busy_sends"))
BACK_PRESSURE_MIN_S = 0.005
BACK_PRESSURE_MAX_S = 0.5

_SERVERS: "weakref.WeakSet[Server]" = weakref.WeakSet()


def needs_serving(transports: list[tuple[str, str]]) -> bool:
    """True when no lane of an endpoint can GET without the source's CPU (UCX would emulate it)."""
    return not any(name in HARDWARE_GET_TRANSPORTS for name, _ in transports)


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def refusal_text(code: int, asked: int, limit: int) -> str:
    """The reader's words for a source's refusal."""
    name, words = REFUSALS.get(code, ("unknown", f"reason {code}"))
    return f"the source refused the served read ({name}): {words.format(asked=asked, limit=limit)}"


def chunk_sends(lengths: np.ndarray) -> int:
    """How many chunk sends rows of these lengths are (each row at least one, ``CHUNK_BYTES`` at most each)."""
    return int(np.maximum(1, -(-lengths.astype(np.int64) // CHUNK_BYTES)).sum()) if lengths.size else 0


def server_stats() -> list[dict[str, Any]]:
    """The counters of every source serving reads in this process (``Server.stats``)."""
    return [server.stats() for server in list(_SERVERS)]


class _Reader:
    """Source side: one reader (a reply endpoint): its counters in C, and when its sends last moved."""

    __slots__ = ("counters", "completions", "moved_at")

    def __init__(self, pool: Any) -> None:
        self.counters = _serve.new_serve_reader(pool)
        self.completions = 0
        self.moved_at = time.monotonic()

    @property
    def idle(self) -> bool:
        return self.counters.reads == 0 and self.counters.refusals == 0


class Server:
    """Source side: answers READ messages from the pool at ``base`` (``length`` bytes), within the bounds above."""

    def __init__(self, worker: _ucp.Worker, token: bytes, base: int, length: int) -> None:
        self.worker = worker
        self.token, self.base, self.length = token, base, length
        self.rows_served = 0
        self.reads_accepted = 0
        self.refused = 0
        self.refused_by: Counter[str] = Counter()
        self.refusals_dropped = 0  # refusals not answered (too many in flight)
        self.readers_abandoned = 0  # stuck readers whose READs were given up (SERVE_STALL_S)
        self._pool = _serve.new_serve_pool()
        self._readers: dict[int, _Reader] = {}
        #: READs in flight, with their reader: kept until the serve is finished (its sends count on it)
        self._serves: list[tuple[Any, _Reader]] = []
        #: READs given up on, kept while UCX may still complete a send of theirs
        self._abandoned: list[tuple[Any, _Reader]] = []
        self._busy = False
        self._logged_at = 0.0
        self._unlogged = 0
        worker.set_am_handler(READ_AM_ID, self._on_read)
        worker.idle_tasks.append(self._sweep)
        worker.before_destroy.append(self._closing)
        worker.served = self
        _SERVERS.add(self)

    # --- the READ handler (worker lock held) -------------------------------------------------------
    def _on_read(self, header: bytes, data: Any, length: int, param: Any) -> None:
        reply_ep = _serve.reply_endpoint(param)
        if reply_ep is None or len(header) != _REQUEST.size:
            self._count("malformed")
            return  # not one of ours: nobody to answer
        token, batch, first = _REQUEST.unpack(header)
        key = _serve.endpoint_key(reply_ep)
        reader = self._readers.get(key)
        if reader is None:
            reader = self._readers[key] = _Reader(self._pool)
        checked = self._check(token, data, length, reader)
        if len(checked) == 3:
            self._refuse(reply_ep, key, reader, batch, first, *checked)
            return
        rows, nbytes = checked
        serve = _serve.serve_rows(reader.counters, reply_ep, DATA_AM_ID, batch, first, self.base, rows, nbytes,
                                CHUNK_BYTES)
        self.reads_accepted += 1
        self.rows_served += rows.shape[0]
        if serve.status != _ucp.code("UCS_OK"):
            logger.info("ucx: a served read could not be sent whole (status %d: the reader is gone?)", serve.status)
        if serve.finished:
            if reader.idle:
                self._readers.pop(key, None)
            return
        self._serves.append((serve, reader))
        if not self._busy:  # the progress thread polls on its short timer while sends are in flight
            self._busy = True
            self.worker.inflight += 1

    def _check(self, token: bytes, data: Any, length: int, reader: _Reader) -> tuple:
        """``(rows, bytes)`` of an acceptable READ, or ``(reason code, asked, bound)``: cheapest checks first,
        the token before anything it names is looked at."""
        if not secrets.compare_digest(token, self.token):
            return _CODES["wrong_token"], 0, 0
        if self._pool.closing:
            return _CODES["closing"], 0, 0
        if length == 0 or length % 16:
            return _CODES["malformed"], length, 0
        if length // 16 > ROWS_PER_MESSAGE:
            return _CODES["too_many_rows"], length // 16, ROWS_PER_MESSAGE
        rows = np.frombuffer(_ucp.data_bytes(data, length), dtype=np.uint64).reshape(-1, 2)
        ends = rows[:, 0] + rows[:, 1]
        if bool((ends < rows[:, 0]).any() or (ends > self.length).any()):
            return _CODES["outside_pool"], 0, 0
        asked = float(rows[:, 1].sum(dtype=np.float64))  # no uint64 wrap: rows may each be the whole pool
        if asked > MAX_READ_BYTES:
            return _CODES["read_too_large"], int(asked), MAX_READ_BYTES
        nbytes, sends = int(rows[:, 1].sum()), chunk_sends(rows[:, 1])
        counters, pool = reader.counters, self._pool
        if len(self._serves) >= MAX_SERVES:
            self._sweep()  # finished ones may not be swept yet
        for code, now, more, bound in (("reader_reads", counters.reads, 1, READER_READS),
                                       ("reader_bytes", counters.bytes, nbytes, READER_INFLIGHT_BYTES),
                                       ("reader_sends", counters.requests, sends, READER_SENDS),
                                       ("busy_reads", len(self._serves), 1, MAX_SERVES),
                                       ("busy_bytes", pool.bytes, nbytes, TOTAL_INFLIGHT_BYTES),
                                       ("busy_sends", pool.requests, sends, MAX_SENDS)):
            if now + more > bound:
                return _CODES[code], int(now) + more, bound
        if pool.abandoned >= MAX_ABANDONED_SENDS:
            return _CODES["stalled"], int(pool.abandoned), MAX_ABANDONED_SENDS
        return rows, nbytes

    def _refuse(self, reply_ep: Any, key: int, reader: _Reader, batch: int, first: int, code: int, asked: int,
                limit: int) -> None:
        self._count(REFUSALS[code][0])
        first = first if first < (1 << 63) else -1
        if not _serve.refuse(reply_ep, DATA_AM_ID, _REFUSED.pack(batch, _REFUSED_ROW, code, first, asked, limit),
                           reader.counters, READER_REFUSALS, MAX_REFUSALS):
            self.refusals_dropped += 1
        if reader.idle:
            self._readers.pop(key, None)
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_INTERVAL_S:
            logger.warning("ucx: refused a served read: %s (%d more refused since the last such warning; counts "
                           "by reason: %s)", refusal_text(code, asked, limit), self._unlogged, dict(self.refused_by))
            self._logged_at, self._unlogged = now, 0
        else:
            self._unlogged += 1
            logger.debug("ucx: refused a served read: %s", refusal_text(code, asked, limit))

    def _count(self, name: str) -> None:
        self.refused += 1
        self.refused_by[name] += 1

    # --- housekeeping (worker lock held) ------------------------------------------------------------
    def _sweep(self) -> None:
        """Drop finished serves and idle readers, give up on stuck ones (the progress thread, after each pass)."""
        if self._abandoned:
            self._abandoned = [(serve, reader) for serve, reader in self._abandoned
                               if (serve is not None and not serve.finished) or reader.counters.refusals > 0]
        if not self._serves and not self._readers:
            return
        self._serves = [(serve, reader) for serve, reader in self._serves if not serve.finished]
        self._readers = {key: reader for key, reader in self._readers.items() if not reader.idle}
        if self._serves:
            self._give_up_stuck()
        elif self._busy:
            self._busy = False
            self.worker.inflight -= 1

    def _give_up_stuck(self) -> None:
        """Give up on the READs of a reader whose sends in flight have not moved for ``SERVE_STALL_S``."""
        now = time.monotonic()
        for key, reader in list(self._readers.items()):
            counters = reader.counters
            if counters.requests <= 0 or counters.completions != reader.completions:
                reader.completions, reader.moved_at = int(counters.completions), now
                continue
            if now - reader.moved_at < SERVE_STALL_S:
                continue
            logger.warning("ucx: a reader has taken none of its served chunks for %.0fs (%d READs, %d sends in "
                           "flight): its READs are given up", SERVE_STALL_S, int(counters.reads),
                           int(counters.requests))
            self.readers_abandoned += 1
            kept = []
            for serve, owner in self._serves:
                if owner is not reader:
                    kept.append((serve, owner))
                    continue
                _serve.abandon_serve(serve)
                self._abandoned.append((serve, reader))
            self._serves = kept
            del self._readers[key]  # the same endpoint asking again is a new reader
            if counters.refusals > 0:
                self._abandoned.append((None, reader))  # its refusals' completions count on it

    def _closing(self) -> None:
        """The worker is about to be destroyed: no READ is accepted any more (what UCX completes as it tears
        the worker down counts on structures this object keeps: it outlives that, kept by the handler table)."""
        self._pool.closing = 1

    def stats(self) -> dict[str, Any]:
        """Counters (thread-safe): what was served and refused, and what is held right now."""
        with self.worker.lock:
            pool = self._pool
            return {
                "reads_accepted": self.reads_accepted, "rows_served": self.rows_served, "refused": self.refused,
                "refused_by": dict(self.refused_by), "refusals_dropped": self.refusals_dropped,
                "readers_abandoned": self.readers_abandoned, "sends_abandoned": int(pool.abandoned),
                "reads_active": sum(1 for serve, _ in self._serves if not serve.finished),
                "readers": sum(1 for reader in self._readers.values() if not reader.idle),
                "bytes_in_flight": int(pool.bytes), "sends_in_flight": int(pool.requests),
                "sends_in_flight_peak": int(pool.peak), "bytes_posted": int(pool.bytes_posted),
                "chunks_sent": int(pool.chunks_sent), "sends_failed": int(pool.failed),
                "bounds": {name: globals()[name] for name in (
                    "ROWS_PER_MESSAGE", "MAX_READ_BYTES", "READER_READS", "READER_INFLIGHT_BYTES", "READER_SENDS",
                    "MAX_SERVES", "TOTAL_INFLIGHT_BYTES", "MAX_SENDS", "SERVE_STALL_S", "MAX_ABANDONED_SENDS",
                    "CHUNK_BYTES")},
            }


# --- reader side ---------------------------------------------------------------------------------------
class _Part:
    """One READ of a batch: rows ``first..`` (``rows``: n x 2 uint64), ``bytes`` and ``sends`` in all,
    ``left`` bytes to land."""

    __slots__ = ("batch", "first", "rows", "bytes", "sends", "left", "sent")

    def __init__(self, batch: "ServedBatch", first: int, rows: np.ndarray) -> None:
        self.batch, self.first, self.rows, self.sent = batch, first, rows, False
        self.bytes = self.left = int(rows[:, 1].sum())
        self.sends = chunk_sends(rows[:, 1])


class _Lane:
    """What this reader has asked of one source endpoint and not all received, and what waits to be asked."""

    __slots__ = ("reads", "bytes", "sends", "queue", "pumping", "not_before", "backoff_s")

    def __init__(self) -> None:
        self.reads = self.bytes = self.sends = 0
        self.queue: deque[_Part] = deque()
        self.pumping = False
        self.not_before = 0.0  # the source said "not now" (``BACK_PRESSURE``): nothing is asked before this
        self.backoff_s = 0.0

    def has_room(self, part: _Part) -> bool:
        """Always for one READ; then within ``READ_AHEAD_*``; never while the source pushes back."""
        if self.not_before and time.monotonic() < self.not_before:
            return False
        return not self.reads or (self.reads < READ_AHEAD_READS and self.bytes + part.bytes <= READ_AHEAD_BYTES
                                  and self.sends + part.sends <= READ_AHEAD_SENDS)


def _split_rows(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, piece: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of at most ``piece`` bytes (longer ones cut in order), without empty rows."""
    keep = lengths > 0
    if not keep.all():
        src, dst, lengths = src[keep], dst[keep], lengths[keep]
    if lengths.size == 0 or int(lengths.max()) <= piece:
        return src, dst, lengths
    counts = -(-lengths // piece)
    index = np.repeat(np.arange(lengths.size), counts)
    offsets = (np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * piece
    return src[index] + offsets, dst[index] + offsets, np.minimum(piece, lengths[index] - offsets)


def _part_bounds(lengths: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive row ranges of at most ``ROWS_PER_MESSAGE`` rows, ``MAX_READ_BYTES`` bytes (each row is at
    most that) and ``READ_AHEAD_SENDS`` sends: Python work per READ, not per row."""
    ends = np.cumsum(lengths)
    sends = np.cumsum(np.maximum(1, -(-lengths // CHUNK_BYTES)))
    out, start, n = [], 0, int(lengths.size)
    while start < n:
        before, sent = (int(ends[start - 1]), int(sends[start - 1])) if start else (0, 0)
        stop = min(int(np.searchsorted(ends, before + MAX_READ_BYTES, side="right")),
                   int(np.searchsorted(sends, sent + READ_AHEAD_SENDS, side="right")), start + ROWS_PER_MESSAGE, n)
        stop = max(start + 1, stop)
        out.append((start, stop))
        start = stop
    return out


class ServedBatch:
    """Reader side: one pull's rows, asked of the source READ by READ and landing chunk by chunk.

    Same surface as ``GetBatch`` (``done``, ``status``, ``cancel``, ``release``, ``abandon``),
    so a handle treats both alike. A refusal's ``status`` says the source's reason
    (``binding.status_string``).
    """

    def __init__(self, reads: "ServedReads", endpoint: _ucp.Endpoint, token: bytes, local_base: int,
                 src_offsets: np.ndarray, dst_offsets: np.ndarray, lengths: np.ndarray) -> None:
        self.reads = reads
        self.endpoint = endpoint
        self.worker = endpoint.worker
        self.token = token
        # random: a chunk is taken only for the id its source was sent, and no other peer can guess it
        self.id = secrets.randbits(64)
        while self.id in reads.batches or self.id == 0:
            self.id = secrets.randbits(64)
        self._landed: set[tuple[int, int]] = set()  # (row, chunk index) written: each counts once
        src, dst, lens = _split_rows(np.asarray(src_offsets, dtype=np.int64), np.asarray(dst_offsets, dtype=np.int64),
                                     np.asarray(lengths, dtype=np.int64), MAX_READ_BYTES)
        self.dst = local_base + dst
        self.lengths = lens
        self.left = int(lens.sum())
        self._status: int = _ucp.code("UCS_OK")
        self.released = False
        self.over = False  # finished (landed, failed or cancelled): nothing of it is asked or lands any more
        rows = np.empty((lens.size, 2), dtype=np.uint64)
        rows[:, 0] = src
        rows[:, 1] = lens
        self._parts = [_Part(self, a, rows[a:b]) for a, b in _part_bounds(lens)]
        self._starts = [part.first for part in self._parts]
        with self.worker.lock:
            self.worker.inflight += 1
            if self.left == 0:
                self.over = True
                return
            reads.batches[self.id] = self
            reads.ask(self)

    def on_chunk(self, row: int, offset: int, data: Any, length: int) -> None:
        """Worker lock held (the DATA handler). The source sends each row in ``CHUNK_BYTES`` pieces from
        offset 0: anything else fails the batch; a piece seen before is not counted again (the batch is
        done only when every piece of every row landed)."""
        if (row == _REFUSED_ROW or row >= self.lengths.size or offset % CHUNK_BYTES or offset >= self.lengths[row]
                or length != min(CHUNK_BYTES, int(self.lengths[row]) - offset)):
            self._finish(_ucp.code("UCS_ERR_INVALID_PARAM"))
            return
        piece = (row, offset // CHUNK_BYTES)
        if piece in self._landed:
            return
        self._landed.add(piece)
        _serve.memmove(int(self.dst[row]) + offset, data, length)
        self.left -= length
        part = self._parts[bisect.bisect_right(self._starts, row) - 1]
        part.left -= length
        if part.left <= 0:
            self.reads.landed(part)
        if self.left <= 0:
            self._finish(_ucp.code("UCS_OK"))

    def _finish(self, status: int) -> None:
        """No byte lands after this (the batch leaves the table under the worker lock); what it still had
        asked of the source is given back to its lane."""
        if self.over:
            return
        self.over = True
        self.reads.batches.pop(self.id, None)
        if self._status == _ucp.code("UCS_OK"):
            self._status = status
        self.left = 0
        self.reads.over(self)

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
    """Reader side: the batches in flight, the READs asked of each source, and the READ requests UCX
    has not completed yet."""

    def __init__(self, worker: _ucp.Worker) -> None:
        self.worker = worker
        self.batches: dict[int, ServedBatch] = {}
        self._lanes: dict[_ucp.Endpoint, _Lane] = {}
        self._sends: list[tuple[Any, Optional[np.ndarray]]] = []
        worker.set_am_handler(DATA_AM_ID, self._on_data)
        worker.idle_tasks.append(self._pump_due)

    def keep_send(self, request: Any, buffer: Optional[np.ndarray]) -> None:
        self._sends.append((request, buffer))

    # --- pacing (worker lock held) ----------------------------------------------------------------------
    def ask(self, batch: ServedBatch) -> None:
        lane = self._lanes.get(batch.endpoint)
        if lane is None:
            lane = self._lanes[batch.endpoint] = _Lane()
        lane.queue.extend(batch._parts)
        self._pump(batch.endpoint, lane)

    def landed(self, part: _Part) -> None:
        """Every byte of a READ landed: the next ones may be asked."""
        if part.sent:
            self._give_back(part)
            lane = self._lanes.get(part.batch.endpoint)
            if lane is not None:
                lane.backoff_s = 0.0  # the source serves again: a later push-back starts from the shortest pause
            self._pump_for(part.batch.endpoint)

    def over(self, batch: ServedBatch) -> None:
        """A batch finished: its READs not all landed leave its lane (the source counts them until their sends
        completed: ``READ_AHEAD_*`` leave room for that), its READs not sent are dropped."""
        for part in batch._parts:
            if part.sent:
                self._give_back(part)
        lane = self._lanes.get(batch.endpoint)
        if lane is not None:
            if any(part.batch is batch for part in lane.queue):
                lane.queue = deque(part for part in lane.queue if part.batch is not batch)
            self._pump(batch.endpoint, lane)

    def _give_back(self, part: _Part) -> None:
        part.sent = False
        lane = self._lanes.get(part.batch.endpoint)
        if lane is not None:
            lane.reads -= 1
            lane.bytes -= part.bytes
            lane.sends -= part.sends

    def _pump_due(self) -> None:
        """Progress thread, worker lock held: ask again on lanes whose back-pressure pause is over (a lane
        whose every READ was refused has nothing else that would wake it)."""
        if not self._lanes:
            return
        now = time.monotonic()
        for endpoint, lane in list(self._lanes.items()):
            if lane.not_before and now >= lane.not_before and lane.queue:
                self._pump(endpoint, lane)

    def _pushed_back(self, batch: "ServedBatch", first: int) -> bool:
        """The source refused READ ``first`` of ``batch`` for its load (``BACK_PRESSURE``): ask it again after a
        pause that doubles up to ``BACK_PRESSURE_MAX_S`` (the batch's own timeout still bounds the wait).
        False if that READ is not one this batch has asked (the refusal then fails the batch)."""
        part = next((p for p in batch._parts if p.first == first and p.sent), None)
        lane = self._lanes.get(batch.endpoint)
        if part is None or lane is None:
            return False
        self._give_back(part)
        lane.queue.appendleft(part)
        lane.backoff_s = min(BACK_PRESSURE_MAX_S, max(BACK_PRESSURE_MIN_S, 2 * lane.backoff_s))
        lane.not_before = time.monotonic() + lane.backoff_s
        return True

    def _pump_for(self, endpoint: _ucp.Endpoint) -> None:
        lane = self._lanes.get(endpoint)
        if lane is not None:
            self._pump(endpoint, lane)

    def _pump(self, endpoint: _ucp.Endpoint, lane: _Lane) -> None:
        """Ask the source for the next READs while this lane has room (``READ_AHEAD_*``; always one)."""
        if lane.pumping:
            return  # a batch failing inside the loop below: the loop goes on
        lane.pumping = True
        try:
            while lane.queue:
                part = lane.queue[0]
                if part.batch.over:
                    lane.queue.popleft()
                    continue
                if not lane.has_room(part):
                    break
                lane.queue.popleft()
                lane.not_before = 0.0
                batch = part.batch
                try:
                    request = _ucp.send_request(endpoint, READ_AM_ID, _REQUEST.pack(batch.token, batch.id, part.first),
                                                data=part.rows, reply=True)
                except _ucp.UcpError as exc:
                    batch._finish(exc.status)
                    continue
                part.sent = True
                lane.reads += 1
                lane.bytes += part.bytes
                lane.sends += part.sends
                if request is not None:
                    self.keep_send(request, part.rows)
        finally:
            lane.pumping = False
        if not lane.queue and not lane.reads and self._lanes.get(endpoint) is lane:
            del self._lanes[endpoint]

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
            batch_id, row, code, first, asked, limit = _REFUSED.unpack(header)
        elif len(header) == _CHUNK.size:
            batch_id, row, offset = _CHUNK.unpack(header)
        else:
            return
        batch = self.batches.get(batch_id)
        if batch is None:
            return  # a cancelled or finished batch: late chunks land nowhere
        if len(header) == _REFUSED.size:
            if code in BACK_PRESSURE and self._pushed_back(batch, first):
                return  # asked again after a pause: the source is busy or still counts this reader's earlier READs
            reason = refusal_text(code, asked, limit)
            logger.warning("ucx: %s", reason)
            batch._finish(_ucp.ReasonStatus(_ucp.code("UCS_ERR_REJECTED"), reason))
            return
        batch.on_chunk(row, offset, data, length)


def make_batch(reads: ServedReads, endpoint: _ucp.Endpoint, token: bytes, local_base: int, plan: Any) -> ServedBatch:
    return ServedBatch(reads, endpoint, token, local_base, plan.src_offsets, plan.dst_offsets, plan.lengths)
