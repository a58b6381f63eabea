"""A bounded staging region shared by a backend's staged reshard pulls.

One tensor on the pool's device, registered with the transport once, carved into byte
ranges by first fit. A range whose read could not be stopped (the transport could not
promise that no byte still lands) is quarantined: out of use, and counted, until that
read is proven over (its handle turns ``storage_safe``), so a late byte can only ever
land in memory nobody reads, and the range comes back once none can.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from kvxfer.errors import BackendUnavailableError
from kvxfer.plan.staged_reshard import DEFAULT_STAGING_BYTES

logger = logging.getLogger(__name__)

STAGING_ENV = "KVXFER_STAGING_BYTES"
#: The largest staging region the environment may ask for.
MAX_STAGING_BYTES = 64 << 30
_SIZE = re.compile(r"^\s*(\d+)\s*(|b|k|kb|kib|m|mb|mib|g|gb|gib)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def staging_bytes_from_env(environ: Optional[Mapping[str, str]] = None) -> int:
    """The staging bound the environment asks for: ``KVXFER_STAGING_BYTES`` (bytes, or with a
    ``KiB``/``MiB``/``GiB`` suffix; ``0`` disables staged reshard), else the default (64 MiB).

    Megatron builds backends with fixed arguments, so this is how its users size or disable
    the region. A value that is not a size raises ``BackendUnavailableError`` naming the variable.
    """
    raw = (os.environ if environ is None else environ).get(STAGING_ENV, "")
    if not raw.strip():
        return DEFAULT_STAGING_BYTES
    match = _SIZE.match(raw) if len(raw) <= 64 else None
    if match is None:
        raise BackendUnavailableError(f"{STAGING_ENV}={raw!r} is not a size: give bytes (67108864), or 64MiB, "
                                      "or 0 to disable staged reshard")
    size = int(match.group(1)) * _UNIT[match.group(2)[:1].lower()]
    if size > MAX_STAGING_BYTES:  # a typo's terabytes would be asked of the allocator at registration
        raise BackendUnavailableError(f"{STAGING_ENV}={raw!r} is more than {MAX_STAGING_BYTES >> 30} GiB: give a size "
                                      "from 0 (no staged reshard) to 64GiB")
    return size


@dataclass(frozen=True)
class _Quarantined:
    offset: int
    size: int
    read_over: Callable[[], bool]
    on_reclaimed: Optional[Callable[[], None]]


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
        self._quarantine: list[_Quarantined] = []

    @property
    def base(self) -> int:
        return self.tensor.data_ptr()

    def allocate(self, nbytes: int) -> Optional[int]:
        """An offset of ``nbytes`` free bytes, or None when none is free now."""
        offset = self._first_fit(nbytes)
        if offset is None and self.reclaim():
            offset = self._first_fit(nbytes)
        return offset

    def _first_fit(self, nbytes: int) -> Optional[int]:
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

    def quarantine(self, offset: int, nbytes: int, read_over: Callable[[], bool],
                   on_reclaimed: Optional[Callable[[], None]] = None) -> None:
        """Keep a range out of use while a read may still land in it; ``read_over()`` says when none can.

        ``on_reclaimed`` runs once, when the range comes back (``reclaim``).
        """
        size = -(-nbytes // self.ALIGN) * self.ALIGN
        with self._lock:
            self.in_use -= size
            self.quarantined += size
            self._quarantine.append(_Quarantined(offset, size, read_over, on_reclaimed))

    def reclaim(self) -> int:
        """Return the quarantined ranges whose reads are over to the free list; the bytes reclaimed."""
        with self._lock:
            held, self._quarantine = self._quarantine, []
        over: list[_Quarantined] = []
        still: list[_Quarantined] = []
        for entry in held:  # read_over() may ask the transport: never under our lock
            (over if _over(entry.read_over) else still).append(entry)
        with self._lock:
            self._quarantine.extend(still)
            self.quarantined -= sum(entry.size for entry in over)
            self.in_use += sum(entry.size for entry in over)
        for entry in over:
            self.release(entry.offset, entry.size)
            if entry.on_reclaimed is not None:
                try:
                    entry.on_reclaimed()
                except Exception:
                    logger.exception("kvxfer staging: a reclaimed range's callback failed")
        return sum(entry.size for entry in over)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor[offset:offset + nbytes]


def _over(read_over: Callable[[], bool]) -> bool:
    try:
        return bool(read_over())
    except Exception:  # a check that breaks proves nothing: keep the range out of use
        return False
