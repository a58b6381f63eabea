"""The decode side: one thread that owns every kvxfer call of a decode manager.

SGLang's decode publishes a request's destination pages (``send_metadata``) and polls. Each
``KVXFER_CHUNK`` the prefill offers becomes, here, one read per registered buffer of exactly
that chunk's pages (kvxfer coalesces runs of adjacent pages into one descriptor), plus the aux
row and state slots with the last chunk, all without read-done; once they are complete, one
read of the room's lease slot carries the read-done to the prefill and proves the pages were
still the room's when they were read (``kvxfer.handoff.guard.lease_holds``). The room is ``Success`` only
when every chunk 0..last passed that check. The prefill numbers a room's chunks and sends them in
order on one zmq connection, so chunk n arriving before chunk n-1 means n-1 is lost (the prefill
could not send it, or the connection was replaced): the room fails at once, naming it.

With a prefill of larger attention TP, or of several pipeline stages, a room is read from several prefill
ranks (SGLang's ``bootstrap_infos``, its dummy MLA pairings left out): each is a *source* with its own lease
and chunk numbers, and the room is ``Success`` only when every source's chunks 0..last passed their checks.
Which bytes of a page come from which source, into which of this decode's buffers, is ``tp.plan_pair``'s
answer for the pair, taken when the source's HELLO comes (whole pages, or each token's run of heads; a
stage's layers into the decode's buffers of those layers). A room read from pipeline stages is read only
if they give every layer of this decode exactly once (``tp.stage_coverage``), checked again before
``Success``. The aux row and state slots are read from the first source only (the last pipeline stage,
which samples the first token: ``KvxferKVReceiver.send_metadata`` orders them); Mamba state across attention
TP sizes is read from every source, each its blocks of the slot (``tp.plan_state``).

Failure reports are bound to the room's prefill: a ``KVXFER_REVOKED`` is taken only from one of the room's
prefill ranks, naming that source's lease (or any while it has none yet), so a report replayed from
another room or sent by another rank cannot end a live room.

A failed read fails its room only once no byte of any of the room's reads can still land
(``storage_safe``): SGLang frees the destination pages as soon as it sees ``KVPoll.Failed``.
Until then the room is quarantined (``unsafe``) and the receiver's ``poll`` reports it as still transferring.

The lifecycle is the library's (``kvxfer.handoff``): each chunk is one ``GuardedRead`` with a
``LeaseSlotGuard`` (the order of the two reads is kept there), and failed or retired rooms wait in
a ``Quarantine``; this module maps rooms and chunks onto them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from kvxfer.backends.transfer import abort_parts
from kvxfer.handoff.guard import (UNREAD, GuardedRead, LeaseSlotGuard, LeaseTarget, Phase, ScratchSlots,
                                  begin_data_read)
from kvxfer.handoff.quarantine import Quarantine
from kvxfer.integrations.sglang import wire
from kvxfer.integrations.sglang.pool import PoolRegistration
from kvxfer.integrations.sglang.source import request_id
from kvxfer.integrations.sglang.tp import plan_pair, stage_coverage

logger = logging.getLogger(__name__)

#: Prefill ranks a decode keeps a HELLO for (those it registered with; the oldest idle one goes first).
MAX_PREFILLS = 4096
#: Chunks kept while their prefill's HELLO is on its way.
MAX_PARKED = 16384
#: Rooms whose end (success or not) a decode remembers, for the chunks that come after it.
MAX_ENDED = 4096
#: Seconds between two registrations a decode sends again to one prefill (a chunk came before the HELLO).
REG_AGAIN_S = 1.0


@dataclass
class _Chunk:
    room: int
    body: dict[str, Any]
    key: str
    data: list[Any] = field(default_factory=list)  # handles, while they are posted
    read: Optional[GuardedRead] = None  # the data reads (once all are posted), then the lease read
    lease: Optional[LeaseSlotGuard] = None  # the lease read of ``read``
    error: Optional[str] = None

    @property
    def handles(self) -> list[Any]:
        """Every read posted for this chunk: what may still write the room's pages or a scratch slot."""
        return self.read.handles if self.read is not None else list(self.data)


@dataclass
class _Source:
    """One prefill rank a room is read from: its lease, its chunks and their numbers."""

    lease: Optional[int] = None
    chunks: dict[int, _Chunk] = field(default_factory=dict)
    next_chunk: int = 0  # the number the next chunk must carry (lower: a repeat, dropped; higher: a gap)
    last: Optional[int] = None  # the number of the chunk marked last, once it came
    judged: int = 0  # chunks whose reads completed and whose lease check passed
    last_done: bool = False
    told: bool = False  # this prefill failed the room itself (KVXFER_REVOKED): no FAILED goes back to it

    @property
    def done(self) -> bool:
        """Chunks are taken only in order (0, 1, ...), each judged before it leaves ``chunks``: with the last
        one judged and none left, every chunk 0..last was read and passed its lease check."""
        return self.last_done and not self.chunks and self.last is not None and self.judged == self.last + 1


@dataclass
class _RoomPull:
    meta: dict[str, Any]  # what send_metadata published: dst pages, aux_index, state_indices
    sources: dict[str, _Source]  # prefill rank key -> its part of the room; the first gives the aux row and state
    failed: Optional[str] = None
    cancelled: bool = False
    retired: bool = False  # its room id went to a new request: settled without telling anyone

    @property
    def chunks(self) -> list[_Chunk]:
        """Every chunk of every source still held (their reads may still land)."""
        return [chunk for source in self.sources.values() for chunk in source.chunks.values()]

    @property
    def first(self) -> str:
        return next(iter(self.sources))


class Puller:
    """Pulls for one decode manager (see the module docstring)."""

    def __init__(self, pool: PoolRegistration, layout: dict[str, Any], *,
                 succeed: Callable[[int], None], fail: Callable[[int, str], None],
                 send: Callable[[str, list[bytes]], Any], endpoint: str, idle_s: float = 0.0005) -> None:
        self._pool = pool
        self._endpoint = endpoint  # this decode's name on the wire: its FAILED reports say who sends them
        self._layout = layout
        self._succeed, self._fail, self._send = succeed, fail, send
        self._idle_s = idle_s
        self._inbox: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        # the prefill ranks this decode registered with (``expect``): their HELLO, None until it comes;
        # a HELLO or CHUNK from any other sender is a stranger's and is dropped
        self._hellos: dict[str, Optional[dict[str, Any]]] = {}
        self._rooms: dict[int, _RoomPull] = {}
        self._parked: list[dict[str, Any]] = []  # chunks whose prefill's HELLO has not come yet
        self._ended: "OrderedDict[int, bool]" = OrderedDict()  # rooms that ended here -> succeeded (``_ended_add``)
        self._asked: dict[str, float] = {}  # prefill -> when a chunk before its HELLO made this decode register again
        self._held: Quarantine[int, _RoomPull] = Quarantine()  # failed and retired rooms with reads that may land
        self._slots = ScratchSlots(pool.table)
        self._lock = threading.Lock()  # guards _held, _announced and the counters for readers on other threads
        self._announced: dict[int, int] = {}  # rooms whose "meta" is posted but not yet taken (how many)
        self._cancelling: set[int] = set()  # rooms with a "cancel" posted and not yet taken
        self.counters = {"chunks_pulled": 0, "rooms_succeeded": 0, "rooms_failed": 0, "lease_revoked": 0,
                         "stale_chunks": 0, "strangers": 0, "chunk_gaps": 0, "revoked": 0, "foreign_reports": 0,
                         "stale_reports": 0, "descriptors": 0,  # descriptors: posted by every read, after merging
                         "hellos": 0}  # HELLOs taken from prefills this decode registered with
        self._foreign_logged_at = float("-inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxfer-sglang-puller", daemon=True)
        self._thread.start()

    # --- from other threads -----------------------------------------------------------------
    def post(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))

    def post_meta(self, room: int, prefills: list[str], meta: dict[str, Any]) -> None:
        """SGLang published ``room``'s destination pages, to be read from ``prefills`` (its prefill ranks for
        the room, in SGLang's order): from now on the room is held (``holds``) until the puller lets go of
        it, even before this thread has taken the message."""
        with self._lock:
            self._announced[room] = self._announced.get(room, 0) + 1
        self.post("meta", (room, list(prefills), meta))

    def cancel(self, room: int) -> None:
        """Abort ``room``'s reads (SGLang polls a held room every step: at most one cancel waits per room)."""
        with self._lock:
            if room in self._cancelling:
                return
            self._cancelling.add(room)
        self.post("cancel", room)

    def holds(self, room: int) -> bool:
        """A read of ``room`` may be posted or still land: SGLang must not free its pages yet."""
        with self._lock:
            announced = room in self._announced
        return announced or self.active(room) or self.unsafe(room)

    def unsafe(self, room: int) -> bool:
        with self._lock:
            return any(held.key == room and not held.item.retired for held in self._held)

    def active(self, room: int) -> bool:
        """The puller still has reads of ``room`` (read from another thread: a dict lookup)."""
        return room in self._rooms

    @property
    def known_prefills(self) -> int:
        """Prefill ranks this decode registered with (bounded by ``MAX_PREFILLS``; kept across requests)."""
        return len(self._hellos)

    def refusal(self, prefill: str) -> Optional[str]:
        hello = self._hellos.get(prefill)
        return None if hello is None else hello.get("refused")

    def sizes(self) -> dict[str, int]:
        with self._lock:
            retired = sum(1 for held in self._held if held.item.retired)
            return {"rooms": len(self._rooms), "retired": retired, "parked": len(self._parked),
                    "unsafe": len(self._held) - retired, "scratch_in_use": self._slots.in_use}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # --- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self._drain_inbox()
                busy |= self._advance()
            except Exception:  # a bug must not end the thread every room of this rank depends on
                logger.exception("kvxfer sglang: the puller hit an unexpected error; going on")
                busy = False
            if not busy:
                time.sleep(self._idle_s)

    def _drain_inbox(self) -> bool:
        got = False
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return got
            got = True
            try:
                getattr(self, f"_on_{kind}")(payload)
            except Exception:
                logger.exception("kvxfer sglang: handling %s failed", kind)

    def _on_expect(self, prefill: str) -> None:
        """This decode registers with ``prefill``: its HELLO will be taken (kept until evicted, oldest idle first)."""
        if prefill in self._hellos:
            return
        self._hellos[prefill] = None
        if len(self._hellos) > MAX_PREFILLS:
            busy = {key for state in self._rooms.values() for key in state.sources}
            for old in [key for key in self._hellos if key not in busy][:len(self._hellos) - MAX_PREFILLS]:
                del self._hellos[old]

    def _ended_add(self, room: int, success: bool) -> None:
        """Remember how ``room`` ended here (bounded, oldest forgotten first): a chunk of it that comes later is a
        replay if it succeeded (dropped), or answered with a FAILED the prefill takes if this decode gave it up."""
        self._ended.pop(room, None)
        self._ended[room] = success
        if len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)

    def _ask_hello(self, prefill: str) -> None:
        """A chunk came from ``prefill`` before its HELLO: register with it again, at most once per
        ``REG_AGAIN_S``. A prefill answers a registration when this decode has a room in flight there
        (``hellos``), which it now has; the first registration may have been dropped from its bounded table."""
        now = time.monotonic()
        if now - self._asked.get(prefill, float("-inf")) < REG_AGAIN_S:
            return
        self._asked[prefill] = now
        if len(self._asked) > MAX_PREFILLS:  # only prefills this decode registered with come here
            self._asked.pop(next(iter(self._asked)))
        self._send(prefill, wire.encode(wire.REG, {"endpoint": self._endpoint, "layout": self._layout}))

    def _on_hello(self, body: dict[str, Any]) -> None:
        if body["prefill"] not in self._hellos:
            self.counters["strangers"] += 1  # not a prefill this decode registered with
            return
        if body.get("metas") is None and not body.get("refused"):
            raise ValueError(f"HELLO from {body['prefill']} carries neither metas nor a refusal")
        self.counters["hellos"] += 1
        refused, plan = body.get("refused"), None
        if not refused:
            refused, plan = plan_pair(body.get("layout") or {}, self._layout)
        if refused:
            logger.error("kvxfer sglang: prefill %s cannot serve this decode: %s", body["prefill"], refused)
        elif plan is not None and not plan.whole_pages:
            logger.info("kvxfer sglang: prefill %s: its heads %s read into this decode's (source head, destination "
                        "head, heads), each token of a page", body["prefill"], plan.heads)
        body = {**body, "refused": refused, "plan": plan}  # the plan stays here: it is this decode's
        self._hellos[body["prefill"]] = body
        parked, self._parked = self._parked, []
        for chunk in parked:
            try:
                self._on_chunk(chunk)
            except Exception:  # one bad chunk must not lose the others
                logger.exception("kvxfer sglang: a parked chunk of room %s could not be taken", chunk.get("room"))
        if refused:
            for room, state in self._rooms.items():
                if body["prefill"] in state.sources and state.failed is None:
                    state.failed = f"kvxfer refused the prefill's layout: {refused}"

    def _on_meta(self, payload: tuple[int, list[str], dict[str, Any]]) -> None:
        room, prefills, meta = payload
        try:
            self._take_meta(room, prefills, meta)
        finally:
            with self._lock:  # taken: the room is in _rooms now (held while it is), so no gap for ``holds``
                left = self._announced.pop(room, 0) - 1
                if left > 0:
                    self._announced[room] = left

    def _take_meta(self, room: int, prefills: list[str], meta: dict[str, Any]) -> None:
        old = self._rooms.get(room)  # replaced below, once it is held: never out of both at once
        if old is not None:
            old.cancelled = True
            self._cancel(old, "room id reused by a new request")
            self._quarantine(room, old)
        with self._lock:
            for held in self._held:
                if held.key == room:
                    held.item.retired = True  # settled (its reads over) without telling SGLang
        state = self._rooms[room] = _RoomPull(meta=meta, sources={key: _Source() for key in prefills})
        if not prefills:
            state.failed = "SGLang named no prefill rank to read this room from"
        for key in prefills:
            refused = self.refusal(key)
            if refused and state.failed is None:
                state.failed = f"kvxfer refused the prefill's layout: {refused}"

    def _drop_parked(self, room: int) -> None:
        if self._parked:
            self._parked = [chunk for chunk in self._parked if int(chunk["room"]) != room]

    def _on_cancel(self, room: int) -> None:
        with self._lock:
            self._cancelling.discard(room)
        self._drop_parked(room)
        state = self._rooms.get(room)
        if state is not None:
            state.cancelled = True
            self._cancel(state, "aborted")
        self._cancel_held(room)

    def _on_clear(self, room: int) -> None:
        self._drop_parked(room)
        state = self._rooms.get(room)
        if state is not None and not state.chunks:  # nothing posted: nothing can land
            del self._rooms[room]
            self._ended_add(room, False)
        elif state is not None:
            state.cancelled = True
            self._cancel(state, "cleared")
        self._cancel_held(room)

    def _cancel_held(self, room: int) -> None:
        """SGLang gave up a room that is quarantined: when it is released, SGLang is not told (the prefill is)."""
        with self._lock:
            for held in self._held:
                if held.key == room:
                    held.item.cancelled = True

    def _on_chunk(self, body: dict[str, Any]) -> None:
        room, prefill = int(body["room"]), body["prefill"]
        if prefill not in self._hellos:
            self.counters["strangers"] += 1  # no reply: a stranger names whom it likes
            return
        hello = self._hellos[prefill]
        if hello is None:
            if len(self._parked) >= MAX_PARKED:  # the room cannot be whole without it: fail it, loudly
                self.counters["stale_chunks"] += 1
                state = self._rooms.get(room)
                if state is not None and prefill in state.sources and state.failed is None:
                    state.failed = (f"chunk {body['chunk']} of room {room} dropped: {MAX_PARKED} chunks already wait "
                                    f"for the HELLO of prefill {prefill}")
                return
            self._parked.append(body)
            self._ask_hello(prefill)
            return
        state = self._rooms.get(room)
        source = None if state is None else state.sources.get(prefill)
        if source is None or state.cancelled or state.failed is not None:
            self.counters["stale_chunks"] += 1
            ended = self._ended.get(room) if state is None else None
            if ended:  # this decode read the room whole: the chunk is a replay (issue 49), no answer
                return
            answer = {"room": room, "lease": body.get("lease"), "endpoint": self._endpoint,
                      "reason": "the decode has no live request for this room"}
            if ended is None and source is None:  # not a room this decode gave up: the answer names the chunk, and
                answer["chunk"] = int(body["chunk"])  # the prefill does not take it as the room's failure
            self._send(prefill, wire.encode(wire.FAILED, answer))
            return
        if source.lease is None:
            source.lease = int(body["lease"])
        elif source.lease != int(body["lease"]):
            self.counters["stale_chunks"] += 1
            return
        number = int(body["chunk"])
        if number < source.next_chunk:  # a repeat (replayed, or a confused peer) would hide the first one's reads
            self.counters["stale_chunks"] += 1
            return
        if number > source.next_chunk or source.last is not None:  # one zmq connection keeps the prefill's order
            self.counters["chunk_gaps"] += 1
            state.failed = (f"chunk {source.next_chunk} of room {room} from {prefill} never came, chunk {number} did "
                            "(the prefill sends them in order on one connection: it could not send that chunk, or the "
                            "connection was replaced); the room cannot be whole" if source.last is None else
                            f"chunk {number} of room {room} from {prefill} came after its last chunk {source.last}")
            logger.error("kvxfer sglang: %s", state.failed)
            return
        source.next_chunk += 1
        if body.get("last"):
            source.last = number
        chunk = _Chunk(room, body, request_id(room, source.lease, number))
        source.chunks[number] = chunk  # from here its reads count for the room's safety
        if hello.get("refused"):
            chunk.error = f"kvxfer refused the prefill's layout: {hello['refused']}"
            return
        uncovered = self._uncovered(state)
        if uncovered:  # pipeline stages that do not give every layer once: nothing of the room is read
            chunk.error = uncovered
            return
        try:
            self._post_data(chunk, state, hello, first=prefill == state.first)
            target = LeaseTarget(hello["metas"]["table"], int(body["slot"]), chunk.key)
        except Exception as exc:  # KVXferError, or a prefill's metas of the wrong shape: this chunk fails alone
            chunk.error = f"{type(exc).__name__}: {exc}"
            abort_parts(chunk.data, chunk.error)
            return
        chunk.lease = LeaseSlotGuard(self._slots, self._pool.table_backend, [target], int(body["lease"]),
                                     pinned_at_offer=True, explain=lambda _, seen: _lease_moved(body, seen))
        chunk.read = GuardedRead(chunk.data, chunk.lease)  # a handle's poll() fails it past its own timeout

    def _on_revoked(self, body: dict[str, Any]) -> None:
        """A prefill failed a room and revoked its lease (``KVXFER_REVOKED``): taken only from one of the room's
        prefill ranks, naming that source's lease (or any while no chunk brought one); the room then fails
        once no read of it can land. Anything else (another prefill's, a replayed one of another incarnation)
        is dropped and counted."""
        room, prefill, lease = int(body["room"]), body["prefill"], body.get("lease")
        state = self._rooms.get(room)
        if state is None:  # concluded here already (or never this decode's)
            self.counters["stale_reports"] += 1
            return
        source = state.sources.get(prefill)
        if source is None or (source.lease is not None and lease != source.lease):
            self.counters["foreign_reports"] += 1
            now = time.monotonic()
            if now - self._foreign_logged_at > 10.0:
                self._foreign_logged_at = now
                logger.warning("kvxfer sglang: a REVOKED for room %s from %s (lease %s) dropped: the room's prefill "
                               "ranks are %s, each with its own lease (%d dropped so far)", room, prefill, lease,
                               sorted(state.sources), self.counters["foreign_reports"])
            return
        self.counters["revoked"] += 1
        source.told = True
        if state.failed is None:
            state.failed = f"the prefill failed the room: {body.get('reason') or 'no reason given'}"

    def _post_data(self, chunk: _Chunk, state: _RoomPull, hello: dict[str, Any], *, first: bool) -> None:
        """Post the chunk's data reads (no read-done): its pages of every KV buffer (whole, or the head runs
        ``hello``'s plan names), and with the last chunk of the ``first`` source the aux row and state slots."""
        body, meta, metas, plan = chunk.body, state.meta, hello["metas"], hello.get("plan")
        src = [int(p) for p in body["src"]]
        dst = meta["dst_pages"][int(body["dst_start"]):int(body["dst_end"])]
        if len(src) != len(dst):
            raise ValueError(f"chunk {body['chunk']} of room {chunk.room}: {len(src)} source pages for "
                             f"{len(dst)} destination pages (slice {body['dst_start']}:{body['dst_end']})")
        by_buffer = {"kv": _by_buffer(metas["kv"]), "aux": _by_buffer(metas["aux"])}
        if src:  # each of the prefill's KV buffers into the decode's buffer of that layer (another one for a PP stage)
            pairs = plan.pairs() if plan is not None else [(i, i) for i in range(len(self._pool.kv_regions))]
            for s_index, d_index in pairs:
                region = self._pool.kv_regions[d_index]
                parts = None if plan is None else plan.parts[s_index]
                chunk.data.append(begin_data_read(self._pool.backend(region), by_buffer["kv"][s_index], src, dst,
                                                  request_id=chunk.key, parts=parts))
        if first and body.get("aux_index") is not None and meta.get("aux_index") is not None:
            for region in self._pool.aux_regions:
                chunk.data.append(begin_data_read(
                    self._pool.backend(region), by_buffer["aux"][region.buffers[0]], [int(body["aux_index"])],
                    [int(meta["aux_index"])], request_id=chunk.key))
        # state slots: whole, from the first source; across attention TP sizes (``plan.state``), each source's
        # blocks of the slot (one prefill rank: this decode rank's window; several: each its shard)
        sliced = None if plan is None else plan.state
        for c, src_slots in enumerate((body.get("state") or []) if first or sliced is not None else []):
            dst_slots = (meta.get("state_indices") or [])[c] if c < len(meta.get("state_indices") or []) else None
            if not src_slots or not dst_slots:
                continue
            comp_metas = _by_buffer(metas["state"][c])
            for region in self._pool.state_regions[c]:
                parts = None if sliced is None else sliced.parts[c][region.buffers[0]]
                chunk.data.append(begin_data_read(self._pool.backend(region), comp_metas[region.buffers[0]],
                                                  list(src_slots), list(dst_slots), request_id=chunk.key,
                                                  parts=parts))
        self.counters["descriptors"] += sum(int(getattr(h, "descriptors_posted", 0)) for h in chunk.data)

    def _advance(self) -> bool:
        busy = False
        for room, state in list(self._rooms.items()):
            for source in state.sources.values():
                for idx, chunk in list(source.chunks.items()):
                    busy |= self._step(state, chunk)
                    if chunk.error is not None and state.failed is None:
                        state.failed = chunk.error
                    if chunk.error is None and chunk.read is not None and chunk.read.phase is Phase.JUDGED:
                        del source.chunks[idx]
                        self.counters["chunks_pulled"] += 1
                        source.judged += 1
                        if chunk.body.get("last"):
                            source.last_done = True
            busy |= self._settle(room, state)
        with self._lock:
            released = self._held.reclaim()
        for held in released:
            self._release(held.key, held.item)
        return busy or bool(released)

    def _step(self, state: _RoomPull, chunk: _Chunk) -> bool:
        """Move one chunk on; True if anything happened."""
        if chunk.error is not None or state.failed is not None or state.cancelled:
            if chunk.error is None:
                chunk.error = state.failed or "cancelled"
            abort_parts(chunk.handles, chunk.error)
            return False
        read = chunk.read
        if read is None:  # its construction failed without saying why: fail it, its posted reads aborted
            chunk.error = "the chunk's reads could not be set up"
            abort_parts(chunk.handles, chunk.error)
            return True
        before = read.phase
        try:
            if not read.poll():
                return read.phase is not before  # the lease read was posted (or every scratch slot is busy)
        except Exception as exc:  # KVXferError from a read; anything else fails this chunk, not the thread
            chunk.error = f"{type(exc).__name__}: {exc}"
            return True
        if read.verdict is not None:
            self.counters["lease_revoked"] += 1
            chunk.error = read.verdict
        return True

    def _uncovered(self, state: _RoomPull) -> Optional[str]:
        """Why the room's sources, once every one's HELLO is in, do not give each decode layer exactly once (a
        prefill of PP > 1: ``tp.stage_coverage``); None until then, and for sources that are no stages."""
        plans = [(key, (self._hellos.get(key) or {}).get("plan")) for key in state.sources]
        if any(plan is None for _, plan in plans):
            return None
        why = stage_coverage(plans, self._layout)
        return None if why is None else f"kvxfer refused the prefill's pipeline stages: {why}"

    def _settle(self, room: int, state: _RoomPull) -> bool:
        if state.failed is None and not state.cancelled:
            if all(source.done for source in state.sources.values()):  # every source's chunks 0..last judged
                uncovered = self._uncovered(state) or (
                    None if all((self._hellos.get(key) or {}).get("plan") is not None for key in state.sources)
                    else "a prefill rank's layout is unknown")
                if uncovered:  # never Success with a layer nobody read
                    state.failed = uncovered
                    return True
                del self._rooms[room]
                self._ended_add(room, True)
                self.counters["rooms_succeeded"] += 1
                self._succeed(room)
                return True
            return False
        for chunk in state.chunks:
            abort_parts(chunk.handles, chunk.error or state.failed or "cancelled")
        safe = all(h.storage_safe for c in state.chunks for h in c.handles)
        if not safe:  # held before it leaves the rooms: ``holds`` always sees it active or unsafe
            self._quarantine(room, state)
        del self._rooms[room]
        self._ended_add(room, False)
        if safe:
            self._release(room, state)
        return True

    def _quarantine(self, room: int, state: _RoomPull) -> None:
        """Hold a failed or retired room until no byte of its reads can land (its scratch slots too)."""
        with self._lock:
            self._held.hold(room, [h for c in state.chunks for h in c.handles],
                            state.failed or "cancelled", state)

    def _release(self, room: int, state: _RoomPull) -> None:
        """No read of ``state`` can land any more: its scratch slots back, and (unless its room id went to
        a new request) SGLang and the prefill told."""
        for chunk in state.chunks:
            if chunk.lease is not None:
                chunk.lease.drop(chunk.error or "settled")
        if state.retired:
            return
        if not state.cancelled:
            self.counters["rooms_failed"] += 1
            self._fail(room, state.failed or "failed")
        for key, source in state.sources.items():
            if not source.told:  # a prefill that failed it itself needs no telling
                self._send(key, wire.encode(wire.FAILED, {"room": room, "lease": source.lease,
                                                          "endpoint": self._endpoint,
                                                          "reason": state.failed or "aborted by the decode"}))

    def _cancel(self, state: _RoomPull, reason: str) -> None:
        for chunk in state.chunks:
            if chunk.error is None:
                chunk.error = reason
            abort_parts(chunk.handles, reason)
        if state.failed is None:
            state.failed = reason


def _lease_moved(body: dict[str, Any], seen: int) -> str:
    """Why a chunk's lease check failed, without the value the slot showed: that is another room's live
    lease, which a report must not carry to whoever reads it (an unsigned chunk naming it would pass)."""
    lease = int(body["lease"])
    now = ("revoked" if seen == -lease else "not pinned" if seen == 0 else "unread" if seen == UNREAD
           else "another lease")
    return (f"chunk {body['chunk']}'s lease check failed: slot {body['slot']} shows {now}, not the chunk's lease (the "
            "prefill gave the pages back before they were read, or the chunk named a lease it was never given); "
            "the bytes are discarded")


def _by_buffer(entries: list) -> dict[int, dict[str, Any]]:
    return {int(buffers[0]): meta for buffers, meta in entries}

