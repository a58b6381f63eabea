"""A bounded staging region shared by a backend's staged reshard pulls.

One tensor on the pool's device, registered with the transport once, carved into byte
ranges by first fit. A range whose read could not be stopped (the transport could not
promise that no byte still lands) is quarantined: never handed out again, and counted,
so a late byte can only ever land in memory nobody reads.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch


class StagingArena:
    """First-fit byte ranges of one staging tensor; thread-safe."""

    ALIGN = 256  # keeps every range aligned for any dtype view and for DMA engines

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.capacity = tensor.numel()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # sorted (offset, length)
        self._lock = threading.Lock()
        self.in_use = 0
        self.quarantined = 0

    @property
    def base(self) -> int:
        return self.tensor.data_ptr()

    def allocate(self, nbytes: int) -> Optional[int]:
        """An offset of ``nbytes`` free bytes, or None when none is free now."""
        size = -(-nbytes // self.ALIGN) * self.ALIGN
        with self._lock:
            for i, (offset, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, length - size)
                    self.in_use += size
                    return offset
        return None

    def release(self, offset: int, nbytes: int) -> None:
        size = -(-nbytes // self.ALIGN) * self.ALIGN
        with self._lock:
            self.in_use -= size
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for start, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((start, length))
            self._free = merged

    def quarantine(self, nbytes: int) -> None:
        """Keep a range out of use for good (its read may still land)."""
        size = -(-nbytes // self.ALIGN) * self.ALIGN
        with self._lock:
            self.in_use -= size
            self.quarantined += size

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor[offset:offset + nbytes]
