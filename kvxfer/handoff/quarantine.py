"""Quarantine: storage a failed read may still write, held until the transport proves it cannot.

A read that failed (timed out, aborted, refused half-way through its start) may still have
bytes on the wire. Its destination (KV blocks, a lease scratch slot, a room's pages) must not
go back to its owner until every handle that could write it is ``storage_safe``: a late byte
landing in storage that now belongs to another request corrupts that request silently. Every
engine adapter holds such storage here, under a key of its own choosing, with the handles and
the reason, and calls ``reclaim`` from its loop to get back what became safe.

``storage_safe`` is flipped by the transport's thread, so ``reclaim`` judges each item exactly
once per call: an item read twice could be counted both released and still held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Hashable, Iterator, Optional, Sequence, TypeVar

from kvxfer.backends.base import TransferHandle

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True)
class Held(Generic[K, V]):
    """One quarantined item: what it is (``key``, ``item``), why, and what may still write it."""

    key: K
    handles: tuple[TransferHandle, ...]
    reason: str
    item: V

    @property
    def safe(self) -> bool:
        """True once no handle can write the item's storage any more (reads each handle once)."""
        return all([h.storage_safe for h in self.handles])


class Quarantine(Generic[K, V]):
    """The table of held items of one adapter, at most ``capacity`` of them (when given).

    The capacity is the storage the adapter guards (its scratch slots, say): holding more
    than that means something was held twice, which is a bug and raised as one. An item
    held with no handles is released by the next ``reclaim``: nothing can still write it.
    """

    def __init__(self, capacity: Optional[int] = None) -> None:
        self.capacity = capacity
        self._held: list[Held[K, V]] = []

    def hold(self, key: K, handles: Sequence[TransferHandle], reason: str, item: V) -> None:
        if self.capacity is not None and len(self._held) >= self.capacity:
            raise RuntimeError(f"quarantine full ({self.capacity} held): {key!r} cannot be held as well")
        self._held.append(Held(key, tuple(handles), reason, item))

    def reclaim(self) -> list[Held[K, V]]:
        """Release and return every item whose handles are all ``storage_safe`` (each judged once)."""
        if not self._held:
            return []
        judged = [(held, held.safe) for held in self._held]
        self._held = [held for held, safe in judged if not safe]
        return [held for held, safe in judged if safe]

    def __contains__(self, key: object) -> bool:
        return any(held.key == key for held in self._held)

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[Held[K, V]]:
        return iter(list(self._held))
