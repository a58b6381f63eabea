"""Leases: how a producer may free exported blocks without a read-done, and a reader still never
admits reused bytes.

vLLM frees an exported request's blocks when the connector reports it in
``finished_sending``. kvxfer's rule (``docs/reliability.md``) is that a timer alone must never
do that: a reader that is slow, paused or cut off can still be reading. So each export holds
a *lease*: a slot in a small int64 table the producer registers beside its KV pool, and a
token, both chosen by the producer's scheduler and written into the signed ticket.

Producer worker: on pinning, ``table[slot] = lease``; on releasing (read-done, read-failed,
or ``pin_grace_s`` without either) ``table[slot] = -lease`` *before* the request goes to
``finished_sending``. Tokens grow with every export, so a slot's later lease is larger.

Reader: it reads the data first (no read-done), then the slot (carrying the read-done), and
accepts the data only if the slot says the lease was not released when the data had been
read (``lease_holds``). The producer learns "read done" only after the slot was read, so it
cannot free between the two reads without the reader seeing it: a late or zombie reader of
reused blocks fails instead of answering from someone else's KV. Before the producer's
worker pins the lease (the ticket reaches a decode before the next producer step) the slot
still holds an older lease or 0: the blocks are held by vLLM's delayed free, so that is valid.
"""

from __future__ import annotations


def lease_holds(seen: int, lease: int) -> bool:
    """True when slot value ``seen`` proves lease ``lease`` had not been released.

    ``seen == lease``: pinned. ``|seen| < lease``: an older lease (or 0), so ours is not pinned
    yet and vLLM still holds the blocks. ``seen == -lease`` (released) or ``|seen| > lease``
    (the slot was reused by a later export): the blocks may have been reused.
    """
    return seen == lease or abs(seen) < lease


class LeaseSlots:
    """Scheduler side of a producer: which slots are free, and the next (larger) token."""

    def __init__(self, num_slots: int, first_token: int = 1) -> None:
        self._free = list(range(num_slots - 1, -1, -1))
        self._next = first_token
        self.num_slots = num_slots

    def take(self) -> tuple[int, int] | None:
        """``(slot, lease)`` for a new export, or None when every slot is held."""
        if not self._free:
            return None
        slot, lease = self._free.pop(), self._next
        self._next += 1
        return slot, lease

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def in_use(self) -> int:
        return self.num_slots - len(self._free)
