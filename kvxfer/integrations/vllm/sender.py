"""Producer worker: the pins of exported requests, and when they go.

A pin goes when the transport says the decode's read is done (``drain_read_done``), when
a reader reports that its read failed (``drain_read_failed``: by contract no read of it is
in flight), or after ``pin_grace_s`` without either (a decode that died, or never came).
The last is safe only because of the lease (``kvxfer.integrations.vllm.leases``): the slot is
marked released *before* vLLM gets the blocks back, and every reader checks the slot after
its data. Reports are per request id (vLLM's, which the ticket names), drained from every
registration the reads touch: the KV regions (failures) and the lease table (read-done).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from kvxfer.integrations.vllm.specs import SendSpec

logger = logging.getLogger("kvxfer.integrations.vllm")

_EARLY_KEEP = 4096  # reports that came before their pin (kept so the pin goes at once)


@dataclass
class _Pin:
    spec: SendSpec
    since: float


class Sender:
    def __init__(self, report_sources: Sequence[Any], table: torch.Tensor, grace_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sources = list(report_sources)
        self._table = table
        self._grace_s = grace_s
        self._clock = clock
        self._pins: dict[str, _Pin] = {}
        self._early: OrderedDict[str, str] = OrderedDict()
        self.counters = {"released_read_done": 0, "released_read_failed": 0, "released_grace": 0}

    @property
    def held(self) -> int:
        return len(self._pins)

    def pin(self, spec: SendSpec) -> None:
        self._table[spec.slot] = spec.lease
        self._pins[spec.request_id] = _Pin(spec, self._clock())  # an early report releases it in collect()

    def collect(self) -> set[str]:
        """Request ids whose pins went since the last call (vLLM frees their blocks)."""
        released: set[str] = set()
        for source in self._sources:
            for request_id in source.drain_read_done():
                self._release(str(request_id), "read_done", released)
            for failure in source.drain_read_failed():
                self._release(str(failure.request_id), "read_failed", released, failure.reason)
        for request_id in list(self._early):
            if request_id in self._pins:
                self._release(request_id, self._early.pop(request_id), released)
        now = self._clock()
        for request_id, pin in list(self._pins.items()):
            if now - pin.since > self._grace_s:
                logger.warning(
                    "kvxfer vllm: request %s: no read-done within pin_grace_s=%ss; its lease is revoked and its "
                    "%d blocks freed (a late reader fails its lease check instead of reading reused blocks)",
                    request_id, self._grace_s, len(pin.spec.block_ids))
                self._release(request_id, "grace", released)
        return released

    def _release(self, request_id: str, why: str, released: set[str], reason: str = "") -> None:
        pin = self._pins.pop(request_id, None)
        if pin is None:
            if why != "grace" and request_id not in released:
                self._early[request_id] = why
                while len(self._early) > _EARLY_KEEP:
                    self._early.popitem(last=False)
            return
        self._table[pin.spec.slot] = -pin.spec.lease  # revoked before vLLM may reuse a block
        self.counters[f"released_{why}"] += 1
        if why == "read_failed":
            logger.info("kvxfer vllm: request %s: the decode's read failed (%s); blocks freed", request_id, reason)
        released.add(request_id)
