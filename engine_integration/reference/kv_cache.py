"""The paged KV pool's bookkeeping: a block allocator with prefix hashing and pins.

Three counts decide whether a block may be reused:
- ``refs``: requests (or reservations) using the block;
- ``pins``: handoffs whose reader may still read the block (prefill side);
- a block with neither is free. A free block that holds a *full* prompt block keeps
  its hash and stays findable by prefix lookups until it is evicted (LRU), which is
  what lets a later request with the same prefix skip recomputing or re-pulling it.
A request's blocks are freed deepest first, so the LRU evicts a prefix from its end: a
lookup walks a chain from its first block, and evicting that first block would make every
later block of the chain unreachable while it still took room.

Evictions are counted (``evictions``) and the newest evicted hashes kept (``recent_evictions``):
a decode reports them with its load figures, so a router stops expecting that prefix there
(``control_plane.policy.RoutedPrefixes.evicted``).

Hashes chain over blocks (each one covers its parent's hash and its own tokens) and are
computed with BLAKE2b, not Python's ``hash``, so every process agrees on them.

``on_recycle`` (optional) is called with the blocks that were just freed and with the
blocks ``allocate`` just handed to a new owner, before anyone can rewrite them. A
prefill instance bumps its per-block generation counters there
(``kvxfer.handoff.generations``), so a reader holding a stale descriptor notices the reuse.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Callable, Iterable, Optional, Sequence

import numpy as np


def block_hashes(tokens: Sequence[int], tokens_per_block: int) -> list[int]:
    """One chained hash per *full* block of ``tokens`` (a partial last block has none)."""
    out: list[int] = []
    parent = b""
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        chunk = np.asarray(tokens[start:start + tokens_per_block], dtype=np.int64).tobytes()
        digest = hashlib.blake2b(parent + chunk, digest_size=8).digest()
        out.append(int.from_bytes(digest, "little") >> 1)  # 63 bits: fits an int64 anywhere
        parent = digest
    return out


class BlockAllocator:
    """Free list, refcounts, pins and the hash -> block index of one pool."""

    def __init__(self, num_blocks: int, on_recycle: Optional[Callable[[list[int]], None]] = None,
                 eviction_history: int = 256) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.on_recycle = on_recycle  #: called with freed / reallocated blocks (see the module docstring)
        self._refs = [0] * num_blocks
        self._pins = [0] * num_blocks
        self._clean: deque[int] = deque(range(num_blocks))  # free, no cached content
        self._cached: OrderedDict[int, None] = OrderedDict()  # free, hashed, LRU order
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self.evictions = 0   #: cached blocks evicted so far (their hash forgotten)
        self.recent_evictions: deque[int] = deque(maxlen=eviction_history)  #: the newest evicted hashes

    # --- queries --------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._clean) + len(self._cached)

    @property
    def num_pinned(self) -> int:
        """Blocks held by at least one handoff pin."""
        return sum(1 for p in self._pins if p)

    @property
    def num_pins(self) -> int:
        """Outstanding pins (a block pinned by two handoffs counts twice)."""
        return sum(self._pins)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    # --- allocation -----------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks with one ref each, or ``None`` (nothing taken) when too few are free."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._clean:
                block = self._clean.popleft()
            else:
                block, _ = self._cached.popitem(last=False)  # evict the least recently used
                h = self._hash_of.pop(block)
                del self._block_of[h]
                self.evictions += 1
                self.recent_evictions.append(h)
            self._refs[block] = 1
            out.append(block)
        self._recycled(out)
        return out

    def acquire_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached prefix of ``hashes``, each with one more ref."""
        out = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            self._cached.pop(block, None)
            self._refs[block] += 1
            out.append(block)
        return out

    def register(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """Make full blocks findable by hash (a hash already cached elsewhere keeps its block)."""
        for block, h in zip(blocks, hashes):
            if h in self._block_of or block in self._hash_of:
                continue
            self._hash_of[block] = h
            self._block_of[h] = block

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one ref from each block, the last first (a request's deepest block is evicted first)."""
        freed = []
        try:
            for block in reversed(list(blocks)):
                if self._refs[block] <= 0:
                    raise RuntimeError(f"block {block} released more often than it was taken")
                self._refs[block] -= 1
                if self._maybe_free(block):
                    freed.append(block)
        finally:
            self._recycled(freed)

    def pin(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if self._refs[block] <= 0 and self._pins[block] <= 0:
                raise RuntimeError(f"block {block} is free; only a block in use can be pinned")
            self._pins[block] += 1

    def unpin(self, blocks: Iterable[int]) -> None:
        """Drop one pin from each block, the last first (as ``release``)."""
        freed = []
        try:
            for block in reversed(list(blocks)):
                if self._pins[block] <= 0:
                    raise RuntimeError(f"block {block} unpinned more often than it was pinned")
                self._pins[block] -= 1
                if self._maybe_free(block):
                    freed.append(block)
        finally:
            self._recycled(freed)

    def _maybe_free(self, block: int) -> bool:
        """Put the block on a free list if nothing holds it; True if it was freed."""
        if self._refs[block] or self._pins[block]:
            return False
        if block in self._hash_of:
            self._cached[block] = None
        else:
            self._clean.append(block)
        return True

    def _recycled(self, blocks: list[int]) -> None:
        if blocks and self.on_recycle is not None:
            self.on_recycle(blocks)
