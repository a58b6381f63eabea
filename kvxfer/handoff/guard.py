"""The guard read: how a reader proves the bytes it read were still the request's.

A producer may reuse a block the moment it learns "read done", and sometimes earlier (a
reader presumed dead, a lease that ran out). So a reader never trusts its data read alone:

1. it reads the data *without* a read-done (``begin_data_read``);
2. strictly after every data read completed, it reads a small guard (``Guard.post``), and that
   read carries the read-done;
3. it judges what the guard read showed (``Guard.judge``): a guard that moved means the
   producer gave the blocks back before the data was read, and the bytes are discarded.

Because the producer hears "read done" only after the guard was read, it cannot free between
the two reads unseen: a failed guard is always a real reuse, never a false alarm. The order is
kept by ``GuardedRead``; adapters post data reads only through ``begin_data_read`` and guard
reads only through a ``Guard`` that ``GuardedRead`` drives. One exception, which keeps the same
order in the transport: a backend that can chain (ucx: ``begin_chained_pull``) posts the guard
read itself from the completion of the last data read, in C, never after a failed one, and
sends the read-done after it; ``ChainedLeaseGuard`` then has nothing to post and only judges.

Two flavours behind the one ``Guard`` interface:

* ``CounterGuard``: per-block generation counters (``kvxfer.handoff.generations``), bumped by
  the producer on every free; the guard must show the counters the descriptor carried.
* ``LeaseSlotGuard``: one slot of a producer's lease table per request (the vLLM connector,
  SGLang's backend), taken from ``LeaseSlots``, pinned (``pin_lease``) and revoked
  (``revoke_lease``) before the blocks go back (``LeaseTable`` does all three for a producer
  that takes and writes its slots in one process); the guard must show the lease held
  (``lease_holds``). The reader's copies land in ``ScratchSlots``. ``ChainedLeaseGuard`` is the
  same check for one producer whose slot the transport read behind the data.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Optional, Protocol, Sequence

import numpy as np
import torch

from kvxfer.backends.base import RequestId, TransferHandle, TransferStartError, abort_parts
from kvxfer.handoff.quarantine import Quarantine
from kvxfer.plan.descriptors import IdList

#: what a reader's copy of a guard holds before the guard read lands: matches no counter and
#: no lease, so a read that "completed" without writing it can never pass
UNREAD = -(1 << 62)


def begin_data_read(backend: Any, peer_meta: Mapping[str, Any], src_block_ids: IdList, dst_block_ids: IdList, *,
                    request_id: RequestId, parts: Optional[Sequence[Any]] = None) -> TransferHandle:
    """Post a guarded request's data read: never with a read-done (the guard read carries it).
    ``parts``: only these byte ranges of each block (``begin_pull_blocks``)."""
    extra = {} if parts is None else {"parts": parts}  # a backend of the contract before ``parts`` still posts
    return backend.begin_pull_blocks(peer_meta, src_block_ids, dst_block_ids, request_id=request_id, notify=False,
                                     **extra)


class Guard(Protocol):
    """One flavour of guard read, driven by ``GuardedRead``."""

    def post(self) -> Optional[Sequence[TransferHandle]]:
        """Post the guard read(s), carrying the read-done; None when it cannot be posted yet (no
        scratch free: ``GuardedRead`` asks again on its next poll). Raises if the start failed."""

    def judge(self) -> Optional[str]:
        """After the guard read completed: None if the data read was of the request's blocks,
        else why its bytes must be discarded."""


class Phase(enum.Enum):
    DATA = "data"        #: data reads in flight
    WAITING = "waiting"  #: data complete; the guard read not posted yet (or its start failed)
    GUARD = "guard"      #: guard read(s) in flight
    JUDGED = "judged"    #: the guard read completed and was judged: ``GuardedRead.verdict``


class GuardedRead:
    """One reader's data reads, then its guard read, then the verdict: in that order only.

    ``poll`` raises what the failing read raises; ``phase`` then says which read it was
    (``DATA``: a data read; ``WAITING``: the guard read's start; ``GUARD``: the guard read).
    """

    def __init__(self, data: Sequence[TransferHandle], guard: Guard, *,
                 poll: Callable[[TransferHandle], bool] = lambda handle: handle.poll()) -> None:
        self.data = tuple(data)
        self.guard = guard
        self.guard_handles: Optional[tuple[TransferHandle, ...]] = None
        self.phase = Phase.DATA
        self.verdict: Optional[str] = None
        self._poll = poll

    def poll(self) -> bool:
        """True once the guard read completed and ``verdict`` is set; never blocks."""
        if self.phase is Phase.DATA:
            if not all([self._poll(h) for h in self.data]):
                return False
            self.phase = Phase.WAITING
        if self.phase is Phase.WAITING:
            posted = self.guard.post()
            if posted is None:
                return False
            self.guard_handles = tuple(posted)
            self.phase = Phase.GUARD
        if self.phase is Phase.GUARD:
            assert self.guard_handles is not None
            if not all([self._poll(h) for h in self.guard_handles]):
                return False
            self.verdict = self.guard.judge()
            self.phase = Phase.JUDGED
        return True

    @property
    def handles(self) -> list[TransferHandle]:
        """Every read posted so far: what may still write the reader's storage."""
        return [*self.data, *(self.guard_handles or ())]


# --- the generation-counter flavour ----------------------------------------------------------------
class CounterGuard:
    """Reads the producer's generation counters of the blocks read into ``scratch`` at the
    destination ids (they belong to exactly one request in flight, so checks never share a slot)."""

    def __init__(self, scratch: torch.Tensor, registration: Any, peer_meta: Mapping[str, Any], src_ids: np.ndarray,
                 dst_ids: np.ndarray, expected: np.ndarray, request_id: RequestId) -> None:
        self._scratch, self._registration, self._meta = scratch, registration, peer_meta
        self._src_ids, self._dst_ids, self._expected = src_ids, dst_ids, expected
        self._request_id = request_id

    def post(self) -> list[TransferHandle]:
        self._scratch[torch.as_tensor(self._dst_ids)] = UNREAD
        return [self._registration.begin_pull_blocks(self._meta, self._src_ids, self._dst_ids,
                                                     request_id=self._request_id)]

    def judge(self) -> Optional[str]:
        seen = self._scratch[torch.as_tensor(self._dst_ids)].numpy()
        moved = np.flatnonzero(seen != self._expected)
        if not moved.size:
            return None
        blocks = self._src_ids[moved][:8].tolist()
        return (f"request {self._request_id!r}: source blocks {blocks} were freed or reused during the transfer "
                f"({moved.size} of {self._src_ids.size} changed generation); the pulled bytes are discarded")


# --- the lease-slot flavour ------------------------------------------------------------------------
def lease_holds(seen: int, lease: int, *, pinned_at_offer: bool = False) -> bool:
    """True when a lease slot read as ``seen`` proves ``lease`` had not been released.

    ``seen == lease``: pinned. With ``pinned_at_offer`` (SGLang: the slot is written before the
    request is offered) nothing else holds, and the rule needs no order among leases (SGLang's are
    random: ``LeaseSlots(random_leases=True)``). Without (vLLM: the ticket may reach the reader before
    the producer's worker pins), ``|seen| < lease`` also holds: an older lease (or 0), so ours is
    not pinned yet and the engine still holds the blocks; that needs leases that grow (``LeaseSlots``
    ordered). ``seen == -lease`` (released) or ``|seen| > lease`` (the slot went to a later export)
    never hold: the blocks may be reused.
    """
    return seen == lease or (not pinned_at_offer and abs(seen) < lease)


class LeaseSlots:
    """A producer's lease slots: which are free, and each new export's lease (a positive int63;
    ``-lease`` in the table marks it revoked). Two kinds of lease, chosen by the reader's rule:

    * ordered (the default; vLLM, whose reader takes ``|seen| < lease`` as "an older lease, ours not
      pinned yet": ``lease_holds`` without ``pinned_at_offer``): tokens grow with every take, so a
      slot's later lease is always larger, and a reader of an old lease sees it moved;
    * ``random_leases`` (SGLang, whose slot is pinned before the offer and whose reader takes only the
      exact lease): each lease is a fresh random 63-bit value from ``secrets`` and the slot a random free
      one, so a peer that was never told a lease cannot name one (unsigned frames carry it); a slot's
      next lease always differs from its last, so a reader of the old one sees it moved.
    """

    def __init__(self, num_slots: int, first_token: int = 1, *, random_leases: bool = False) -> None:
        self._free = list(range(num_slots - 1, -1, -1))
        self._next = first_token
        self.num_slots = num_slots
        self.random_leases = random_leases
        self._last = [0] * num_slots if random_leases else None  # each slot's last lease (random mode)

    def take(self) -> Optional[tuple[int, int]]:
        """``(slot, lease)`` for a new export, or None when every slot is held."""
        if not self._free:
            return None
        if self._last is None:
            slot, lease = self._free.pop(), self._next
            self._next += 1
            return slot, lease
        pick = secrets.randbelow(len(self._free))  # a random free slot: swap it to the end, then pop
        self._free[pick], self._free[-1] = self._free[-1], self._free[pick]
        slot = self._free.pop()
        lease = _random_lease()
        while lease == self._last[slot]:
            lease = _random_lease()
        self._last[slot] = lease
        return slot, lease

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def in_use(self) -> int:
        return self.num_slots - len(self._free)


def _random_lease() -> int:
    """A lease no peer can guess: uniform in [1, 2**63), never one whose revocation reads as ``UNREAD``."""
    while True:
        lease = secrets.randbits(63)
        if lease and -lease != UNREAD:
            return lease


def pin_lease(table: torch.Tensor, slot: int, lease: int) -> None:
    """Producer: the blocks of ``lease`` are held; a reader's guard read of ``slot`` will pass."""
    table[slot] = lease


def revoke_lease(table: torch.Tensor, slot: int, lease: int) -> None:
    """Producer: ``lease`` is over. Call *before* the blocks go back to the engine: a reader that
    reads the slot afterwards fails its guard instead of trusting reused blocks."""
    table[slot] = -lease


class LeaseTable:
    """A producer's registered int64 lease table and its ``LeaseSlots``, kept together where one
    process both takes a slot and writes it (SGLang's prefill): ``take`` pins the lease as it hands it
    out, ``revoke`` revokes it and frees the slot (call it *before* the blocks go back). Its leases are
    random (``LeaseSlots(random_leases=True)``): pinned when taken, a slot needs no order among leases
    (a reader's ``lease_holds(..., pinned_at_offer=True)``), a peer never told a lease cannot name
    one, and a reused slot never shows its last lease again."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self._slots = LeaseSlots(table.numel(), random_leases=True)

    def take(self) -> Optional[tuple[int, int]]:
        """``(slot, lease)``, already pinned, or None when every slot is held."""
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


class ScratchSlots:
    """A reader's lease scratch: one int64 slot per lease read in flight.

    A slot follows its read: it is free again when the read completed, and when the read
    failed only once no byte can still land in it (``storage_safe``); until then it is
    quarantined with the handles that could still write it, and ``reclaim`` (every step)
    returns it as soon as they are safe. A slot is never handed out while a byte may land.
    """

    def __init__(self, scratch: torch.Tensor) -> None:
        self.tensor = scratch
        # host scratch is written and read through numpy: a torch element access costs ~10 us
        self._values = scratch.numpy() if scratch.device.type == "cpu" else scratch
        self._free = list(range(scratch.numel() - 1, -1, -1))
        self._held: Quarantine[int, None] = Quarantine(capacity=scratch.numel())
        # where slot 0 lies in host memory, asked of torch once (the scratch never moves)
        self._base = scratch.data_ptr() if scratch.device.type == "cpu" else None
        self._item = scratch.element_size()
        self.lost = 0  # slots a failed start left unsafe with nothing to ask: never reused

    def take(self) -> Optional[int]:
        if not self._free:
            return None
        slot = self._free.pop()
        self._values[slot] = UNREAD
        return slot

    def value(self, slot: int) -> int:
        """What the lease read left in ``slot``."""
        return int(self._values[slot])

    def address(self, slot: int) -> Optional[int]:
        """Where ``slot`` lies in this process's host memory (for a transport's chained read); None
        when the scratch is device memory."""
        return None if self._base is None else self._base + slot * self._item

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    def quarantine(self, slot: int, handles: Sequence[TransferHandle]) -> None:
        if handles:
            self._held.hold(slot, handles, "a failed lease read may still land", None)
        else:
            self.lost += 1

    def reclaim(self) -> list[int]:
        """The quarantined slots free again since the last call (each judged once)."""
        back = [held.key for held in self._held.reclaim()]
        self._free.extend(back)
        return back

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.tensor.numel() - len(self._free)

    @property
    def quarantined(self) -> int:
        return len(self._held)


@dataclass(frozen=True)
class LeaseTarget:
    """One producer (rank) whose lease slot a reader reads."""

    meta: Any  #: the producer's lease table meta, or its ``PreparedPeer``
    slot: int                #: the producer's slot of this request
    request_id: RequestId    #: the read-done's label
    name: Hashable = None    #: how a verdict names it (vLLM: the prefill rank)
    checked: bool = True     #: its value judges the data (False: read only to tell it "done")


class LeaseSlotGuard:
    """Reads each target's lease slot into a scratch slot; holds when every checked slot shows
    ``lease`` held. ``explain(name, seen)`` words a failed check as the adapter reports it."""

    def __init__(self, slots: ScratchSlots, backend: Any, targets: Sequence[LeaseTarget], lease: int, *,
                 pinned_at_offer: bool, explain: Callable[[Hashable, int], str]) -> None:
        self.slots = slots
        self._backend = backend
        self._targets = list(targets)
        self._lease = lease
        self._pinned_at_offer = pinned_at_offer
        self._explain = explain
        self._posted: list[tuple[TransferHandle, int, LeaseTarget]] = []

    def post(self) -> Optional[list[TransferHandle]]:
        if self.slots.free < len(self._targets):
            return None
        for target in self._targets:
            slot = self.slots.take()
            assert slot is not None
            try:
                handle = self._backend.begin_pull_blocks(target.meta, [target.slot], [slot],
                                                         request_id=target.request_id)
            except Exception as exc:  # KVXferError by the backend contract; anything else must not leak the slot
                if isinstance(exc, TransferStartError) and not exc.storage_safe:
                    self.slots.quarantine(slot, exc.cleanup_handles)  # back once those are safe
                else:
                    self.slots.give_back(slot)
                if self._posted:  # the ones posted still tell their producers; their outcome is not awaited
                    self.drop(f"request {target.request_id!r}: a sibling lease read failed to start")
                raise
            self._posted.append((handle, slot, target))
        return [handle for handle, _, _ in self._posted]

    def judge(self) -> Optional[str]:
        seen = {target.name: (self.slots.value(slot), target.checked) for _, slot, target in self._posted}
        for _, slot, _ in self._posted:
            self.slots.give_back(slot)
        self._posted = []
        for name, (value, checked) in sorted(seen.items()):
            if checked and not lease_holds(value, self._lease, pinned_at_offer=self._pinned_at_offer):
                return self._explain(name, value)
        return None

    def drop(self, reason: str) -> None:
        """Give back the scratch slots of the lease reads posted: at once where no byte can land,
        else once the transport proves it (aborting those still in flight)."""
        abort_parts([handle for handle, _, _ in self._posted], reason)
        for handle, slot, _ in self._posted:
            if handle.storage_safe:
                self.slots.give_back(slot)
            else:
                self.slots.quarantine(slot, [handle])
        self._posted = []


class ChainedLeaseGuard:
    """``LeaseSlotGuard`` for one producer whose lease slot the transport reads itself, chained
    behind the data read (``KVTransportBackend.begin_chained_pull``: posted in the transport the
    moment the data landed, never if it failed, and carrying the read-done). The order is then the
    transport's to keep, so there is nothing left to post: ``GuardedRead`` finds the guard read when
    the data handle completes, and judges it here. The scratch slot was taken before the data read
    was posted (``handle`` writes it); ``drop`` holds it with that handle until no byte can land."""

    def __init__(self, slots: ScratchSlots, slot: int, handle: TransferHandle, lease: int, name: Hashable, *,
                 pinned_at_offer: bool, explain: Callable[[Hashable, int], str]) -> None:
        self.slots = slots
        self.slot: Optional[int] = slot  # None once given back or quarantined
        self._handle = handle
        self._lease = lease
        self._name = name
        self._pinned_at_offer = pinned_at_offer
        self._explain = explain

    def post(self) -> list[TransferHandle]:
        return []  # read by the transport, behind the data

    def judge(self) -> Optional[str]:
        assert self.slot is not None
        seen = self.slots.value(self.slot)
        self.slots.give_back(self.slot)
        self.slot = None
        if not lease_holds(seen, self._lease, pinned_at_offer=self._pinned_at_offer):
            return self._explain(self._name, seen)
        return None

    def drop(self, reason: str) -> None:
        """The slot back at once where no byte can land in it any more, else held with the chained
        read (aborted if still in flight) until the transport proves it."""
        if self.slot is None:
            return
        if abort_parts([self._handle], reason):
            self.slots.give_back(self.slot)
        else:
            self.slots.quarantine(self.slot, [self._handle])
        self.slot = None
