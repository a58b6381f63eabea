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
read. The producer learns "read done" only after the slot was read, so it cannot free between the two reads without the reader seeing it: a late or zombie reader of
reused blocks fails instead of answering from someone else's KV. Before the producer's
worker pins the lease (the ticket reaches a decode before the next producer step) the slot
still holds an older lease or 0: the blocks are held by vLLM's delayed free, so that is valid.

Both halves are the library's lease-slot guard (``kvxfer.handoff.guard``: ``LeaseSlots``,
``pin_lease``/``revoke_lease`` in the sender, ``LeaseSlotGuard`` and ``lease_holds`` in the
receiver); the scheduler takes its slots from here.
"""

from __future__ import annotations

from kvxfer.handoff.guard import LeaseSlots

__all__ = ["LeaseSlots"]
