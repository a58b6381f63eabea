"""The prefill side: which rooms have pages the decode may read, and when they may be freed.

SGLang's prefill frees a request's pages once its sender polls ``KVPoll.Success`` or
``KVPoll.Failed``. Here that happens only when no read of them can still matter:

* every chunk's pages were read by every decode rank reading the room (one, or with a decode of larger
  attention TP, SGLang's ``required_dst_info_num`` of them): a decode's last read of each chunk is of its
  *lease* slot, and kvxfer's read-done for it (``drain_read_done`` on the lease table) is what marks
  the chunk read by that decode; after the last chunk, read by all, the room is ``Success``;
* a decode reported failure or abort (kvxfer's ``drain_read_failed``, ``KVXFER_FAILED`` from one of the
  room's own decodes naming its lease, or SGLang's ``ABORT``): its reads are over, or their bytes will be
  discarded (the room's other decodes are told);
* a chunk saw neither within twice the transfer timeout (a decode that died or stalls);
* a chunk could not be handed to zmq (the decode's queue full, no connection): at once, since the
  decode must not take the room without it.

Failures the decode did not report itself are sent to it (``KVXFER_REVOKED``: the room, its lease,
this prefill), tried again until zmq takes the frame or the bound passes.

In every case the lease slot is revoked (``-lease``, by ``kvxfer.handoff.guard.LeaseTable``) *before*
SGLang may reuse the pages. A reader checks the slot after its data (``kvxfer.handoff.guard.LeaseSlotGuard``),
so a late reader of reused pages fails its check instead of handing SGLang someone else's KV: freeing on a
timer is safe only because of this.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from kvxfer.handoff.guard import LeaseTable
from kvxfer.integrations.sglang import wire

logger = logging.getLogger(__name__)


@dataclass
class _Reader:
    """One decode rank reading a room: its own lease and its own chunk numbers."""

    endpoint: str
    dummy: bool = False  # SGLang's dummy rank (MLA, prefill TP > decode TP): it reads nothing from this rank
    lease: Optional[tuple[int, int]] = None  # (slot, token)
    next_chunk: int = 0
    announced: dict[int, float] = field(default_factory=dict)  # chunk -> when it was announced


@dataclass
class _Room:
    readers: dict[str, _Reader] = field(default_factory=dict)  # decode endpoint -> its reads
    expected: Optional[int] = None  # decode ranks SGLang pairs with this rank for the room (their metadata says)
    chunks: list[dict[str, Any]] = field(default_factory=list)  # chunks so far, replayed to a reader yet to come
    sent: int = 0  # chunks SGLang has sent for the room
    last_sent: bool = False
    concluded: bool = False
    opened: bool = False  # SGLang made a sender for it (else only the decode's metadata came, so far)
    early_peer: Optional[str] = None  # while only the metadata came: the decode endpoint it is counted for
    since: float = field(default_factory=time.monotonic)

    @property
    def complete(self) -> bool:
        """Every decode rank SGLang pairs with this rank for the room has sent its metadata."""
        return self.expected is not None and len(self.readers) >= self.expected

    def reader_by_lease(self, token: int) -> Optional[_Reader]:
        for reader in self.readers.values():
            if reader.lease is not None and reader.lease[1] == token:
                return reader
        return None


@dataclass
class _Tell:
    """A REVOKED for a decode, sent again until zmq takes it or ``deadline`` passes."""
    endpoint: str
    frames: list[bytes]
    deadline: float
    next_try: float = 0.0


#: Seconds between tries of a REVOKED zmq refused (the decode's queue full, or no connection yet).
TELL_RETRY_S = 0.01


class SourceRooms:
    """Room bookkeeping for one prefill manager; thread-safe (SGLang's scheduler thread sends, the
    listener thread takes the decode's messages, kvxfer's thread drains read-done).

    A room's chunks are numbered 0, 1, ... and handed to zmq in that order, under the lock (chunks
    that came before the decode's metadata are sent, in order, when it comes), so the decode can
    tell a missing chunk from one still on its way. A chunk zmq will not take fails the room at once.

    A room may have several readers: with a decode of larger attention TP, SGLang pairs ``D/P`` decode
    ranks with each prefill rank, and each one's metadata says how many (SGLang's
    ``required_dst_info_num``). Each reader gets every chunk, under its own lease and numbers; the room is
    bootstrapped once all of them sent their metadata, ``Success`` once each read every chunk, and fails
    (every lease revoked, every other reader told) when any of them fails.
    """

    def __init__(self, leases: LeaseTable, *, prefill_key: str, timeout_s: float,
                 send: Callable[[str, list[bytes]], bool],
                 conclude: Callable[[int, bool, Optional[str]], None],
                 max_early: int = 4096, early_s: float = 300.0,
                 busy: Callable[[str, bool], None] = lambda endpoint, busy: None) -> None:
        self._leases = leases
        # (decode endpoint, True) when its first lease here is taken, (endpoint, False) when its last is revoked:
        # the prefill keeps a socket to it and owes it a HELLO only while it has a room in flight (called under
        # the lock, before that first chunk is sent)
        self._busy = busy
        self._leased: dict[str, int] = {}  # decode endpoint -> its leases in flight (bounded by the lease table)
        self._prefill_key = prefill_key
        self.timeout_s = timeout_s  #: the bound on an offered chunk's read-done (read at each expiry check)
        # (endpoint "ip:port", frames) -> whether zmq took them; never blocks, and is called under the lock
        # (it takes only the socket table's lock, never held around a call into this class)
        self._send = send
        self._conclude = conclude  # (room, success, failure reason): SGLang's status
        self._rooms: dict[int, _Room] = {}
        # the decode's metadata for rooms SGLang has no sender for yet: kept at most ``early_s`` (SGLang's
        # bootstrap timeout), at most ``max_early`` of them; when full, the decode endpoint holding the most
        # loses its oldest, so no peer (a stranger's unsigned metadata) can crowd out the others' rooms
        self._max_early, self._early_s = max_early, early_s
        self._early = 0
        self._early_by_peer: dict[str, dict[int, None]] = {}  # endpoint -> its early rooms, oldest first
        self._lock = threading.Lock()
        self._outbox: list[tuple[int, bool, Optional[str]]] = []  # conclusions, told to SGLang outside the lock
        self._tells: dict[tuple[int, str], _Tell] = {}  # (room, decode) -> a REVOKED not handed to zmq yet (bounded)
        self._max_tells = max(64, 2 * max_early)
        self._logged_at: dict[str, float] = {}
        self.counters = {"chunks_announced": 0, "chunks_read": 0, "rooms_succeeded": 0, "rooms_failed": 0,
                         "rooms_timed_out": 0, "stale_reports": 0, "chunks_unsent": 0, "foreign_reports": 0,
                         "early_evicted": 0, "tells_lost": 0, "foreign_metas": 0, "chunk_answers": 0}

    # --- from SGLang ----------------------------------------------------------------------
    def open(self, room: int) -> bool:
        """A sender was made for ``room``; True if the decode's metadata came first (kept). A room id
        reused after its last request concluded starts afresh."""
        with self._lock:
            old = self._rooms.get(room)
            if old is None or old.concluded:
                if old is not None:  # an early room that concluded (aborted) unopened
                    self._early_drop_locked(room, old)
                self._rooms[room] = _Room(opened=True)
                return False
            if not old.opened:
                old.opened = True
                self._early_drop_locked(room, old)
            return old.complete

    def metadata(self, room: int, body: dict[str, Any]) -> bool:
        """A decode rank's destination for ``room``; True when SGLang has a sender for it and every decode rank
        the metadata says to expect (``readers``) has sent its own (the room is then bootstrapped). Metadata
        for a room without a sender is kept for the sender to come, bounded. A ``dummy`` reader (SGLang's,
        for MLA with fewer decode ranks than prefill ranks) counts, and reads nothing here."""
        endpoint, expected, dummy = body["endpoint"], int(body.get("readers") or 1), bool(body.get("dummy"))
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                self._expire_early_locked(time.monotonic())
                if self._early >= self._max_early and not self._evict_early_locked(room, endpoint):
                    return False
                state = self._rooms[room] = _Room()
                self._early_add_locked(room, state, endpoint)
            else:
                why = ("the room is concluded" if state.concluded else
                       "it sent the room's metadata already" if endpoint in state.readers else
                       f"it names {expected} decode ranks, the room's first metadata {state.expected}"
                       if state.expected is not None and expected != state.expected else
                       f"the room's {state.expected} decode rank(s) are {sorted(state.readers)}" if state.complete
                       else None)
                if why is not None:
                    self.counters["foreign_metas"] += 1
                    self._log_limited("meta", logging.WARNING, "kvxfer sglang: room %s: metadata from %s ignored: %s "
                                      "(%d ignored so far)", room, endpoint, why, self.counters["foreign_metas"])
                    return False
            state.expected = expected
            reader = state.readers[endpoint] = _Reader(endpoint, dummy=dummy)
            if not dummy:  # in order, before any chunk SGLang's scheduler sends from now on
                for chunk in state.chunks:
                    self._send_chunk_locked(room, state, reader, chunk)
                    if state.concluded:
                        return False
            if state.complete:
                state.chunks = []  # no reader left to come: nothing more to replay
                self._maybe_done_locked(room, state)
            return state.opened and state.complete

    def _early_add_locked(self, room: int, state: _Room, endpoint: str) -> None:
        state.early_peer = endpoint
        self._early_by_peer.setdefault(endpoint, {})[room] = None
        self._early += 1

    def _early_drop_locked(self, room: int, state: _Room) -> None:
        """``state`` no longer counts as early metadata (its sender came, or it is forgotten)."""
        peer, state.early_peer = state.early_peer, None
        if peer is None:
            return
        rooms = self._early_by_peer.get(peer)
        if rooms is not None:
            rooms.pop(room, None)
            if not rooms:
                del self._early_by_peer[peer]
        self._early -= 1

    def _evict_early_locked(self, room: int, endpoint: str) -> bool:
        """The early table is full: forget the oldest room of the decode endpoint holding the most (the
        oldest among those holding as many); False when there is none to forget."""
        if not self._early_by_peer:
            logger.warning("kvxfer sglang: metadata for room %s dropped: no room may wait for a sender "
                           "(KVXFER_SGLANG_MAX_ROOMS=%d)", room, self._max_early)
            return False
        most = max(len(rooms) for rooms in self._early_by_peer.values())
        oldest = None
        for peer, rooms in self._early_by_peer.items():
            if len(rooms) == most:
                first = next(iter(rooms))
                if oldest is None or self._rooms[first].since < self._rooms[oldest[1]].since:
                    oldest = (peer, first)
        assert oldest is not None
        peer, victim = oldest
        self._early_drop_locked(victim, self._rooms.pop(victim))
        self.counters["early_evicted"] += 1
        self._log_limited("evict", logging.WARNING,
                          "kvxfer sglang: %d rooms wait for a sender (KVXFER_SGLANG_MAX_ROOMS): metadata for room %s "
                          "from %s evicted (that endpoint held the most, %d) to keep room %s from %s (%d evicted so "
                          "far)", self._max_early, victim, peer, most, room, endpoint, self.counters["early_evicted"])
        return True

    def _expire_early_locked(self, now: float) -> None:
        for peer in list(self._early_by_peer):
            for room in list(self._early_by_peer.get(peer, ())):  # oldest first
                state = self._rooms[room]
                if now - state.since <= self._early_s:
                    break
                del self._rooms[room]
                self._early_drop_locked(room, state)

    def add_chunk(self, room: int, pages: np.ndarray, start: int, end: int, last: bool,
                  aux_index: Optional[int], state_indices: Optional[list]) -> None:
        """SGLang sent a chunk of the room: offer it to every reader that sent its metadata (the others get it,
        in order, when theirs comes)."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.concluded:
                return
            chunk = dict(pages=[int(p) for p in pages], start=int(start), end=int(end), last=bool(last),
                         aux_index=None if aux_index is None else int(aux_index),
                         state=None if state_indices is None else
                         [None if x is None else [int(v) for v in np.asarray(x).reshape(-1)] for x in state_indices])
            state.sent += 1
            state.last_sent |= bool(last)
            if not state.complete:
                state.chunks.append(chunk)
            for reader in list(state.readers.values()):
                if not reader.dummy:
                    self._send_chunk_locked(room, state, reader, chunk)
                if state.concluded:
                    return
            self._maybe_done_locked(room, state)

    def _send_chunk_locked(self, room: int, state: _Room, reader: _Reader, chunk: dict[str, Any]) -> None:
        """Number the chunk for ``reader`` and hand it to zmq, under the lock: numbers go out in order. A chunk
        zmq will not take fails the room at once (leases revoked, the decodes told): no decode may miss it."""
        if state.concluded:
            return
        if reader.lease is None:
            reader.lease = self._leases.take()
            if reader.lease is None:
                reason = f"all {self._leases.table.numel()} kvxfer lease slots are in use (raise KVXFER_SGLANG_MAX_ROOMS)"
                self._finish_locked(room, state, False, reason)
                return
            self._leased[reader.endpoint] = self._leased.get(reader.endpoint, 0) + 1
            if self._leased[reader.endpoint] == 1:
                self._busy(reader.endpoint, True)
        number = reader.next_chunk
        reader.next_chunk += 1
        slot, lease = reader.lease
        body = {"room": room, "prefill": self._prefill_key, "chunk": number, "src": chunk["pages"],
                "dst_start": chunk["start"], "dst_end": chunk["end"], "last": chunk["last"], "slot": slot,
                "lease": lease, "aux_index": chunk["aux_index"], "state": chunk["state"]}
        if not self._send(reader.endpoint, wire.encode(wire.CHUNK, body)):
            self.counters["chunks_unsent"] += 1
            reason = (f"chunk {number} of room {room} could not be handed to zmq for the decode {reader.endpoint} (its "
                      "queue is full or there is no connection): the room fails at once, its leases revoked, so no "
                      "decode can take the room without that chunk")
            logger.error("kvxfer sglang: %s", reason)
            self._finish_locked(room, state, False, reason)
            return
        reader.announced[number] = time.monotonic()
        self.counters["chunks_announced"] += 1

    def _maybe_done_locked(self, room: int, state: _Room) -> None:
        """``Success`` once the last chunk was sent, every reader came and each one's read-done for every
        chunk came back (a room of dummy readers only: once its last chunk was sent)."""
        if state.concluded or not state.last_sent or not state.complete:
            return
        if all(r.dummy or (not r.announced and r.next_chunk == state.sent) for r in state.readers.values()):
            self._finish_locked(room, state, True, None)

    def close(self, room: int) -> None:
        """SGLang cleared the sender: forget the room (revoking its lease if it never concluded)."""
        with self._lock:
            state = self._rooms.pop(room, None)
            if state is not None:
                self._early_drop_locked(room, state)
            if state is not None and not state.concluded:
                self._revoke_locked(state)

    def abort(self, room: int, reason: str, *, skip: Optional[str] = None) -> None:
        """Fail the room (SGLang's abort on either side): every reader but ``skip`` (the decode that aborted
        it, when known) is told."""
        with self._lock:
            state = self._rooms.get(room)
            if state is not None and not state.concluded:
                self._finish_locked(room, state, False, reason, skip=skip)

    # --- from kvxfer and the decode ---------------------------------------------------------
    def read_done(self, request_id: str) -> None:
        parsed = _parse_request_id(request_id)
        with self._lock:
            state = self._rooms.get(parsed[0]) if parsed else None
            reader = None if state is None or state.concluded else state.reader_by_lease(parsed[1])
            if reader is None:
                self.counters["stale_reports"] += 1
                return
            if reader.announced.pop(parsed[2], None) is None:
                return
            self.counters["chunks_read"] += 1
            self._maybe_done_locked(parsed[0], state)

    def read_failed(self, request_id: Any, reason: str) -> None:
        parsed = _parse_request_id(str(request_id))
        with self._lock:
            state = self._rooms.get(parsed[0]) if parsed else None
            reader = None if state is None or state.concluded else state.reader_by_lease(parsed[1])
            if reader is None:
                return
            self._finish_locked(parsed[0], state, False, f"the decode {reader.endpoint}'s read failed: {reason}",
                                skip=reader.endpoint)

    def decode_failed(self, room: int, lease: Optional[int], endpoint: str, reason: str,
                      chunk: Optional[int] = None) -> None:
        """A decode's KVXFER_FAILED: taken only from one of the room's decodes (``endpoint``) naming its lease
        (None while it has none), and never when it answers a chunk (``chunk``): that chunk may be a replay of
        the room's own, which the decode (its room done, its read-done not yet drained here) no longer holds.
        Any other (a rank answering a chunk replayed to it, a stale room's report, a stranger) is dropped and
        counted. The room's other decodes are told."""
        if chunk is not None:
            with self._lock:
                self.counters["chunk_answers"] += 1
                self._log_limited("answer", logging.INFO, "kvxfer sglang: decode %s holds no live request for chunk "
                                  "%s of room %s (a replay, or a room it already ended): not the room's failure "
                                  "(%d such answers so far)", endpoint, chunk, room, self.counters["chunk_answers"])
            return
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.concluded:
                self.counters["stale_reports"] += 1
                return
            reader = state.readers.get(endpoint)
            own = None if reader is None or reader.lease is None else reader.lease[1]
            if reader is None or lease != own:
                self.counters["foreign_reports"] += 1
                self._log_limited("foreign", logging.WARNING,
                                  "kvxfer sglang: a FAILED for room %s from %s (lease %s) dropped: the room's decodes "
                                  "are %s, %s (%d dropped so far)", room, endpoint, lease, sorted(state.readers) or
                                  "none yet", "its lease none yet" if reader is not None and own is None else
                                  "each with its own lease", self.counters["foreign_reports"])
                return
            self._finish_locked(room, state, False, f"decode: {reason}", skip=endpoint)

    def expire(self, now: Optional[float] = None) -> None:
        """Fail rooms with a chunk unread past the bound (twice the transfer timeout; lease revoked first);
        drop metadata that waited for a sender past SGLang's bootstrap timeout."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._expire_early_locked(now)
            for room, state in list(self._rooms.items()):
                if state.concluded:
                    continue
                offered = [(when, number, reader.endpoint) for reader in state.readers.values()
                           for number, when in reader.announced.items()]
                if not offered:
                    continue
                oldest, number, endpoint = min(offered)
                if now - oldest > self.timeout_s:
                    self.counters["rooms_timed_out"] += 1
                    self._finish_locked(room, state, False,
                                        f"no read-done from the decode {endpoint} {now - oldest:.1f}s after chunk "
                                        f"{number} was offered (the bound: {self.timeout_s}s, twice the transfer "
                                        "timeout); its lease is revoked, so a late read fails")

    def _finish_locked(self, room: int, state: _Room, success: bool, reason: Optional[str], *,
                       skip: Optional[str] = None) -> None:
        """Conclude the room: every lease revoked before SGLang may reuse a page; on failure every reader but
        ``skip`` (the decode that reported it) is told."""
        state.concluded = True
        self._revoke_locked(state)
        self.counters["rooms_succeeded" if success else "rooms_failed"] += 1
        self._outbox.append((room, success, reason))
        if not success:
            for reader in state.readers.values():
                if not reader.dummy and reader.endpoint != skip:
                    self._tell_locked(room, reader, reason or "failed on the prefill")

    def _revoke_locked(self, state: _Room) -> None:
        """Revoke every lease of the room (once: only while it is not concluded); an endpoint whose last lease
        goes is no longer busy."""
        for reader in state.readers.values():
            if reader.lease is None:
                continue
            self._leases.revoke(*reader.lease)
            left = self._leased.get(reader.endpoint, 0) - 1
            if left > 0:
                self._leased[reader.endpoint] = left
            else:
                self._leased.pop(reader.endpoint, None)
                self._busy(reader.endpoint, False)

    def _tell_locked(self, room: int, reader: _Reader, reason: str) -> None:
        """Queue a REVOKED for one of the room's decodes (sent by ``flush``, again until zmq takes it)."""
        body = {"room": room, "prefill": self._prefill_key, "lease": None if reader.lease is None else reader.lease[1],
                "reason": reason}
        key = (room, reader.endpoint)
        self._tells.pop(key, None)
        if len(self._tells) >= self._max_tells:  # the oldest goes: its decode learns by its own timeout
            lost = next(iter(self._tells))
            del self._tells[lost]
            self.counters["tells_lost"] += 1
            logger.warning("kvxfer sglang: room %s's failure not told to its decode %s: %d others wait to be sent",
                           lost[0], lost[1], self._max_tells)
        self._tells[key] = _Tell(reader.endpoint, wire.encode(wire.REVOKED, body), time.monotonic() + self.timeout_s)

    def flush(self) -> None:
        """Tell SGLang about rooms concluded since the last call, and their decodes about the failed ones
        (a REVOKED zmq refuses is tried again until the bound), outside the lock."""
        with self._lock:
            out, self._outbox = self._outbox, []
        for item in out:
            self._conclude(*item)
        if not self._tells:
            return
        now = time.monotonic()
        with self._lock:
            due = [(key, tell) for key, tell in self._tells.items() if tell.next_try <= now]
        for key, tell in due:
            sent = self._send(tell.endpoint, tell.frames)
            room = key[0]
            with self._lock:
                if self._tells.get(key) is not tell:
                    continue
                if sent:
                    del self._tells[key]
                elif now > tell.deadline:
                    del self._tells[key]
                    self.counters["tells_lost"] += 1
                    logger.error("kvxfer sglang: room %s failed, but its decode %s could not be told for %.1fs; it "
                                 "learns by its own timeout", room, tell.endpoint, self.timeout_s)
                else:
                    tell.next_try = now + TELL_RETRY_S

    def _log_limited(self, what: str, level: int, msg: str, *args: Any) -> None:
        """One line per 10 s per kind of peer-driven event (a flood must not flood the log)."""
        now = time.monotonic()
        if now - self._logged_at.get(what, float("-inf")) > 10.0:
            self._logged_at[what] = now
            logger.log(level, msg, *args)

    # --- introspection ----------------------------------------------------------------------
    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {"rooms": len(self._rooms), "leases_in_use": self._leases.in_use, "busy_decodes": len(self._leased),
                    "early": self._early,
                    "early_peers": len(self._early_by_peer), "tells": len(self._tells)}


def request_id(room: int, lease: int, chunk: int) -> str:
    """The kvxfer request id of one chunk: unique across reused room ids (each gets a fresh lease, and a
    slot's next lease always differs from its last)."""
    return f"{room}/{lease}/{chunk}"


def _parse_request_id(text: str) -> Optional[tuple[int, int, int]]:
    try:
        room, lease, chunk = (int(x) for x in text.split("/"))
    except ValueError:
        return None
    return room, lease, chunk
