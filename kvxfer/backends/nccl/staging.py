"""Staging buffers and the gather / scatter between them and a pool.

A push moves one message per (request, peer pair): the sender gathers every row of
the plan (coalesced byte runs of K/V layer planes, or per-token head fragments when
TP is resharded) into one contiguous buffer, the receiver lands it in another and
scatters it into its pool. That is one send instead of the reference's one per
block x fragment, and the receiver's pool is written only after the whole message
has arrived and its header matched (so a failed or timed-out receive never leaves
a torn block behind).

Gather and scatter are single indexed copies (``index_select`` / ``index_copy_``) over
the pool seen as rows of ``unit`` bytes, ``unit`` being the largest size dividing
every offset and length: Python work does not grow with blocks x layers x tokens.

Staging memory comes from a ``StagingPool`` on the pool's device and goes back to it
when a transfer completes; a buffer a transport may still write (an abandoned
receive) is never handed out again.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: Plans with at most this many rows are copied row by row (no index tensor to build).
FEW_ROWS = 8


class ByteRows:
    """One side's rows of a ``CopyPlan`` (``offsets`` into its pool, ``lengths``), in message order."""

    def __init__(self, offsets: np.ndarray, lengths: np.ndarray, device: torch.device) -> None:
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.total_bytes = int(self.lengths.sum())
        self._index: Optional[torch.Tensor] = None
        self.unit = 1
        if self.lengths.size > FEW_ROWS:
            self.unit = int(np.gcd.reduce(np.concatenate((self.offsets, self.lengths)))) or 1
            units = self.lengths // self.unit
            starts = self.offsets // self.unit
            row = np.repeat(np.arange(units.size, dtype=np.int64), units)
            first = np.cumsum(units) - units
            index = starts[row] + (np.arange(row.size, dtype=np.int64) - first[row])
            self._index = torch.from_numpy(index).to(device)

    def _pool_rows(self, pool_bytes: torch.Tensor) -> torch.Tensor:
        usable = pool_bytes.numel() - pool_bytes.numel() % self.unit
        return pool_bytes[:usable].view(-1, self.unit)

    def gather(self, pool_bytes: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the rows, in order, from the pool into ``out`` (``total_bytes`` long)."""
        if self._index is None:
            pos = 0
            for off, length in zip(self.offsets.tolist(), self.lengths.tolist()):
                out[pos:pos + length].copy_(pool_bytes[off:off + length])
                pos += length
            return
        torch.index_select(self._pool_rows(pool_bytes), 0, self._index, out=out.view(-1, self.unit))

    def scatter(self, data: torch.Tensor, pool_bytes: torch.Tensor) -> None:
        """Copy ``data`` (``total_bytes`` long) into the rows of the pool, in order."""
        if self._index is None:
            pos = 0
            for off, length in zip(self.offsets.tolist(), self.lengths.tolist()):
                pool_bytes[off:off + length].copy_(data[pos:pos + length])
                pos += length
            return
        self._pool_rows(pool_bytes).index_copy_(0, self._index, data.view(-1, self.unit))


def pool_bytes(memory_buffer: torch.Tensor) -> torch.Tensor:
    """The (contiguous) pool as one flat uint8 tensor sharing its memory."""
    return memory_buffer.view(torch.uint8).reshape(-1)


@dataclass
class Lease:
    """A staging buffer lent out: ``tensor`` is exactly the requested size."""

    tensor: torch.Tensor
    buffer: torch.Tensor = field(repr=False)


class StagingPool:
    """Reusable uint8 buffers on one device, in power-of-two capacities.

    ``max_cached_bytes`` bounds what idle buffers may hold; beyond it a returned
    buffer is freed. Thread-safe: handles of several requests return buffers
    from whatever thread polls them.
    """

    MIN_BYTES = 1 << 16

    def __init__(self, device: torch.device, max_cached_bytes: int = 1 << 30) -> None:
        self.device = device
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._cached = 0
        self._lock = threading.Lock()
        self.allocations = 0  # buffers ever allocated (a reuse test reads it)

    def acquire(self, nbytes: int) -> Lease:
        capacity = max(self.MIN_BYTES, 1 << max(0, int(nbytes) - 1).bit_length())
        with self._lock:
            free = self._free.get(capacity)
            buffer = free.pop() if free else None
            if buffer is not None:
                self._cached -= capacity
        if buffer is None:
            buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
            self.allocations += 1
        return Lease(buffer[:nbytes], buffer)

    def release(self, lease: Lease) -> None:
        """Return a buffer no transport can still touch."""
        capacity = lease.buffer.numel()
        with self._lock:
            if self._cached + capacity <= self.max_cached_bytes:
                self._free.setdefault(capacity, []).append(lease.buffer)
                self._cached += capacity

    @property
    def cached_bytes(self) -> int:
        return self._cached
