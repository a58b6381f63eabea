"""Decode worker: one load per request, from ticket to verified blocks, and what is reported.

A load goes: check the ticket's schema (scheduler already checked the prompt digest; the
block-id list is bounded by the tokens it claims before it is walked) and, with a cluster
key, its signature -> the producer's handshake (``handshake_cache``: fetched and its metas
confirmed off the engine's thread) -> the ticket's signature (without a cluster key: the
key came in the handshake), instance, the two layouts, and the block ids against the
producer's pool -> one ``begin_pull_blocks`` per KV region and prefill rank read from
(``tp_reads``: this rank's own with equal TP; with different TP the ranks NixlConnector maps,
reading only this rank's head slabs) with the producer's block ids from the ticket and the
blocks vLLM allocated here, no read-done -> once every byte landed, one 8-byte read of the
lease slot of each prefill rank this rank notifies, which carries the read-done labelled
with this rank's reader index and count -> ``lease_holds`` on every rank read from ->
reported in ``finished_recving``.

Nothing here waits on a peer: each call posts or polls and returns. The engine step pays
the posting of its loads (local planning and the transport's post) plus at most
``completion_spin_us`` of polling.

Failures (``failed_recving``, which vLLM handles per ``kv_load_failure_policy``) are reported
only when no byte can still land in the request's blocks: every handle ``storage_safe``.
Until then the load is *quarantined*: not reported, so vLLM keeps the blocks allocated to
the request (THE RULE, docs/reliability.md). Refusals happen before anything is posted.
Every wait is bounded: handshakes by ``handshake_timeout_s``, transfers by the backend's
``timeout_s`` (``transfer_timeout_s``), a wait for a lease scratch slot by ``transfer_timeout_s``
(``ScratchSlots``: a slot of a failed read comes back once that read is proven over).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from kvxfer.backends.base import TransferHandle, TransferStartError, abort_parts
from kvxfer.errors import KVXferError, TransferError
from kvxfer.integrations.vllm.handshake import EngineLayout, Handshake, check_compatible
from kvxfer.integrations.vllm.handshake_cache import HandshakeCache
from kvxfer.integrations.vllm.leases import lease_holds
from kvxfer.integrations.vllm.specs import LoadSpec
from kvxfer.integrations.vllm.tickets import Ticket, parse_ticket, ticket_key
from kvxfer.integrations.vllm.tp_reads import RankReads, notify_ranks, rank_reads, reader_label

logger = logging.getLogger("kvxfer.integrations.vllm")

_UNREAD = -(1 << 62)  # a scratch slot's value before the lease lands: never "holds"
RECENT = 4096  # handoff records kept for stats()


class ScratchSlots:
    """The decode's lease scratch: one int64 slot per lease read in flight.

    A slot follows its read: it is free again when the read completed, and when the read
    failed only once no byte can still land in it (``storage_safe``); until then it is
    quarantined with the handles that could still write it, and ``reclaim`` (every step)
    returns it as soon as they are safe. A slot is never handed out while a byte may land.
    """

    def __init__(self, scratch: torch.Tensor) -> None:
        self.tensor = scratch
        self._free = list(range(scratch.numel() - 1, -1, -1))
        self._held: list[tuple[int, list[TransferHandle]]] = []
        self.lost = 0  # slots a failed start left unsafe with nothing to ask: never reused

    def take(self) -> Optional[int]:
        if not self._free:
            return None
        slot = self._free.pop()
        self.tensor[slot] = _UNREAD
        return slot

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    def quarantine(self, slot: int, handles: Sequence[TransferHandle]) -> None:
        if handles:
            self._held.append((slot, list(handles)))
        else:
            self.lost += 1

    def reclaim(self) -> int:
        if not self._held:
            return 0
        # each slot judged once: ``storage_safe`` is flipped by the transport's thread, and a slot judged
        # twice could land in both lists (handed out while still counted as quarantined, then freed again)
        safe = [(slot, hs, all(h.storage_safe for h in hs)) for slot, hs in self._held]
        still = [(slot, hs) for slot, hs, ok in safe if not ok]
        back = [slot for slot, _, ok in safe if ok]
        self._held = still
        self._free.extend(back)
        if back:
            logger.info("kvxfer vllm: %d lease scratch slot(s) back in use: no byte can land in them any more",
                        len(back))
        return len(back)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def quarantined(self) -> int:
        return len(self._held)


@dataclass
class _Load:
    spec: LoadSpec
    started: float
    ticket: Optional[Ticket] = None
    handshake: Optional[Handshake] = None
    refetched: bool = False
    data: list[TransferHandle] = field(default_factory=list)
    leases: list[tuple[TransferHandle, int, int]] = field(default_factory=list)  # (handle, scratch slot, prefill rank)
    reads: Optional[RankReads] = None  # this rank's slab reads and whom it tells "done"
    failing: Optional[str] = None  # decided to fail; the lease read only tells the producer to free
    verified: bool = False  # the ticket's signature checked (before the handshake, with a cluster key)
    slot_wait: Optional[float] = None  # since when it waits for a scratch slot
    marks: dict[str, float] = field(default_factory=dict)  # phase -> clock, for "where did the time go"
    bytes: int = 0
    descriptors: int = 0


class Receiver:
    def __init__(self, *, tp_rank: int, backend_name: str, layout: EngineLayout, regions: Sequence[Any],
                 scratch_backend: Any, scratch: torch.Tensor, handshakes: HandshakeCache,
                 cluster_key: Optional[bytes], handshake_timeout_s: float, transfer_timeout_s: float = 30.0,
                 spin_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._tp_rank = tp_rank
        self._backend_name = backend_name
        self._layout = layout
        self._regions = list(regions)
        self._scratch_backend = scratch_backend
        self.slots = ScratchSlots(scratch)
        self._handshakes = handshakes
        self._cluster_key = cluster_key
        self._handshake_timeout_s = handshake_timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        self._spin_s = spin_s
        self._clock = clock
        self._loads: dict[str, _Load] = {}
        self._quarantined: dict[str, tuple[_Load, str]] = {}
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self.counters = {"handoffs": 0, "handoff_failures": 0, "refused": 0, "bytes": 0, "descriptors": 0,
                         "quarantined": 0}
        self.interval_handoff_s: list[float] = []
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)

    # --- the step's entry points ---------------------------------------------------------
    def submit(self, spec: LoadSpec) -> None:
        if spec.request_id in self._loads:
            logger.warning("kvxfer vllm: request %s is already loading; duplicate ignored", spec.request_id)
            return
        load = self._loads[spec.request_id] = _Load(spec, self._clock())
        self._step(load)  # post now: the read overlaps the rest of the engine step


    def collect(self) -> tuple[set[str], set[str]]:
        """``(finished_recving, failed_recving)`` since the last call (failed ones are in both)."""
        self.slots.reclaim()
        for load in list(self._loads.values()):
            self._step(load)
        self._spin()
        for request_id, (load, reason) in list(self._quarantined.items()):
            if all(h.storage_safe for h in load.data):
                del self._quarantined[request_id]
                self.counters["quarantined"] -= 1
                logger.warning("kvxfer vllm: request %s: no byte can land any more; reporting its failure now",
                               request_id)
                self._report_failed(load, reason)
        finished, failed = self._finished, self._failed
        self._finished, self._failed = set(), set()
        return finished, failed

    def _spin(self) -> None:
        """Reads on shared memory or RDMA finish in microseconds, an engine step takes a millisecond:
        poll the reads in flight for up to ``spin_s`` so a load can finish in the step that posted it."""
        if self._spin_s <= 0:
            return
        deadline = time.perf_counter() + self._spin_s
        while time.perf_counter() < deadline:
            moving = [load for load in self._loads.values() if load.data or load.leases]
            if not moving:
                return
            for load in moving:
                self._step(load)

    def _step(self, load: _Load) -> None:
        try:
            self._advance(load)
        except Exception as exc:  # never let one request's surprise break the engine's step
            logger.exception("kvxfer vllm: request %s: unexpected failure", load.spec.request_id)
            safe = abort_parts(load.data, f"request {load.spec.request_id!r}: unexpected failure")
            self._fail_or_quarantine(load, f"unexpected {type(exc).__name__}: {exc}", safe)

    @property
    def in_flight(self) -> int:
        return len(self._loads) + len(self._quarantined)

    # --- the state machine --------------------------------------------------------------------
    def _advance(self, load: _Load) -> None:
        spec = load.spec
        if load.leases:
            return self._advance_lease(load)
        if load.data:
            return self._advance_data(load)
        if spec.refusal:
            return self._refuse(load, spec.refusal)
        if load.ticket is None:
            try:
                load.ticket = parse_ticket(spec.params, block_size=self._layout.block_size)
                if self._cluster_key is not None:  # checked before anything the ticket names is contacted
                    load.ticket.verify(ticket_key(self._cluster_key, None))
                    load.verified = True
            except KVXferError as exc:
                return self._refuse(load, str(exc))
        ticket = load.ticket
        if load.handshake is None:
            try:
                load.handshake = self._handshakes.get(ticket.engine_id, ticket.host, ticket.port)
            except Exception as exc:
                return self._refuse(load, f"handshake with prefill engine {ticket.engine_id!r} at "
                                          f"{ticket.host}:{ticket.port} failed: {exc}")
            if load.handshake is None:
                if self._clock() - load.started > 2 * self._handshake_timeout_s + 1:
                    return self._refuse(load, f"no handshake from prefill engine {ticket.engine_id!r} in time")
                return None
        handshake = load.handshake
        if ticket.instance != handshake.instance:
            if not load.refetched:  # the producer restarted since we cached it: ask again once
                load.refetched, load.handshake = True, None
                self._handshakes.invalidate(ticket.host, ticket.port)
                return None
            return self._refuse(load, f"kv_transfer_params name prefill instance {ticket.instance!r} but "
                                      f"{ticket.host}:{ticket.port} now runs {handshake.instance!r} (restarted): "
                                      "the blocks are gone")
        key = ticket_key(self._cluster_key, handshake.ticket_key)
        try:
            if key is None:
                raise KVXferError("this decode has KVXFER_SECRET_FILE set but the prefill does not: configure the "
                                  "same cluster secret on both")
            if not load.verified:
                ticket.verify(key)
            if ticket.backend != self._backend_name:
                raise KVXferError(f"the ticket was made for backend {ticket.backend!r}, this decode uses "
                                  f"{self._backend_name!r}")
        except KVXferError as exc:
            return self._refuse(load, str(exc))
        try:
            check_compatible(self._layout, self._backend_name, handshake)
            load.reads = rank_reads(self._tp_rank, self._layout, handshake.layout)
        except KVXferError as exc:
            load.failing = str(exc)
            self.counters["refused"] += 1
            load.reads = RankReads((), notify_ranks(self._tp_rank, self._layout.tp_size, handshake.layout.tp_size))
            return self._post_lease(load)  # a verified ticket: let the producer free its blocks now
        load.marks["checked"] = self._clock()
        local = list(spec.local_block_ids)
        remote = list(ticket.block_ids[spec.first_block: spec.first_block + len(local)])
        if len(remote) < len(local):
            return self._refuse(load, f"the ticket names {len(ticket.block_ids)} blocks, the request needs blocks "
                                      f"{spec.first_block}..{spec.first_block + len(local) - 1}")
        pool = handshake.layout.num_blocks
        if remote and max(remote) >= pool:  # signed by the producer, but checked against what it serves
            return self._refuse(load, f"the ticket names block {max(remote)}, the prefill's pool has {pool} blocks")
        if not local:
            return self._post_lease(load)
        self._post_data(load, remote, local)

    def _post_data(self, load: _Load, remote: list[int], local: list[int]) -> None:
        ticket, handshake = load.ticket, load.handshake
        assert ticket is not None and handshake is not None
        assert load.reads is not None
        labels = {n.rank: reader_label(ticket.request_id, n.reader, n.readers) for n in load.reads.notify}
        for read in load.reads.reads:  # one per prefill rank read from (one with equal TP)
            src_ids, dst_ids = read.ids(remote, local)
            for backend, meta in zip(self._regions, handshake.rank_kv_metas[read.src_rank]):
                try:
                    handle = backend.begin_pull_blocks(meta, src_ids, dst_ids, notify=False,
                                                       request_id=labels.get(read.src_rank, ticket.request_id))
                except KVXferError as exc:
                    posted_safe = abort_parts(load.data, f"request {ticket.request_id!r}: another region failed to start")
                    safe = posted_safe and (not isinstance(exc, TransferStartError) or exc.storage_safe)
                    if not load.data and not isinstance(exc, TransferStartError):
                        return self._refuse(load, f"{exc}")
                    return self._fail_or_quarantine(load, f"starting the pull failed: {exc}", safe)
                load.bytes += handle.bytes_requested
                load.descriptors += handle.descriptors_posted
                load.data.append(handle)
        load.marks["data_posted"] = self._clock()
        self._advance_data(load)

    def _advance_data(self, load: _Load) -> None:
        try:
            done = all([h.poll() for h in load.data])
        except TransferError as exc:
            safe = abort_parts(load.data, f"request {load.spec.request_id!r}: a sibling region failed")
            return self._fail_or_quarantine(load, str(exc), safe)
        if done:
            self._post_lease(load)

    def _post_lease(self, load: _Load) -> None:
        """One 8-byte lease read per prefill rank this rank notifies (it carries the read-done)."""
        ticket, handshake = load.ticket, load.handshake
        assert ticket is not None and handshake is not None and load.reads is not None
        notify = load.reads.notify
        if not notify:
            return self._finish_failed(load, load.failing or "no prefill rank to read the lease from")
        if self.slots.free < len(notify):  # every scratch slot is in use: try again next step, up to the timeout
            now = self._clock()
            load.slot_wait = load.slot_wait if load.slot_wait is not None else now
            if now - load.slot_wait <= self._transfer_timeout_s:
                return None
            return self._finish_failed(load, load.failing or (
                f"no lease scratch slot came free within transfer_timeout_s={self._transfer_timeout_s}s "
                f"({self.slots.quarantined} held by failed reads that may still land)"))
        for target in notify:
            slot = self.slots.take()
            assert slot is not None
            try:
                handle = self._scratch_backend.begin_pull_blocks(
                    handshake.rank_lease_metas[target.rank], [ticket.slot], [slot],
                    request_id=reader_label(ticket.request_id, target.reader, target.readers))
            except KVXferError as exc:
                if isinstance(exc, TransferStartError) and not exc.storage_safe:
                    self.slots.quarantine(slot, exc.cleanup_handles)  # back once those are safe
                else:
                    self.slots.give_back(slot)
                if load.leases:  # the ones posted still tell their ranks; their outcome is not awaited
                    self._drop_leases(load, f"request {ticket.request_id!r}: a sibling lease read failed to start")
                return self._finish_failed(load, load.failing or f"reading the lease failed to start: {exc}")
            load.leases.append((handle, slot, target.rank))
        load.marks["lease_posted"] = self._clock()
        self._advance_lease(load)

    def _drop_leases(self, load: _Load, reason: str) -> None:
        """Give back the scratch slots of ``load``'s lease reads: at once where no byte can land, else
        once the transport proves it (aborting those still in flight)."""
        abort_parts([h for h, _, _ in load.leases], reason)
        for handle, slot, _ in load.leases:
            if handle.storage_safe:
                self.slots.give_back(slot)
            else:
                self.slots.quarantine(slot, [handle])
        load.leases = []

    def _advance_lease(self, load: _Load) -> None:
        assert load.leases and load.ticket is not None and load.reads is not None
        try:
            if not all([handle.poll() for handle, _, _ in load.leases]):
                return None
        except TransferError as exc:
            self._drop_leases(load, f"request {load.ticket.request_id!r}: a sibling lease read failed")
            return self._finish_failed(load, load.failing or f"reading the lease of the prefill's blocks failed: {exc}")
        read_from = {read.src_rank for read in load.reads.reads}
        seen = {rank: int(self.slots.tensor[slot]) for _, slot, rank in load.leases}
        for _, slot, _ in load.leases:
            self.slots.give_back(slot)
        load.leases = []
        if load.failing:
            return self._finish_failed(load, load.failing)
        for rank, value in sorted(seen.items()):
            if rank in read_from and not lease_holds(value, load.ticket.lease):
                return self._finish_failed(
                    load, f"prefill rank {rank} released request {load.ticket.request_id!r}'s blocks before the read "
                          f"completed (lease {load.ticket.lease}, slot now {value}: pin_grace_s passed, or a restart); "
                          "the pulled bytes are discarded")
        self._succeed(load)

    # --- outcomes -----------------------------------------------------------------------------
    def _succeed(self, load: _Load) -> None:
        del self._loads[load.spec.request_id]
        if not load.spec.local_block_ids:
            return  # release only: nothing was awaited
        elapsed = self._clock() - load.started
        self.counters["handoffs"] += 1
        self.counters["bytes"] += load.bytes
        self.counters["descriptors"] += load.descriptors
        self.interval_handoff_s.append(elapsed)
        phases = {f"{name}_s": at - load.started for name, at in load.marks.items()}
        self.recent.append({"request_id": load.spec.request_id, "handoff_s": elapsed, "bytes": load.bytes,
                            "descriptors": load.descriptors, "blocks": len(load.spec.local_block_ids), **phases})
        if load.spec.awaiting:
            self._finished.add(load.spec.request_id)

    def _refuse(self, load: _Load, reason: str) -> None:
        """Nothing was posted: safe to report at once."""
        self.counters["refused"] += 1
        self._finish_failed(load, reason)

    def _fail_or_quarantine(self, load: _Load, reason: str, storage_safe: bool) -> None:
        if storage_safe:
            return self._finish_failed(load, reason)
        self._loads.pop(load.spec.request_id, None)
        self._quarantined[load.spec.request_id] = (load, reason)
        self.counters["quarantined"] += 1
        logger.error("kvxfer vllm: request %s: %s; a byte may still land in its %d blocks, so they stay held (not "
                     "reported to vLLM) until the transport proves otherwise", load.spec.request_id, reason,
                     len(load.spec.local_block_ids))

    def _finish_failed(self, load: _Load, reason: str) -> None:
        self._loads.pop(load.spec.request_id, None)
        self._report_failed(load, reason)

    def _report_failed(self, load: _Load, reason: str) -> None:
        if not load.spec.awaiting:
            logger.info("kvxfer vllm: releasing request %s at its prefill failed: %s", load.spec.request_id, reason)
            return
        self.counters["handoff_failures"] += 1
        logger.error("kvxfer vllm: request %s: KV load failed: %s", load.spec.request_id, reason)
        self.recent.append({"request_id": load.spec.request_id, "failed": reason})
        self._finished.add(load.spec.request_id)
        self._failed.add(load.spec.request_id)
