"""Producer worker: the pins of exported requests, and when they go.

A pin goes when every reader of the request reported: the transport says its read is done
(``drain_read_done``) or that it failed (``drain_read_failed``: by contract no read of that
reader is in flight), or after ``pin_grace_s`` without all of them (a decode that died, or
never came). A request has one reader per prefill rank with equal TP; with a decode of
larger TP it has ``decode TP / prefill TP``, and each labels its reads with its index and
that count (``tp_reads.reader_label``), so the count travels with the read-done.
The last is safe only because of the lease (``kvxfer.handoff.guard``, the lease-slot
guard of ``kvxfer.handoff.guard``): the slot is revoked *before* vLLM gets the blocks back,
and every reader checks the slot after its data. Reports are per request id (vLLM's, which
the ticket names), drained from every registration the reads touch: the KV regions (failures)
and the lease table (read-done).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kvxfer.handoff.guard import pin_lease, revoke_lease
from kvxfer.integrations.vllm.specs import SendSpec
from kvxfer.integrations.vllm.tp_reads import parse_reader_label

logger = logging.getLogger(__name__)

_EARLY_KEEP = 4096  # requests with reports that came before their pin (kept so the pin goes at the right one)


@dataclass
class _Reports:
    """Which readers of a request reported (read-done or read-failed), and how many there are."""

    readers: int = 1
    done: set[int] = field(default_factory=set)
    why: str = "read_done"
    reason: str = ""

    def add(self, reader: int, readers: int, why: str, reason: str) -> None:
        self.readers = max(self.readers, readers)
        self.done.add(reader)
        if why == "read_failed" or self.why != "read_failed":
            self.why, self.reason = why, reason

    @property
    def complete(self) -> bool:
        return len(self.done) >= self.readers


@dataclass
class _Pin:
    spec: SendSpec
    since: float
    reports: _Reports = field(default_factory=_Reports)


class Sender:
    def __init__(self, report_sources: Sequence[Any], table: torch.Tensor, grace_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sources = list(report_sources)
        self._table = table
        self._grace_s = grace_s
        self._clock = clock
        self._pins: dict[str, _Pin] = {}
        self._early: OrderedDict[str, _Reports] = OrderedDict()
        self.counters = {"released_read_done": 0, "released_read_failed": 0, "released_grace": 0,
                         "released_sleep": 0}

    @property
    def held(self) -> int:
        return len(self._pins)

    def pin(self, spec: SendSpec) -> None:
        pin_lease(self._table, spec.slot, spec.lease)
        pin = self._pins[spec.request_id] = _Pin(spec, self._clock())
        early = self._early.pop(spec.request_id, None)
        if early is not None:  # reports that came before the pin: collect() releases it if they are all
            pin.reports = early

    def collect(self) -> set[str]:
        """Request ids whose pins went since the last call (vLLM frees their blocks)."""
        released: set[str] = set()
        for source in self._sources:
            for label in source.drain_read_done():
                self._report(str(label), "read_done", released)
            for failure in source.drain_read_failed():
                self._report(str(failure.request_id), "read_failed", released, failure.reason)
        for request_id, pin in list(self._pins.items()):
            if pin.reports.complete and pin.reports.done:
                self._release(request_id, pin.reports.why, released, pin.reports.reason)
        now = self._clock()
        for request_id, pin in list(self._pins.items()):
            if now - pin.since > self._grace_s:
                logger.warning(
                    "kvxfer vllm: request %s: %d of %d reader(s) reported within pin_grace_s=%ss; its lease is "
                    "revoked and its %d blocks freed (a late reader fails its lease check instead of reading reused "
                    "blocks)", request_id, len(pin.reports.done), pin.reports.readers, self._grace_s,
                    len(pin.spec.block_ids))
                self._release(request_id, "grace", released)
        return released

    def release_all(self, why: str) -> set[str]:
        """Revoke every lease and let every pin go now (``why``: ``sleep``, vLLM's sleep mode unregistering the
        KV cache): a reader still to come fails its lease check instead of reading what the cache holds next."""
        released: set[str] = set()
        for request_id in list(self._pins):
            logger.warning("kvxfer vllm: request %s: its lease is revoked and its blocks freed (%s) before %d of "
                           "%d reader(s) reported", request_id, why, self._pins[request_id].reports.readers -
                           len(self._pins[request_id].reports.done), self._pins[request_id].reports.readers)
            self._release(request_id, why, released)
        self._early.clear()
        return released

    def _report(self, label: str, why: str, released: set[str], reason: str = "") -> None:
        """A reader's read-done or read-failed: the request goes once every one of its readers reported."""
        request_id, reader, readers = (label, 0, 1) if label in self._pins else parse_reader_label(label)
        pin = self._pins.get(request_id)
        if pin is None:
            if request_id not in released:
                reports = self._early.setdefault(request_id, _Reports())
                reports.add(reader, readers, why, reason)
                while len(self._early) > _EARLY_KEEP:
                    self._early.popitem(last=False)
            return
        pin.reports.add(reader, readers, why, reason)
        if pin.reports.complete:
            self._release(request_id, pin.reports.why, released, pin.reports.reason)

    def _release(self, request_id: str, why: str, released: set[str], reason: str = "") -> None:
        pin = self._pins.pop(request_id)
        revoke_lease(self._table, pin.spec.slot, pin.spec.lease)  # before vLLM may reuse a block
        self.counters[f"released_{why}"] += 1
        if why == "read_failed":
            logger.info("kvxfer vllm: request %s: a decode's read failed (%s); blocks freed", request_id, reason)
        released.add(request_id)
