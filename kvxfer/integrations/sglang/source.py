"""The prefill side: which rooms have pages the decode may read, and when they may be freed.

SGLang's prefill frees a request's pages once its sender polls ``KVPoll.Success`` or
``KVPoll.Failed``. Here that happens only when no read of them can still matter:

* every chunk's pages were read: the decode's last read of each chunk is of the room's *lease*
  slot, and kvxfer's read-done for it (``drain_read_done`` on the lease table) is what marks
  the chunk read; after the last chunk the room is ``Success``;
* the decode reported failure or abort (kvxfer's ``drain_read_failed``, ``KVXFER_FAILED`` or
  SGLang's ``ABORT``): its reads are over, or their bytes will be discarded;
* a chunk saw neither within twice the transfer timeout (a decode that died or stalls).

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
    """The registered int64 table and its slots (``kvxfer.handoff.guard.LeaseSlots``: ever-growing
    lease tokens, so a reused slot never shows an old token); a slot is pinned when taken."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self._slots = LeaseSlots(table.numel())

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
    since: float = field(default_factory=time.monotonic)


class SourceRooms:
    """Room bookkeeping for one prefill manager; thread-safe (SGLang's scheduler thread sends, the
    listener thread takes the decode's messages, kvxfer's thread drains read-done)."""

    def __init__(self, leases: LeaseTable, *, prefill_key: str, timeout_s: float,
                 send: Callable[[str, list[bytes]], None],
                 conclude: Callable[[int, bool, Optional[str], Optional[str]], None],
                 max_early: int = 4096, early_s: float = 300.0) -> None:
        self._leases = leases
        self._prefill_key = prefill_key
        self.timeout_s = timeout_s  #: the bound on an offered chunk's read-done (read at each expiry check)
        self._send = send  # (endpoint "ip:port", frames)
        self._conclude = conclude  # (room, success, failure reason, endpoint to tell or None)
        self._rooms: dict[int, _Room] = {}
        # the decode's metadata for rooms SGLang has no sender for yet: kept at most ``early_s`` (SGLang's
        # bootstrap timeout), at most ``max_early`` of them (a peer cannot grow the table without bound)
        self._max_early, self._early_s = max_early, early_s
        self._early = 0
        self._lock = threading.Lock()
        self._outbox: list[tuple[int, bool, Optional[str], Optional[str]]] = []  # conclusions, told outside the lock
        self.counters = {"chunks_announced": 0, "chunks_read": 0, "rooms_succeeded": 0, "rooms_failed": 0,
                         "rooms_timed_out": 0, "stale_reports": 0}

    # --- from SGLang ----------------------------------------------------------------------
    def open(self, room: int) -> bool:
        """A sender was made for ``room``; True if the decode's metadata came first (kept). A room id
        reused after its last request concluded starts afresh."""
        with self._lock:
            old = self._rooms.get(room)
            if old is None or old.concluded:
                if old is not None and not old.opened:  # an early room that concluded (aborted) unopened
                    self._early -= 1
                self._rooms[room] = _Room(opened=True)
                return False
            if not old.opened:
                old.opened = True
                self._early -= 1
            return old.decode is not None

    def metadata(self, room: int, body: dict[str, Any]) -> bool:
        """The decode's destination for ``room``; True when SGLang has a sender for it (the room is then
        bootstrapped). Metadata for a room without a sender is kept for the sender to come, bounded."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                self._expire_early_locked(time.monotonic())
                if self._early >= self._max_early:
                    logger.warning("kvxfer sglang: metadata for room %s dropped: %d rooms already wait for a sender "
                                   "(KVXFER_SGLANG_MAX_ROOMS)", room, self._early)
                    return False
                state = self._rooms[room] = _Room()
                self._early += 1
            elif state.decode is not None and state.decode.get("endpoint") != body.get("endpoint"):
                logger.warning("kvxfer sglang: room %s: metadata from %s ignored, the room's decode is %s", room,
                               body.get("endpoint"), state.decode.get("endpoint"))
                return False
            state.decode = body
            pending, state.pending = state.pending, []
            opened = state.opened
        for chunk in pending:
            self.add_chunk(room, **chunk)
        return opened

    def _expire_early_locked(self, now: float) -> None:
        if not self._early:
            return
        for room, state in list(self._rooms.items()):
            if not state.opened and now - state.since > self._early_s:
                del self._rooms[room]
                self._early -= 1

    def add_chunk(self, room: int, pages: np.ndarray, start: int, end: int, last: bool,
                  aux_index: Optional[int], state_indices: Optional[list]) -> None:
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.concluded:
                return
            if state.decode is None:
                state.pending.append(dict(pages=pages, start=start, end=end, last=last, aux_index=aux_index,
                                          state_indices=state_indices))
                return
            if state.lease is None:
                state.lease = self._leases.take()
                if state.lease is None:
                    reason = f"all {self._leases.table.numel()} kvxfer lease slots are in use (raise KVXFER_SGLANG_MAX_ROOMS)"
                    self._finish_locked(room, state, False, reason, tell=True)
                    return
            chunk = state.next_chunk
            state.next_chunk += 1
            state.announced[chunk] = time.monotonic()
            state.last_sent |= last
            slot, lease = state.lease
            body = {"room": room, "prefill": self._prefill_key, "chunk": chunk, "src": [int(p) for p in pages],
                    "dst_start": int(start), "dst_end": int(end), "last": bool(last), "slot": slot, "lease": lease,
                    "aux_index": None if aux_index is None else int(aux_index),
                    "state": None if state_indices is None else
                    [None if s is None else [int(x) for x in np.asarray(s).reshape(-1)] for s in state_indices]}
            endpoint = state.decode["endpoint"]
            self.counters["chunks_announced"] += 1
        self._send(endpoint, wire.encode(wire.CHUNK, body))

    def close(self, room: int) -> None:
        """SGLang cleared the sender: forget the room (revoking its lease if it never concluded)."""
        with self._lock:
            state = self._rooms.pop(room, None)
            if state is not None and not state.opened:
                self._early -= 1
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

    def decode_failed(self, room: int, lease: Optional[int], reason: str) -> None:
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.concluded or (lease is not None and state.lease is not None
                                                     and state.lease[1] != lease):
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
        endpoint = state.decode["endpoint"] if (tell and state.decode is not None) else None
        self._outbox.append((room, success, reason, endpoint))

    def flush(self) -> None:
        """Tell SGLang (and a decode) about rooms concluded since the last call, outside the lock:
        a status message to a dead decode may block."""
        with self._lock:
            out, self._outbox = self._outbox, []
        for item in out:
            self._conclude(*item)

    # --- introspection ----------------------------------------------------------------------
    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {"rooms": len(self._rooms), "leases_in_use": self._leases.in_use, "early": self._early}


def request_id(room: int, lease: int, chunk: int) -> str:
    """The kvxfer request id of one chunk: unique across reused room ids (leases only grow)."""
    return f"{room}/{lease}/{chunk}"


def _parse_request_id(text: str) -> Optional[tuple[int, int, int]]:
    try:
        room, lease, chunk = (int(x) for x in text.split("/"))
    except ValueError:
        return None
    return room, lease, chunk
