"""The prefill side: which rooms have pages the decode may read, and when they may be freed.

SGLang's prefill frees a request's pages once its sender polls ``KVPoll.Success`` or
``KVPoll.Failed``. Here that happens only when no read of them can still matter:

* every chunk's pages were read: the decode's last read of each chunk is of the room's *lease*
  slot, and kvxfer's read-done for it (``drain_read_done`` on the lease table) is what marks
  the chunk read; after the last chunk the room is ``Success``;
* the decode reported failure or abort (kvxfer's ``drain_read_failed``, ``KVXFER_FAILED`` from the
  room's own decode naming the room's lease, or SGLang's ``ABORT``): its reads are over, or their
  bytes will be discarded;
* a chunk saw neither within twice the transfer timeout (a decode that died or stalls);
* a chunk could not be handed to zmq (the decode's queue full, no connection): at once, since the
  decode must not take the room without it.

Failures the decode did not report itself are sent to it (``KVXFER_REVOKED``: the room, its lease,
this prefill), tried again until zmq takes the frame or the bound passes.

In every case the lease slot is revoked (``-lease``) *before* SGLang may reuse the pages. A
reader checks the slot after its data (``kvxfer.handoff.guard.LeaseSlotGuard``), so a late reader of reused pages fails
its check instead of handing SGLang someone else's KV: freeing on a timer is safe only because
of this.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from kvxfer.handoff.guard import LeaseSlots, pin_lease, revoke_lease
from kvxfer.integrations.sglang import wire

logger = logging.getLogger("kvxfer.integrations.sglang")


class LeaseTable:
    """The registered int64 table and its slots (``kvxfer.handoff.guard.LeaseSlots`` with random leases:
    a peer never told a lease cannot name one, and a reused slot never shows its last lease again);
    a slot is pinned when taken."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self._slots = LeaseSlots(table.numel(), random_leases=True)

    def take(self) -> Optional[tuple[int, int]]:
        taken = self._slots.take()
        if taken is not None:
            pin_lease(self.table, *taken)
        return taken

    def revoke(self, slot: int, lease: int) -> None:
        revoke_lease(self.table, slot, lease)
        self._slots.give_back(slot)

    @property
    def in_use(self) -> int:
        return self._slots.in_use


@dataclass
class _Room:
    decode: Optional[dict[str, Any]] = None  # the decode's KVXFER_META body
    lease: Optional[tuple[int, int]] = None  # (slot, token)
    next_chunk: int = 0
    announced: dict[int, float] = field(default_factory=dict)  # chunk -> when it was announced
    last_sent: bool = False
    pending: list[dict[str, Any]] = field(default_factory=list)  # chunks sent before the decode's metadata came
    concluded: bool = False
    opened: bool = False  # SGLang made a sender for it (else only the decode's metadata came, so far)
    early_peer: Optional[str] = None  # while only the metadata came: the decode endpoint it is counted for
    since: float = field(default_factory=time.monotonic)


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
    """

    def __init__(self, leases: LeaseTable, *, prefill_key: str, timeout_s: float,
                 send: Callable[[str, list[bytes]], bool],
                 conclude: Callable[[int, bool, Optional[str]], None],
                 max_early: int = 4096, early_s: float = 300.0) -> None:
        self._leases = leases
        self._prefill_key = prefill_key
        self.timeout_s = timeout_s  #: the bound on an offered chunk's read-done (read at each expiry check)
        # (endpoint "ip:port", frames) -> whether zmq took them; never blocks, and is called under the lock
        # (it takes only SGLang's socket locks, which are never held around a call into this class)
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
        self._tells: dict[int, _Tell] = {}  # room -> the REVOKED its decode has not been handed yet (bounded)
        self._max_tells = max(64, 2 * max_early)
        self._logged_at: dict[str, float] = {}
        self.counters = {"chunks_announced": 0, "chunks_read": 0, "rooms_succeeded": 0, "rooms_failed": 0,
                         "rooms_timed_out": 0, "stale_reports": 0, "chunks_unsent": 0, "foreign_reports": 0,
                         "early_evicted": 0, "tells_lost": 0}

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
            return old.decode is not None

    def metadata(self, room: int, body: dict[str, Any]) -> bool:
        """The decode's destination for ``room``; True when SGLang has a sender for it (the room is then
        bootstrapped). Metadata for a room without a sender is kept for the sender to come, bounded."""
        endpoint = body["endpoint"]
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                self._expire_early_locked(time.monotonic())
                if self._early >= self._max_early and not self._evict_early_locked(room, endpoint):
                    return False
                state = self._rooms[room] = _Room()
                self._early_add_locked(room, state, endpoint)
            elif state.decode is not None and state.decode.get("endpoint") != endpoint:
                self._log_limited("meta", logging.WARNING, "kvxfer sglang: room %s: metadata from %s ignored, the "
                                  "room's decode is %s", room, endpoint, state.decode.get("endpoint"))
                return False
            state.decode = body
            pending, state.pending = state.pending, []
            for chunk in pending:  # in order, before any chunk SGLang's scheduler sends from now on
                self._add_chunk_locked(room, state, **chunk)
            return state.opened

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
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.concluded:
                return
            if state.decode is None:  # sent with the decode's metadata (``metadata``), in order
                state.pending.append(dict(pages=pages, start=start, end=end, last=last, aux_index=aux_index,
                                          state_indices=state_indices))
                return
            self._add_chunk_locked(room, state, pages, start, end, last, aux_index, state_indices)

    def _add_chunk_locked(self, room: int, state: _Room, pages: np.ndarray, start: int, end: int, last: bool,
                          aux_index: Optional[int], state_indices: Optional[list]) -> None:
        """Number the chunk and hand it to zmq, under the lock: numbers go out in order. A chunk zmq will
        not take fails the room at once (lease revoked, the decode told): the decode must never miss it."""
        if state.concluded:
            return
        if state.lease is None:
            state.lease = self._leases.take()
            if state.lease is None:
                reason = f"all {self._leases.table.numel()} kvxfer lease slots are in use (raise KVXFER_SGLANG_MAX_ROOMS)"
                self._finish_locked(room, state, False, reason, tell=True)
                return
        chunk = state.next_chunk
        state.next_chunk += 1
        state.last_sent |= last
        slot, lease = state.lease
        body = {"room": room, "prefill": self._prefill_key, "chunk": chunk, "src": [int(p) for p in pages],
                "dst_start": int(start), "dst_end": int(end), "last": bool(last), "slot": slot, "lease": lease,
                "aux_index": None if aux_index is None else int(aux_index),
                "state": None if state_indices is None else
                [None if s is None else [int(x) for x in np.asarray(s).reshape(-1)] for s in state_indices]}
        endpoint = state.decode["endpoint"]
        if not self._send(endpoint, wire.encode(wire.CHUNK, body)):
            self.counters["chunks_unsent"] += 1
            reason = (f"chunk {chunk} of room {room} could not be handed to zmq for the decode {endpoint} (its queue "
                      "is full or there is no connection): the room fails at once, its lease revoked, so the decode "
                      "cannot take the room without that chunk")
            logger.error("kvxfer sglang: %s", reason)
            self._finish_locked(room, state, False, reason, tell=True)
            return
        state.announced[chunk] = time.monotonic()
        self.counters["chunks_announced"] += 1

    def close(self, room: int) -> None:
        """SGLang cleared the sender: forget the room (revoking its lease if it never concluded)."""
        with self._lock:
            state = self._rooms.pop(room, None)
            if state is not None:
                self._early_drop_locked(room, state)
            if state is not None and state.lease is not None and not state.concluded:
                self._leases.revoke(*state.lease)

    def abort(self, room: int, reason: str, *, tell_decode: bool) -> None:
        with self._lock:
            state = self._rooms.get(room)
            if state is not None and not state.concluded:
                self._finish_locked(room, state, False, reason, tell=tell_decode)

    # --- from kvxfer and the decode ---------------------------------------------------------
    def read_done(self, request_id: str) -> None:
        parsed = _parse_request_id(request_id)
        with self._lock:
            state = self._rooms.get(parsed[0]) if parsed else None
            if state is None or state.lease is None or state.lease[1] != parsed[1] or state.concluded:
                self.counters["stale_reports"] += 1
                return
            if state.announced.pop(parsed[2], None) is None:
                return
            self.counters["chunks_read"] += 1
            if state.last_sent and not state.announced:
                self._finish_locked(parsed[0], state, True, None, tell=False)

    def read_failed(self, request_id: Any, reason: str) -> None:
        parsed = _parse_request_id(str(request_id))
        with self._lock:
            state = self._rooms.get(parsed[0]) if parsed else None
            if state is None or state.concluded or state.lease is None or state.lease[1] != parsed[1]:
                return
            self._finish_locked(parsed[0], state, False, f"the decode's read failed: {reason}", tell=False)

    def decode_failed(self, room: int, lease: Optional[int], endpoint: str, reason: str) -> None:
        """A decode's KVXFER_FAILED: taken only from the room's decode (``endpoint``) naming the room's
        lease (None while the room has none). Any other (a rank answering a chunk replayed to it, a stale
        room's report, a stranger) is dropped and counted."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.concluded:
                self.counters["stale_reports"] += 1
                return
            decode = None if state.decode is None else state.decode.get("endpoint")
            own = None if state.lease is None else state.lease[1]
            if endpoint != decode or lease != own:
                self.counters["foreign_reports"] += 1
                self._log_limited("foreign", logging.WARNING,
                                  "kvxfer sglang: a FAILED for room %s from %s (lease %s) dropped: the room's decode is "
                                  "%s, its lease %s (%d dropped so far)", room, endpoint, lease, decode,
                                  "none yet" if own is None else "another", self.counters["foreign_reports"])
                return
            self._finish_locked(room, state, False, f"decode: {reason}", tell=False)

    def expire(self, now: Optional[float] = None) -> None:
        """Fail rooms with a chunk unread past the bound (twice the transfer timeout; lease revoked first);
        drop metadata that waited for a sender past SGLang's bootstrap timeout."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._expire_early_locked(now)
            for room, state in list(self._rooms.items()):
                if state.concluded or not state.announced:
                    continue
                oldest = min(state.announced.values())
                if now - oldest > self.timeout_s:
                    self.counters["rooms_timed_out"] += 1
                    self._finish_locked(room, state, False,
                                        f"no read-done from the decode {now - oldest:.1f}s after chunk "
                                        f"{min(state.announced)} was offered (the bound: {self.timeout_s}s, twice the transfer timeout); "
                                        "its lease is revoked, so a late read fails", tell=True)

    def _finish_locked(self, room: int, state: _Room, success: bool, reason: Optional[str], *, tell: bool) -> None:
        state.concluded = True
        if state.lease is not None:
            self._leases.revoke(*state.lease)  # before SGLang may reuse a page
        self.counters["rooms_succeeded" if success else "rooms_failed"] += 1
        self._outbox.append((room, success, reason))
        if tell and state.decode is not None:
            self._tell_locked(room, state, reason or "failed on the prefill")

    def _tell_locked(self, room: int, state: _Room, reason: str) -> None:
        """Queue a REVOKED for the room's decode (sent by ``flush``, again until zmq takes it)."""
        body = {"room": room, "prefill": self._prefill_key, "lease": None if state.lease is None else state.lease[1],
                "reason": reason}
        self._tells.pop(room, None)
        if len(self._tells) >= self._max_tells:  # the oldest goes: its decode learns by its own timeout
            lost = next(iter(self._tells))
            del self._tells[lost]
            self.counters["tells_lost"] += 1
            logger.warning("kvxfer sglang: room %s's failure not told to its decode: %d others wait to be sent",
                           lost, self._max_tells)
        self._tells[room] = _Tell(state.decode["endpoint"], wire.encode(wire.REVOKED, body),
                                  time.monotonic() + self.timeout_s)

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
            due = [(room, tell) for room, tell in self._tells.items() if tell.next_try <= now]
        for room, tell in due:
            sent = self._send(tell.endpoint, tell.frames)
            with self._lock:
                if self._tells.get(room) is not tell:
                    continue
                if sent:
                    del self._tells[room]
                elif now > tell.deadline:
                    del self._tells[room]
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
            return {"rooms": len(self._rooms), "leases_in_use": self._leases.in_use, "early": self._early,
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
