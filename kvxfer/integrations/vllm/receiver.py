"""Decode worker: one load per request, from ticket to verified blocks, and what is reported.

A load goes: check the ticket's schema (scheduler already checked the prompt digest; the
block-id list is bounded by the tokens it claims before it is walked) and, with a cluster
key, its signature -> the producer's handshake (``handshake_cache``: fetched and its metas
confirmed off the engine's thread) -> the ticket's signature (without a cluster key: the
key came in the handshake), instance, the two layouts, and the block ids against the
producer's pool -> one ``begin_pull_blocks`` per KV region and prefill rank read from
(``tp_reads``: this rank's own with equal TP; with different TP the ranks NixlConnector maps,
reading only this rank's head slabs, or on NHD its heads' runs) with the producer's block ids from the
ticket and the blocks vLLM allocated here (a smaller prefill block: paired by token position,
``block_sizes``, and read as parts into its place in the decode block), no read-done -> once every byte landed, one 8-byte read of the
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

The lifecycle is the library's (``kvxfer.handoff``): the data reads and the lease read are one
``GuardedRead`` with a ``LeaseSlotGuard``, and quarantined loads and scratch slots are held in a
``Quarantine``; this module maps them onto vLLM's reports.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from kvxfer.backends.base import ChainedGuard, TransferHandle, TransferStartError, abort_parts
from kvxfer.backends.same_host import LIVE_SOURCE_WAIT_S
from kvxfer.defaults import TRANSFER_TIMEOUT_S
from kvxfer.errors import KVXferError, TransferError
from kvxfer.handoff.poll import KVPoll
from kvxfer.handoff.guard import (
    ChainedLeaseGuard, GuardedRead, LeaseSlotGuard, LeaseTarget, Phase, ScratchSlots, begin_data_read,
)
from kvxfer.handoff.quarantine import Quarantine
from kvxfer.integrations.vllm.handshake import EngineLayout, Handshake, check_compatible
from kvxfer.integrations.vllm.handshake_cache import REFETCH_AFTER_S, HandshakeCache
from kvxfer.integrations.vllm.specs import MAMBA, LoadSpec
from kvxfer.integrations.vllm.tickets import Ticket, parse_ticket, ticket_key
from kvxfer.integrations.vllm.hybrid_tp import PageRead
from kvxfer.integrations.vllm.block_sizes import sub_block_pairs
from kvxfer.integrations.vllm.pp_stages import StageRead, StageWindows
from kvxfer.integrations.vllm.tp_reads import PartRead, RankReads, SlabRead, notify_ranks, rank_reads, reader_label
from kvxfer.plan.parts import SlicePart

logger = logging.getLogger(__name__)

RECENT = 4096  # handoff records kept for stats()

#: Why a load that vLLM awaits failed (``failed_<kind>`` counters; ``vllm:kvxfer_failed_handoffs{kind}``):
#: ``handshake`` the prefill's handshake could not be had (unreachable, too slow, restarted since the ticket);
#: ``refused`` the ticket or the two layouts refused before any byte moved; ``transfer`` a data read failed or
#: timed out; ``lease`` the lease read failed or showed the prefill had freed the blocks (its pin expired);
#: ``scratch`` no lease scratch slot came free in time.
FAILURE_KINDS = ("handshake", "refused", "transfer", "lease", "scratch")


@dataclass
class _Load:
    spec: LoadSpec
    started: float
    ticket: Optional[Ticket] = None
    handshake: Optional[Handshake] = None
    refetched: bool = False
    data: list[TransferHandle] = field(default_factory=list)
    read: Optional[GuardedRead] = None  # the data reads (once all are posted), then the lease reads
    lease: "LeaseSlotGuard | ChainedLeaseGuard | None" = None  # the lease reads of ``read``: one per rank notified
    reads: Optional[RankReads] = None  # this rank's slab reads and whom it tells "done"
    failing: Optional[str] = None  # decided to fail; the lease read only tells the producer to free
    fail_kind: str = "refused"  # the FAILURE_KINDS entry it counts under once reported failed
    verified: bool = False  # the ticket's signature checked (before the handshake, with a cluster key)
    slot_wait: Optional[float] = None  # since when it waits for a scratch slot
    marks: dict[str, float] = field(default_factory=dict)  # phase -> clock, for "where did the time go"
    bytes: int = 0
    descriptors: int = 0

    @property
    def state(self) -> KVPoll:
        """The load in the library's one lifecycle: ``Bootstrapping`` while its ticket, handshake and
        layouts are checked, ``Transferring`` once its reads are posted (the guarded read); it leaves
        the table as ``Success`` (``finished_recving``) or ``Failed`` (``failed_recving`` too)."""
        return KVPoll.Transferring if self.read is not None else KVPoll.Bootstrapping


class PreparedSources:
    """What each handshake decides for every load from that producer, worked out once and reused:
    its metas verified and parsed (``prepare_peer``), so a load's reads skip the seal check and the
    parse of what the handshake already checked, and this rank's verdict on its layout with the
    reads it then makes (``reads``). Bounded like the handshake cache; a handshake fetched again is
    prepared again."""

    LIMIT = 64

    def __init__(self) -> None:
        self._by_handshake: "OrderedDict[int, tuple[Handshake, dict[tuple, Any]]]" = OrderedDict()

    def _entry(self, handshake: Handshake) -> dict[tuple, Any]:
        entry = self._by_handshake.get(id(handshake))
        if entry is None or entry[0] is not handshake:
            entry = self._by_handshake[id(handshake)] = (handshake, {})
            while len(self._by_handshake) > self.LIMIT:
                self._by_handshake.popitem(last=False)
        else:
            self._by_handshake.move_to_end(id(handshake))
        return entry[1]

    def reads(self, handshake: Handshake, decide: Callable[[], RankReads]) -> "RankReads | KVXferError":
        """``decide()`` (``check_compatible`` then ``rank_reads``) for this handshake: its reads, or
        the ``KVXferError`` it raised, remembered either way."""
        entry = self._entry(handshake)
        verdict = entry.get(("reads",))
        if verdict is None:
            try:
                verdict = decide()
            except KVXferError as exc:
                verdict = exc
            entry[("reads",)] = verdict
        return verdict

    def get(self, handshake: Handshake, key: tuple, backend: Any, meta: dict[str, Any]) -> Any:
        """The prepared form of ``meta`` for ``backend``; the meta itself if it cannot be prepared
        (then the read refuses it where it always did, with its own error)."""
        entry = self._entry(handshake)
        prepared = entry.get(key)
        if prepared is None:
            try:
                prepared = entry[key] = backend.prepare_peer(meta)
            except KVXferError:
                return meta
        return prepared

    def __len__(self) -> int:
        return len(self._by_handshake)


def _block_run(theirs: "Sequence[int]", first: int, mine: "Sequence[int]", where: str
               ) -> "tuple[list[int], list[int]] | str":
    """The producer's blocks ``first..`` paired with this decode's ``mine``, or why the ticket is short."""
    picked = list(theirs[first: first + len(mine)])
    if len(picked) < len(mine):
        return (f"the ticket names {len(theirs)} blocks{where}, the request needs blocks "
                f"{first}..{first + len(mine) - 1}")
    return picked, list(mine)


def group_pairs(spec: LoadSpec, ticket: Ticket) -> "list[tuple[str, list[int], list[int]]] | str":
    """Per KV cache group of a hybrid model, its kind and the producer's and this decode's block ids,
    paired in order (an attention group's from its first block, a Mamba group's one running slot to
    the decode's one), or why they cannot be."""
    if len(ticket.groups) != len(spec.groups):
        return f"the ticket has {len(ticket.groups)} KV cache groups, this decode's model {len(spec.groups)}"
    out = []
    for index, (load, theirs) in enumerate(zip(spec.groups, ticket.groups)):
        if load.group.kind == MAMBA:
            if len(load.local_block_ids) != 1 or len(theirs) != 1:
                return (f"KV cache group {index} (Mamba state) pairs {len(theirs)} prefill slot(s) with "
                        f"{len(load.local_block_ids)} decode slot(s); a Mamba state is one slot on each side")
            out.append((MAMBA, [theirs[0]], [load.local_block_ids[0]]))
            continue
        run = _block_run(theirs, load.first_block, load.local_block_ids, f" of KV cache group {index}")
        if isinstance(run, str):
            return run
        out.append((load.group.kind, *run))
    return out


def block_pairs(spec: LoadSpec, ticket: Ticket) -> "tuple[list[int], list[int]] | str":
    """The producer's and this decode's block ids, paired in order, or why they cannot be. One group:
    the ticket's blocks from ``first_block`` on. A hybrid model: every transfer group's pairs
    (``group_pairs``) in one list (all groups' pages are one registered region)."""
    if not spec.groups:
        return _block_run(ticket.block_ids, spec.first_block, spec.local_block_ids, "")
    groups = group_pairs(spec, ticket)
    if isinstance(groups, str):
        return groups
    return [b for _, remote, _ in groups for b in remote], [b for _, _, local in groups for b in local]


def load_pairs(spec: LoadSpec, ticket: Ticket, ratio: int, prefill_block: int
               ) -> "list[tuple[list[int], list[int]]] | str":
    """The producer's and this decode's block ids to read, paired in order: one pair of lists with equal
    block sizes (``block_pairs``), else one per sub-block index (``block_sizes.sub_block_pairs``)."""
    if ratio == 1 or spec.groups:  # a hybrid model's blocks are read whole (different sizes are refused)
        paired = block_pairs(spec, ticket)
        return paired if isinstance(paired, str) else [paired]
    return sub_block_pairs(ticket.block_ids, spec.first_block, spec.local_block_ids, ratio, ticket.num_tokens,
                           prefill_block)


class Receiver:
    def __init__(self, *, tp_rank: int, backend_name: str, layout: EngineLayout, regions: Sequence[Any],
                 scratch_backend: Any, scratch: torch.Tensor, handshakes: HandshakeCache,
                 cluster_key: Optional[bytes], handshake_timeout_s: float, transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
                 spin_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._tp_rank = tp_rank
        self._backend_name = backend_name
        self._layout = layout
        self._regions = list(regions)
        self._windows = StageWindows(self._regions, layout)  # layer windows of its regions, for a PP prefill
        self._scratch_backend = scratch_backend
        self.slots = ScratchSlots(scratch)
        self._handshakes = handshakes
        self._cluster_key = cluster_key
        self._handshake_timeout_s = handshake_timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        self._spin_s = spin_s
        self._clock = clock
        self._loads: dict[str, _Load] = {}
        self._prepared = PreparedSources()
        self._quarantined: Quarantine[str, _Load] = Quarantine()
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self.counters = {"handoffs": 0, "handoff_failures": 0, "refused": 0, "bytes": 0, "descriptors": 0,
                         "quarantined": 0, **{f"failed_{kind}": 0 for kind in FAILURE_KINDS}}
        #: per handoff since the worker last took them (``interval_stats``, for vLLM's histograms):
        #: seconds, bytes, descriptors
        self.interval_handoffs: list[tuple[float, int, int]] = []
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        set_decider = getattr(handshakes, "set_decider", None)
        if set_decider is not None:  # worked out off this thread, once per handshake (handshake_cache)
            set_decider(self._decide_reads)

    # --- the step's entry points ---------------------------------------------------------
    def submit(self, spec: LoadSpec) -> None:
        if spec.request_id in self._loads:
            logger.warning("kvxfer vllm: request %s is already loading; duplicate ignored", spec.request_id)
            return
        load = self._loads[spec.request_id] = _Load(spec, self._clock())
        self._step(load)  # post now: the read overlaps the rest of the engine step


    def collect(self) -> tuple[set[str], set[str]]:
        """``(finished_recving, failed_recving)`` since the last call (failed ones are in both)."""
        back = self.slots.reclaim()
        if back:
            logger.info("kvxfer vllm: %d lease scratch slot(s) back in use: no byte can land in them any more",
                        len(back))
        for load in list(self._loads.values()):
            self._step(load)
        self._spin()
        for held in self._quarantined.reclaim():
            self.counters["quarantined"] -= 1
            logger.warning("kvxfer vllm: request %s: no byte can land any more; reporting its failure now", held.key)
            self._report_failed(held.item, held.reason)
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
            moving = [load for load in self._loads.values() if load.read is not None]
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
            if load.lease is not None:  # its lease reads' scratch slots: back, or held until none can land
                load.lease.drop(f"request {load.spec.request_id!r}: unexpected failure")
            self._fail_or_quarantine(load, f"unexpected {type(exc).__name__}: {exc}", safe, "transfer")

    def window_registrations(self) -> list[Any]:
        """The layer-window registrations made for pipeline-stage reads (``pp_stages.StageWindows``), for the
        worker to close with (before) its regions; forgotten here."""
        return self._windows.take()

    @property
    def in_flight(self) -> int:
        return len(self._loads) + len(self._quarantined)

    def poll(self, request_id: str) -> Optional[KVPoll]:
        """A load's state; a quarantined one is still ``Transferring`` (a byte may land), an unknown one None."""
        load = self._loads.get(request_id)
        if load is not None:
            return load.state
        return KVPoll.Transferring if request_id in self._quarantined else None

    def states(self) -> dict[str, int]:
        """How many loads are in each state (quarantined ones apart), for ``stats()``."""
        out = {state.name: 0 for state in (KVPoll.Bootstrapping, KVPoll.Transferring)}
        for load in self._loads.values():
            out[load.state.name] += 1
        out["quarantined"] = len(self._quarantined)
        return out

    # --- the state machine --------------------------------------------------------------------
    def _advance(self, load: _Load) -> None:
        spec = load.spec
        if load.read is not None:
            return self._advance_read(load)
        if spec.refusal:
            return self._refuse(load, spec.refusal)
        if load.ticket is None:
            try:
                load.ticket = parse_ticket(spec.params, block_size=self._layout.block_size,
                                           groups=[g.group for g in spec.groups] or None)
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
                                          f"{ticket.host}:{ticket.port} failed: {exc}", "handshake")
            if load.handshake is None:
                limit = 2 * self._handshake_timeout_s + 1
                if self._handshakes.preparing(ticket.host, ticket.port):
                    # the producer answered; its sources' confirmation waits on for a source that provably lives
                    # (a starved prefill worker answers late: latency, not a failed request) and ends by itself
                    limit += self._transfer_timeout_s + LIVE_SOURCE_WAIT_S
                if self._clock() - load.started > limit:
                    return self._refuse(load, f"no handshake from prefill engine {ticket.engine_id!r} in time",
                                        "handshake")
                return None
        handshake = load.handshake
        if ticket.instance != handshake.instance:
            # the producer restarted since we cached it: ask again once (unless just fetched)
            if not load.refetched:
                if self._handshakes.invalidate(ticket.host, ticket.port):
                    load.refetched, load.handshake = True, None
                    return None
                if self._clock() - load.started < REFETCH_AFTER_S + 1:
                    return None  # ours is too fresh to refetch (a sleep and wake take seconds): ask on a later step
            return self._refuse(load, f"kv_transfer_params name prefill instance {ticket.instance!r} but "
                                      f"{ticket.host}:{ticket.port} now runs {handshake.instance!r} (restarted): "
                                      "the blocks are gone", "handshake")
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
        verdict = self._verdict(ticket, handshake)
        if isinstance(verdict, KVXferError):
            load.failing = str(verdict)
            self.counters["refused"] += 1
            load.reads = RankReads((), notify_ranks(self._tp_rank, self._layout.tp_size, handshake.layout.tp_size))
            return self._start_read(load)  # a verified ticket: let the producer free its blocks now
        load.reads = verdict
        load.marks["checked"] = self._clock()
        if not spec.local_block_ids:  # release only: no block to read, the lease read tells the producer
            return self._start_read(load)
        if ticket.block_size is not None and ticket.block_size != handshake.layout.block_size:
            return self._refuse(load, f"the ticket was made with block_size {ticket.block_size}, the prefill's "
                                      f"handshake says {handshake.layout.block_size}")
        paired = load_pairs(spec, ticket, verdict.ratio, handshake.layout.block_size)
        if isinstance(paired, str):
            return self._refuse(load, paired)
        remote = [b for src, _ in paired for b in src]
        pool = handshake.layout.num_blocks
        if remote and max(remote) >= pool:  # signed by the producer, but checked against what it serves
            return self._refuse(load, f"the ticket names block {max(remote)}, the prefill's pool has {pool} blocks")
        if not remote:
            return self._start_read(load)
        self._post_data(load, paired)

    def _verdict(self, ticket: Ticket, handshake: Handshake) -> "RankReads | KVXferError":
        """This rank's reads of ``handshake`` or why it is refused: as the handshake cache worked it out off
        the step thread (``set_decider``), else (a cache without one) once here, remembered."""
        lookup = getattr(self._handshakes, "verdict", None)
        verdict = lookup(ticket.host, ticket.port, handshake) if lookup is not None else None
        if verdict is not None:
            return verdict
        return self._prepared.reads(handshake, lambda: self._decide_reads(handshake))

    def _decide_reads(self, handshake: Handshake) -> RankReads:
        check_compatible(self._layout, self._backend_name, handshake)
        return rank_reads(self._tp_rank, self._layout, handshake.layout)

    def _post_data(self, load: _Load, paired: "list[tuple[list[int], list[int]]]") -> None:
        """``paired``: the blocks to read, one pair of id lists per sub-block index (``load_pairs``)."""
        ticket, handshake = load.ticket, load.handshake
        assert ticket is not None and handshake is not None
        assert load.reads is not None
        if len(paired) == 1 and self._post_chained(load, *paired[0]):
            return
        labels = {n.rank: reader_label(ticket.request_id, n.reader, n.readers) for n in load.reads.notify}
        for read, region, src_ids, dst_ids, parts in self._data_reads(load, paired):
            meta = handshake.rank_kv_metas[read.src_rank][region]
            try:
                # a stage's region i goes into the window of the decode's region holding its layers (``pp_stages``)
                backend = self._windows.get(read.targets[region]) if isinstance(read, StageRead) \
                    else self._regions[region]
                source = self._prepared.get(handshake, ("kv", read.src_rank, region), backend, meta)
                handle = begin_data_read(backend, source, src_ids, dst_ids, parts=parts,
                                         request_id=labels.get(read.src_rank, ticket.request_id))
            except KVXferError as exc:
                posted_safe = abort_parts(load.data, f"request {ticket.request_id!r}: another region failed to start")
                safe = posted_safe and (not isinstance(exc, TransferStartError) or exc.storage_safe)
                if not load.data and not isinstance(exc, TransferStartError):
                    return self._refuse(load, f"{exc}")
                return self._fail_or_quarantine(load, f"starting the pull failed: {exc}", safe, "transfer")
            load.bytes += handle.bytes_requested
            load.descriptors += handle.descriptors_posted
            load.data.append(handle)
        load.marks["data_posted"] = self._clock()
        self._start_read(load)

    def _data_reads(self, load: _Load, paired: "list[tuple[list[int], list[int]]]") -> Iterator[
            tuple[Any, int, list[int], list[int], Optional[tuple[SlicePart, ...]]]]:
        """Each data read to post: ``(read, region, src ids, dst ids, parts)``. A slab read (one per
        prefill rank read from, one with equal TP) reads its slabs of every region; a part read (NHD
        across TP, a smaller prefill block) the parts of its slabs, per sub-block index; a page read (a
        hybrid model with different TP) its parts of each group's pages."""
        assert load.reads is not None and load.ticket is not None and load.handshake is not None
        groups = None
        for read in load.reads.reads:
            regions = min(len(self._regions), len(load.handshake.rank_kv_metas[read.src_rank]))
            if isinstance(read, PageRead) and regions:
                if groups is None:  # once per load, for every prefill rank read from
                    groups = group_pairs(load.spec, load.ticket)
                    if isinstance(groups, str):  # block_pairs accepted these same pairs: cannot happen
                        raise KVXferError(groups)
                for kind, src_ids, dst_ids in groups:
                    parts = read.parts_for(kind)
                    if parts and dst_ids:
                        yield read, 0, src_ids, dst_ids, parts
                continue
            if isinstance(read, StageRead):  # every region of the stage, each into its window of the decode's
                src_ids, dst_ids = read.slabs.ids(*paired[0])
                for region in range(min(len(read.targets), len(load.handshake.rank_kv_metas[read.src_rank]))):
                    yield read, region, src_ids, dst_ids, None
            elif isinstance(read, SlabRead):
                src_ids, dst_ids = read.ids(*paired[0])
                for region in range(regions):  # each region with its meta (parse_handshake: one per region)
                    yield read, region, src_ids, dst_ids, None
            elif isinstance(read, PartRead):
                for (remote, local), parts in zip(paired, read.parts):  # sub-block j: its blocks, its parts
                    if remote:
                        src_ids, dst_ids = read.slabs.ids(remote, local)
                        for region in range(regions):
                            yield read, region, src_ids, dst_ids, parts

    def _post_chained(self, load: _Load, remote: list[int], local: list[int]) -> bool:
        """One region read from one prefill rank that is also the one rank told "done" (equal TP):
        the transport reads the lease itself, chained behind the data read (``begin_chained_pull``),
        so the lease read leaves the moment the data landed, with no trip through this step. False
        (nothing taken) where it cannot: the reads are then posted one after the other, as always."""
        ticket, handshake, reads = load.ticket, load.handshake, load.reads
        assert ticket is not None and handshake is not None and reads is not None
        backend = self._regions[0]
        if not backend.chains_guard_reads or len(self._regions) != 1 or len(reads.reads) != 1 \
                or len(reads.notify) != 1:
            return False
        read, notice = reads.reads[0], reads.notify[0]
        if not isinstance(read, SlabRead) or notice.rank != read.src_rank or notice.readers != 1:
            return False
        source = self._prepared.get(handshake, ("kv", read.src_rank, 0), backend, handshake.rank_kv_metas[read.src_rank][0])
        lease = self._prepared.get(handshake, ("lease", notice.rank), self._scratch_backend,
                                   handshake.rank_lease_metas[notice.rank])
        slot = self.slots.take()
        if slot is None:
            return False
        address = self.slots.address(slot)
        try:
            src_ids, dst_ids = read.ids(remote, local)
            guard = ChainedGuard(lease, ticket.slot, address, self.slots.tensor.element_size()) if address else None
            handle = None if guard is None else backend.begin_chained_pull(source, src_ids, dst_ids, guard,
                                                                           request_id=ticket.request_id)
        except KVXferError as exc:
            if isinstance(exc, TransferStartError) and not exc.storage_safe:
                self.slots.quarantine(slot, exc.cleanup_handles)
            else:
                self.slots.give_back(slot)
            if not isinstance(exc, TransferStartError):
                self._refuse(load, f"{exc}")
            else:
                self._fail_or_quarantine(load, f"starting the pull failed: {exc}", exc.storage_safe, "transfer")
            return True
        except Exception:  # outside the contract: whether a get was posted is unknown, so the slot is never reused
            self.slots.quarantine(slot, [])
            raise
        if handle is None:
            self.slots.give_back(slot)
            return False
        load.bytes += handle.bytes_requested
        load.descriptors += handle.descriptors_posted
        load.data.append(handle)
        load.marks["data_posted"] = self._clock()
        load.lease = ChainedLeaseGuard(self.slots, slot, handle, ticket.lease, notice.rank, pinned_at_offer=False,
                                       explain=self._lease_explainer(ticket))
        load.read = GuardedRead(load.data, load.lease)
        self._advance_read(load)
        return True

    @staticmethod
    def _lease_explainer(ticket: Ticket) -> Callable[[Any, int], str]:
        return lambda rank, seen: (
            f"prefill rank {rank} released request {ticket.request_id!r}'s blocks before the read completed "
            f"(lease {ticket.lease}, slot now {seen}: pin_grace_s passed, or a restart); the pulled bytes are "
            "discarded")

    def _start_read(self, load: _Load) -> None:
        """The data reads are posted (or there are none): after them, one 8-byte lease read per prefill
        rank this rank notifies, which carries the read-done (``kvxfer.handoff.guard`` keeps the order)."""
        ticket, handshake = load.ticket, load.handshake
        assert ticket is not None and handshake is not None and load.reads is not None
        read_from = {read.src_rank for read in load.reads.reads}
        lease_meta = lambda rank: self._prepared.get(handshake, ("lease", rank), self._scratch_backend,  # noqa: E731
                                                     handshake.rank_lease_metas[rank])
        targets = [LeaseTarget(lease_meta(n.rank), ticket.slot,
                               reader_label(ticket.request_id, n.reader, n.readers), n.rank, n.rank in read_from)
                   for n in load.reads.notify]
        load.lease = LeaseSlotGuard(self.slots, self._scratch_backend, targets, ticket.lease, pinned_at_offer=False,
                                    explain=self._lease_explainer(ticket))
        load.read = GuardedRead(load.data, load.lease)
        self._advance_read(load)

    def _advance_read(self, load: _Load) -> None:
        read, lease = load.read, load.lease
        assert read is not None and lease is not None and load.ticket is not None and load.reads is not None
        request_id = load.ticket.request_id
        try:
            done = read.poll()
        except KVXferError as exc:
            if read.phase is Phase.DATA and isinstance(exc, TransferError):
                safe = abort_parts(load.data, f"request {request_id!r}: a sibling region failed")
                lease.drop(f"request {request_id!r}: the data read failed")  # a chained guard's slot
                return self._fail_or_quarantine(load, str(exc), safe, "transfer")
            if read.phase is Phase.WAITING:  # its siblings already posted were dropped by the guard
                return self._finish_failed(load, load.failing or f"reading the lease failed to start: {exc}",
                                           None if load.failing else "lease")
            if read.phase is Phase.GUARD and isinstance(exc, TransferError):
                lease.drop(f"request {request_id!r}: a sibling lease read failed")
                return self._finish_failed(load, load.failing or
                                           f"reading the lease of the prefill's blocks failed: {exc}",
                                           None if load.failing else "lease")
            raise
        if read.guard_handles is not None and "lease_posted" not in load.marks:
            load.marks["lease_posted"] = self._clock()
        if not done:
            if read.phase is Phase.WAITING:  # every scratch slot is in use: try again next step, up to the timeout
                now = self._clock()
                load.slot_wait = load.slot_wait if load.slot_wait is not None else now
                if now - load.slot_wait > self._transfer_timeout_s:
                    self._finish_failed(load, load.failing or (
                        f"no lease scratch slot came free within transfer_timeout_s={self._transfer_timeout_s}s "
                        f"({self.slots.quarantined} held by failed reads that may still land)"),
                        None if load.failing else "scratch")
            return None
        if load.failing:
            return self._finish_failed(load, load.failing)
        if not load.reads.notify:
            return self._finish_failed(load, "no prefill rank to read the lease from")
        if read.verdict is not None:  # the prefill revoked the lease: its blocks were freed before we read them
            return self._finish_failed(load, read.verdict, "lease")
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
        self.interval_handoffs.append((elapsed, load.bytes, load.descriptors))
        phases = {f"{name}_s": at - load.started for name, at in load.marks.items()}
        self.recent.append({"request_id": load.spec.request_id, "handoff_s": elapsed, "bytes": load.bytes,
                            "descriptors": load.descriptors, "blocks": len(load.spec.local_block_ids), **phases})
        if load.spec.awaiting:
            self._finished.add(load.spec.request_id)

    def _refuse(self, load: _Load, reason: str, kind: str = "refused") -> None:
        """Nothing was posted: safe to report at once."""
        self.counters["refused"] += 1
        self._finish_failed(load, reason, kind)

    def _fail_or_quarantine(self, load: _Load, reason: str, storage_safe: bool, kind: str) -> None:
        load.fail_kind = kind
        if storage_safe:
            return self._finish_failed(load, reason, kind)
        self._loads.pop(load.spec.request_id, None)
        self._quarantined.hold(load.spec.request_id, load.data, reason, load)
        self.counters["quarantined"] += 1
        logger.error("kvxfer vllm: request %s: %s; a byte may still land in its %d blocks, so they stay held (not "
                     "reported to vLLM) until the transport proves otherwise", load.spec.request_id, reason,
                     len(load.spec.local_block_ids))

    def _finish_failed(self, load: _Load, reason: str, kind: Optional[str] = None) -> None:
        """``kind``: why (``FAILURE_KINDS``); None keeps the one set when it was decided (``failing``)."""
        if kind is not None:
            load.fail_kind = kind
        self._loads.pop(load.spec.request_id, None)
        self._report_failed(load, reason)

    def _report_failed(self, load: _Load, reason: str) -> None:
        if not load.spec.awaiting:
            logger.info("kvxfer vllm: releasing request %s at its prefill failed: %s", load.spec.request_id, reason)
            return
        self.counters["handoff_failures"] += 1
        self.counters[f"failed_{load.fail_kind}"] += 1
        logger.error("kvxfer vllm: request %s: KV load failed: %s", load.spec.request_id, reason)
        self.recent.append({"request_id": load.spec.request_id, "failed": reason})
        self._finished.add(load.spec.request_id)
        self._failed.add(load.spec.request_id)
