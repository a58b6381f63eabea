"""The backend contract: what every transport implements, written once.

A backend owns one registered paged pool. The *decode* side calls
``begin_pull_blocks`` with the prefill side's ``export_meta()``; the transport does
one-sided reads of the requested blocks into our pool and, when they are done,
tells the source, whose ``drain_read_done()`` then returns the request id so the
prefill engine can free its blocks.

``begin_pull_blocks`` takes the per-request meta exactly as Megatron's engine builds
it (flat, ``tp_metas`` or ``pp_metas``, with added request fields; ``docs/megatron.md``):
it finds every source record, plans the TP/PP/SSM reshard against each, checks
they hold everything this rank needs, and only then posts, returning one handle.

Everything that is the same for every transport (geometry, peer-meta parsing,
block-id checks, planning, bounds, the handle's state machine and timeouts) lives
here; a transport implements the few ``_``-prefixed hooks.

The failure rule every handle keeps (``TransferHandle``; docs/api.md): a handle
raises a ``TimeoutError`` (``TransferTimeoutError``) whenever a byte of it may still
land in the destination, and any other ``TransferError`` only once none can. Callers
free the destination on the second, so a transport that cannot prove a read over
must say so (``_abort``/``_settle`` return False) rather than guess.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from typing import Any, ClassVar, Mapping, Optional, Sequence

import torch

from kvxfer.backends.staged import StagedHandle, StagingPort
from kvxfer.backends.staging import StagingArena, staging_bytes_from_env
from kvxfer.backends.stats import TransferStats
from kvxfer.backends.transfer import (  # the handle and request types: importable from here, the contract, too
    ChainedGuard,
    CompletedHandle,
    GroupHandle,
    PullRequest,
    ReadFailure,
    RequestId,
    TransferHandle,
    TransferStartError,
    TransferState,
    abort_parts,
    failure_for_caller,
)
from kvxfer.defaults import MAX_TIMEOUT_S, MIN_TIMEOUT_S, TRANSFER_TIMEOUT_S, SettingError, bounded_float
from kvxfer.errors import BackendClosedError, BackendUnavailableError, KVXferError, PeerMetadataError, TransferError
from kvxfer.plan.descriptors import CopyPlan, IdList
from kvxfer.meta.geometry import export_geometry_meta, parse_geometry_meta
from kvxfer.plan.geometry import PeerGeometry, PoolSpec, dtype_name, pool_geometry, takes_pool_spec
from kvxfer.meta.records import PreparedPeer, is_whole_request, plan_from_meta, transfer_peer_records
from kvxfer.plan.parts import SlicePart, plan_slice_parts
from kvxfer.plan.pool import LocalPool
from kvxfer.plan.prepared import BlockCopier
from kvxfer.plan.request import RecordPlan, RequestPlan, plan_pull
from kvxfer.meta.capabilities import conceal
from kvxfer.meta.seal import (
    HOST_FIELD, SEAL_FIELD, check_meta_seal, host_identity, meta_key_from_env, seal_meta,
    unauthenticated_metas_allowed_by_env,
)

logger = logging.getLogger(__name__)

__all__ = ["CompletedHandle", "GroupHandle", "KVTransportBackend", "PullRequest", "ReadFailure", "RequestId",
           "TransferHandle", "TransferStartError", "TransferState", "abort_parts", "checked_availability",
           "failure_for_caller"]

_MAX_COPIERS = 64  # prepared peers whose copier is kept (a vLLM decode: a few per prefill it reads from)
TIMEOUT_ENV = "KVXFER_TRANSFER_TIMEOUT_S"


def transfer_timeout_from_env() -> float:
    """The handle timeout when the caller names none: ``KVXFER_TRANSFER_TIMEOUT_S`` (seconds), else
    ``kvxfer.defaults.TRANSFER_TIMEOUT_S`` (30).

    Megatron constructs backends with fixed arguments and its waiter blocks the decode's
    scheduling step on ``wait()`` up to this long for a stalled source: this is how its users
    bound that.
    """
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return TRANSFER_TIMEOUT_S
    try:
        return bounded_float(TIMEOUT_ENV, raw, MIN_TIMEOUT_S, MAX_TIMEOUT_S, unit="seconds")
    except SettingError as exc:  # 1e308 or inf once passed: a stalled source then held wait() for good
        raise BackendUnavailableError(str(exc)) from None

#: Read-done / read-failed reports a source keeps undrained before it drops (and counts) new ones.
MAX_PENDING_NOTICES = 65536


def checked_availability(cls: type) -> tuple[bool, str]:
    """``cls.availability()`` as ``(bool, str)``, whatever a third party's backend does: an exception
    it raises, or an answer of another shape, makes it unavailable with that as the reason. The
    registry lists every backend through this, and a backend's constructor asks it, so a plugin can
    make only itself unavailable, never the listing (``kvxfer info``) or another backend."""
    try:
        answer = cls.availability()
    except Exception as exc:  # a plugin's own bug: reported as its reason, never raised to the caller
        return False, f"its availability() raised {type(exc).__name__}: {exc}"
    if isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool):
        ok, why = answer
        return ok, str(why) if why else ""
    return False, f"its availability() returned {answer!r:.200}, not (available: bool, reason: str)"


class _InUse:
    """``KVTransportBackend._in_use``'s context manager: a plain object, not a generator, because every
    post on an engine's step enters it (2.9 -> 1.2 us a time). Threads inside, by thread id, in
    ``_users``; close() waits on ``_gate`` until none but its own is left, so a thread leaving only
    notifies once close() has begun."""

    __slots__ = ("_backend",)

    def __init__(self, backend: "KVTransportBackend") -> None:
        self._backend = backend

    def __enter__(self) -> None:
        backend, me = self._backend, threading.get_ident()
        with backend._gate_lock:
            if backend._closed:
                raise BackendClosedError(f"{backend.name} backend {backend.agent_name!r} is closed")
            backend._users[me] = backend._users.get(me, 0) + 1

    def __exit__(self, *exc: object) -> None:
        backend, me = self._backend, threading.get_ident()
        with backend._gate_lock:
            left = backend._users[me] - 1
            if left:
                backend._users[me] = left
            else:
                del backend._users[me]
                if backend._closed:
                    backend._gate.notify_all()


class KVTransportBackend(ABC):
    """One transport's registration of one paged pool (see the module docstring)."""

    name: ClassVar[str]
    is_push: ClassVar[bool] = False
    #: The transport can read into a registered staging region (``local_base``), enabling staged reshard.
    supports_staging: ClassVar[bool] = False
    #: A peer meta can point this transport at another process's memory (so metas need authenticating).
    #: False (``local``): it reaches only its own process, so both sides run in one; the harness, the
    #: bench and the launcher ask the class this (and ``is_push``) rather than keep lists of names.
    reads_other_processes: ClassVar[bool] = True
    #: ``begin_chained_pull`` may post the guard read itself (else it always answers None).
    chains_guard_reads: ClassVar[bool] = False
    #: Fields of ``_transport_meta`` that let their holder read this pool (rkeys, read tokens): with the
    #: cluster key they travel encrypted (``kvxfer.meta.capabilities``), and the transport's parser opens them.
    capability_meta_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """``(True, "")`` if this backend can run here, else ``(False, how to fix it)``."""
        return True, ""

    @classmethod
    def transport_probe(cls) -> dict[str, Any]:
        """What this backend's transport would use here (libraries, UCX transports), for ``kvxfer info``.

        Empty for backends with nothing to report; never raises for a missing dependency.
        """
        return {}

    @takes_pool_spec
    def __init__(
        self,
        agent_name: str,
        *pool_args: Any,
        timeout_s: Optional[float] = None,
        meta_key: Optional[bytes] = None,
        allow_unauthenticated_metas: Optional[bool] = None,
        staging_bytes: Optional[int] = None,
        _parent: Optional["KVTransportBackend"] = None,
        **pool_kwargs: Any,
    ) -> None:
        """Register one pool. The entrance Megatron calls: ``agent_name`` then the pool's arguments
        (``PoolSpec``'s fields, positional or keyword, as the reference's backends take them; the
        signature shows them), then kvxfer's own keyword-only options, which Megatron never passes
        (so each defaults from the environment)."""
        spec = PoolSpec(*pool_args, **pool_kwargs)
        ok, why = checked_availability(type(self))
        if not ok:
            raise BackendUnavailableError(f"backend {self.name!r} cannot run here: {why}")
        if not isinstance(agent_name, str) or not agent_name:
            raise PeerMetadataError(f"agent_name must be a non-empty string, got {agent_name!r}")
        if timeout_s is None:  # Megatron passes no kvxfer arguments: the environment sets it
            timeout_s = transfer_timeout_from_env()
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.agent_name = agent_name
        # Metas are signed and checked with the cluster key (kvxfer.meta.seal); Megatron
        # passes no kvxfer arguments, so both default from the environment.
        self._meta_key = meta_key if meta_key is not None else meta_key_from_env()
        self._allow_unauthenticated = (unauthenticated_metas_allowed_by_env() if allow_unauthenticated_metas is None
                                       else bool(allow_unauthenticated_metas))
        self._parent = _parent  # the registration whose transport agent a sibling shares
        if staging_bytes is None:  # Megatron passes no kvxfer arguments: the environment sizes it
            staging_bytes = staging_bytes_from_env()
        if not isinstance(staging_bytes, int) or staging_bytes < 0:
            raise ValueError(f"staging_bytes must be an int >= 0 (0 disables staged reshard), got {staging_bytes!r}")
        self.staging_bytes = staging_bytes
        self._arena: Optional[StagingArena] = None  # made on the first staged pull
        #: The pool as the caller described it; ``geometry`` and ``local_pool`` are derived from it.
        self.pool_spec = spec
        self.memory_buffer = spec.memory_buffer
        self.timeout_s = float(timeout_s)
        self.geometry = pool_geometry(spec, self.name)
        self.dtype = spec.memory_buffer.dtype
        self.ssm_layout = spec.ssm
        self.ssm_state_kind = spec.ssm_state_kind
        #: This registration as planning sees it (``kvxfer.plan.request``).
        self.local_pool = LocalPool(self.geometry, dtype_name(self.dtype), self.ssm_layout, self.ssm_state_kind)
        self._closed = False
        # The gate between close() and the calls that touch the transport (``_in_use``): threads
        # inside it, by thread id; close() waits for them before it deregisters.
        self._gate_lock = threading.Lock()
        self._gate = threading.Condition(self._gate_lock)
        self._users: dict[int, int] = {}
        self._use = _InUse(self)
        self._closer: Optional[int] = None  # the thread running close()
        self._close_done = threading.Event()
        self._verified = _VerifiedMetas()
        #: SSM pools registered beside this one, by state kind: a KV pull checks the request's SSM
        #: metas against them before it posts (``_check_request_ssm``).
        self._ssm_siblings: dict[str, "KVTransportBackend"] = {}
        self._warned_unauthenticated = False
        self._stats = TransferStats()
        self._request_counter = itertools.count()
        #: each prepared peer's copier (or None: the general planner's case), by identity, bounded
        self._copiers: "OrderedDict[int, tuple[PreparedPeer, Optional[BlockCopier]]]" = OrderedDict()
        self._read_done: deque[RequestId] = deque()
        self._read_failed: deque[ReadFailure] = deque()
        self._register()

    # --- the public contract ----------------------------------------------------------------
    def export_meta(self) -> dict[str, Any]:
        """The geometry wire schema plus this transport's own fields (JSON-serialisable)."""
        meta = export_geometry_meta(self.geometry, self.ssm_layout, dtype=self.dtype, ssm_state_kind=self.ssm_state_kind)
        meta["backend"] = self.name
        meta["agent_name"] = self.agent_name
        meta[HOST_FIELD] = host_identity()
        with self._in_use():
            meta.update(self._transport_meta())
        if self._meta_key is not None:
            for field in self.capability_meta_fields:
                if meta.get(field) is not None:
                    meta[field] = conceal(meta[field], self._meta_key, field)
        return seal_meta(meta, self._meta_key)

    def begin_pull_blocks(
        self,
        peer_meta: Mapping[str, Any],
        src_block_ids: IdList,
        dst_block_ids: IdList,
        *,
        request_id: Optional[RequestId] = None,
        notify: bool = True,
        parts: Optional[Sequence[SlicePart]] = None,
    ) -> TransferHandle:
        """Read the blocks one request needs from every source the meta names into our ``dst_block_ids``.

        ``peer_meta`` is a peer's ``export_meta()``, extended or wrapped the way
        Megatron's engine does (``kvxfer.meta.records``); each source record reads
        its own ``block_ids`` or else ``src_block_ids``. Everything is validated and
        planned before anything is posted: a bad meta, bad ids, or sources that do not
        hold all this rank needs raise (``PeerMetadataError`` / ``BlockIdError`` /
        ``LayoutError``) with every pool untouched. A failure after a part was posted
        raises ``TransferStartError`` (posted parts aborted, ``storage_safe`` set).

        Sources are told "read done" under ``request_id``; without one (Megatron's
        calls) no read-done is sent, so a source that never drains is not filled up.
        ``notify=False`` also suppresses it, for a caller whose later read carries it
        (``kvxfer.handoff.generations``). Several sources give one ``GroupHandle``.

        ``parts``: read only these byte ranges of each block (``kvxfer.plan.parts``), from one source
        whose blocks are cut differently from ours (a hybrid model's pages across TP sizes); the
        meta must name that one source (a ``PreparedPeer`` or one ``export_meta()``).
        """
        self._check_open()
        if isinstance(peer_meta, PreparedPeer) and peer_meta.backend != self.name:
            raise PeerMetadataError(f"a peer prepared by the {peer_meta.backend} backend cannot be read by {self.name}")
        if request_id is None:
            label: RequestId = f"{self.agent_name}:{next(self._request_counter)}"
            notify = False
        elif not isinstance(request_id, (int, str)) or isinstance(request_id, bool):
            raise PeerMetadataError(f"request_id must be an int or a str, got {request_id!r}")
        else:
            label = request_id
        if self._arena is not None and self._arena.quarantined:
            self._arena.reclaim()  # staging behind reads that have ended since comes back (and tells their sources)
        if parts is not None:
            plan: Optional[RequestPlan] = self._plan_parts(peer_meta, src_block_ids, dst_block_ids, parts)
        elif isinstance(peer_meta, PreparedPeer):
            plan = self._plan_prepared(peer_meta, src_block_ids, dst_block_ids)
        else:
            plan = None
        if plan is None:
            self._check_request_ssm(peer_meta)
            plan = plan_from_meta(peer_meta, src_block_ids, dst_block_ids, self.local_pool, self.parse_peer_meta,
                                  staging_chunk_bytes=self._staging_chunk_bytes())
        self._check_plan(plan)
        pulls = [None if record is None else PullRequest.for_record(record, label, notify) for record in plan.records]
        total = plan.total_bytes
        self._stats.started(total, plan.num_descriptors)
        try:
            with self._in_use():  # a close() from here on waits until the posts are in its books
                handle = self._post_pulls(pulls, label)
        except BaseException:
            self._stats.failed(timed_out=False)  # counted as started above: never left "in flight"
            raise
        handle._count_in(self._stats, total, plan.num_descriptors)
        return handle

    def begin_chained_pull(self, peer_meta: PreparedPeer, src_block_ids: IdList, dst_block_ids: IdList,
                           guard: ChainedGuard, *, request_id: RequestId) -> Optional[TransferHandle]:
        """A guarded read in one handle: ``begin_pull_blocks``'s data read (no read-done), then ``guard``
        read by the transport itself strictly after every byte of the data landed (never if a data
        read failed), then the read-done under ``request_id`` to the guard's source. The handle is
        done when the guard read is; a failure of either read fails it, and ``storage_safe`` covers
        both. Raises as ``begin_pull_blocks`` does, before anything is posted.

        None where this transport (the default) or this pair cannot chain: the caller posts the two
        reads itself, in that order (``kvxfer.handoff.guard.GuardedRead``)."""
        return None

    def _copier_for(self, prepared: PreparedPeer) -> Optional[BlockCopier]:
        """The ``BlockCopier`` of this pool and a prepared peer, made once (None: the general planner's case)."""
        entry = self._copiers.get(id(prepared))
        if entry is None or entry[0] is not prepared:
            entry = self._copiers[id(prepared)] = (prepared, BlockCopier.for_pair(self.local_pool, prepared.peer))
            while len(self._copiers) > _MAX_COPIERS:
                self._copiers.popitem(last=False)
        else:
            self._copiers.move_to_end(id(prepared))
        return entry[1]

    def _plan_prepared(self, prepared: PreparedPeer, src_block_ids: IdList, dst_block_ids: IdList
                       ) -> Optional[RequestPlan]:
        """A prepared peer's request planned by its ``BlockCopier`` (what holds for every request
        between this pool and that source checked once), or None: the general planner's case."""
        copier = self._copier_for(prepared)
        if copier is None:
            return None
        src, dst, copy = copier.plan(src_block_ids, dst_block_ids)
        record = RecordPlan(prepared.meta, prepared.peer, src, dst, copy) if copy.num_descriptors else None
        return RequestPlan((record,))

    def _plan_parts(self, peer_meta: Any, src_block_ids: IdList, dst_block_ids: IdList,
                    parts: Sequence[SlicePart]) -> RequestPlan:
        """One source's request read as block parts (``begin_pull_blocks``'s ``parts``), planned and checked."""
        if self.is_push:
            raise PeerMetadataError(f"the {self.name} backend's sources push whole blocks; it cannot read block parts")
        if isinstance(peer_meta, PreparedPeer):
            meta, peer = peer_meta.meta, peer_meta.peer
        elif isinstance(peer_meta, Mapping) and not is_whole_request(peer_meta):
            meta, peer = peer_meta, self.parse_peer_meta(peer_meta)
        else:
            raise PeerMetadataError("a block-part read names one source: a prepared peer or one export_meta()")
        if peer.dtype != dtype_name(self.dtype) or peer.ssm_layout is not None or peer.geometry.layout is not None \
                or self.ssm_layout is not None or self.geometry.layout is not None:
            raise PeerMetadataError(f"a block-part read copies raw bytes between pools of one dtype and no shard "
                                    f"layout; the peer's pool is {peer.dtype}, ours {dtype_name(self.dtype)}")
        src, dst, copy = plan_slice_parts(peer.geometry, self.local_pool.geometry, src_block_ids, dst_block_ids, parts)
        return RequestPlan((RecordPlan(meta, peer, src, dst, copy) if copy.num_descriptors else None,))

    def _check_request_ssm(self, peer_meta: Any) -> None:
        """Megatron posts a request's KV pull before its SSM pulls, and the KV call's meta carries
        the SSM metas under ``"ssm"``: check each against the sibling pool of its state kind now,
        so a tampered SSM meta refuses the request before its KV reads are posted. Kinds without a
        sibling here are left to their own call."""
        ssm = peer_meta.get("ssm") if isinstance(peer_meta, Mapping) else None
        if not isinstance(ssm, Mapping) or not self._ssm_siblings:
            return
        for kind, meta in ssm.items():
            sibling = self._ssm_siblings.get(kind) if isinstance(kind, str) else None
            if sibling is None or sibling.closed:
                continue
            try:
                records = transfer_peer_records(meta, [])
                slots = len(records[0][1]) if records else 0
                plan_from_meta(meta, [], list(range(slots)), sibling.local_pool, sibling.parse_peer_meta)
            except KVXferError as exc:
                raise PeerMetadataError(
                    f"the request's SSM {kind} meta (under 'ssm') is refused, so nothing was posted: {exc}") from exc

    def _staging_chunk_bytes(self) -> int:
        """The chunk size a staged reshard may use now; 0 when this transport cannot stage.

        Chunks are a quarter of the region, so two pulls can each keep two posted (pipelining).
        When reads that could not be stopped hold most of the region (a stalled source), a pull
        reads directly into the pool instead of waiting for staging that may not come back soon.
        """
        if not self.supports_staging or self.staging_bytes == 0:
            return 0
        if self._arena is not None and self._arena.quarantined > self.staging_bytes // 2:
            logger.warning("%s %r: %d B of staging quarantined behind reads that may still land; resharding "
                           "without staging", self.name, self.agent_name, self._arena.quarantined)
            return 0
        return self.staging_bytes // 4

    def _staging_arena(self) -> StagingArena:
        """The staging region (made and registered with the transport on first use; never after close)."""
        if self._arena is None:
            self._check_open()
            tensor = torch.empty(self.staging_bytes, dtype=torch.uint8, device=self.memory_buffer.device)
            self._register_staging(tensor)
            self._arena = StagingArena(tensor)
        return self._arena

    def _start_pull(self, pull: "PullRequest") -> TransferHandle:
        if pull.staged:
            # The handle keeps the arena it starts with: one that fails after close() still releases
            # or quarantines its ranges there, and no staging is registered again by a closed backend.
            arena = self._staging_arena()
            port = StagingPort(arena=lambda: arena, post_read=self._post_read_open, notify_source=self._notify_source,
                               pool=self.memory_buffer, timeout_s=self.timeout_s)
            return StagedHandle(port, pull)
        return self._post_read(pull)

    def _post_read_open(self, pull: "PullRequest") -> TransferHandle:
        """``_post_read`` for reads posted later by a handle (a staged pull's chunks): refused with
        ``BackendClosedError`` once close() began, never posted to a transport being torn down."""
        with self._in_use():
            return self._post_read(pull)

    def _post_pulls(self, pulls: Sequence[Optional["PullRequest"]], request_id: RequestId) -> TransferHandle:
        """Post every planned part; one part's handle, or a ``GroupHandle`` over all records.

        A part that fails to start: nothing posted -> its error; posted parts aborted and none can
        still write -> ``TransferStartError(storage_safe=True)``; otherwise a handle already failed
        (raising ``TransferTimeoutError`` until its reads are over), never an error read only once.
        """
        handles: list[TransferHandle] = []
        try:
            for pull in pulls:
                handles.append(CompletedHandle(request_id) if pull is None else self._start_pull(pull))
        except Exception as exc:  # a KVXferError by contract; anything else is handled alike once a part is posted
            posted = [h for h in handles if not isinstance(h, CompletedHandle)]
            if not posted and not isinstance(exc, TransferStartError):
                raise  # nothing was posted: plainly safe
            safe = abort_parts(posted, f"request {request_id!r}: aborted, another part failed to start: {exc}")
            parts = posted + list(getattr(exc, "cleanup_handles", ()))
            safe &= getattr(exc, "storage_safe", True)
            message = (f"request {request_id!r}: part {len(handles) + 1} of {len(pulls)} failed to start after "
                       f"{len(posted)} part(s) were posted ({exc})")
            if safe:
                raise TransferStartError(f"{message}; no byte can land", storage_safe=True,
                                         cleanup_handles=posted) from exc
            # A byte may still land. A raised error is read once (Megatron copies its
            # transfer_destinations_safe and quarantines for good); a failed handle is waited on
            # again, and turns storage safe (and raises a plain error) once those reads are over.
            failed = GroupHandle(request_id, parts, self.timeout_s)
            with failed._lock:
                failed._fail(TransferError(message))
            failed._error.__cause__ = exc
            return failed
        return handles[0] if len(handles) == 1 else GroupHandle(request_id, handles, self.timeout_s)

    def drain_read_done(self) -> list[RequestId]:
        """Request ids whose reads of our blocks completed since the last call."""
        with self._in_use():
            self._collect_notifications()
        done = _drain(self._read_done)
        self._stats.notified(done=len(done), failed=0)
        return done

    def drain_read_failed(self) -> list[ReadFailure]:
        """Failure reports from readers since the last call: no read of that request is still in flight."""
        with self._in_use():
            self._collect_notifications()
        failed = _drain(self._read_failed)
        self._stats.notified(done=0, failed=len(failed))
        return failed

    def stats(self) -> dict[str, int]:
        """Counters: transfers started/completed/failed, timeouts, bytes, in flight, notifications,
        and the staging region (capacity, bytes in use, bytes quarantined)."""
        out = self._stats.snapshot()
        arena = self._arena
        if arena is not None:
            arena.reclaim()  # ranges whose late reads have ended since are free again
        out["staging_capacity"] = arena.capacity if arena is not None else 0
        out["staging_in_use"] = arena.in_use if arena is not None else 0
        out["staging_quarantined"] = arena.quarantined if arena is not None else 0
        return out

    def new_registered_buffer(self, **kwargs: Any) -> "KVTransportBackend":
        """Register a sibling buffer (e.g. an SSM state pool) on this backend's transport agent.

        Megatron passes its own ``agent_name`` for each sibling; it names the
        registration, while the transport agent (one per rank: one connection per
        peer, one progress engine) stays this backend's.
        """
        self._check_open()
        kwargs.setdefault("agent_name", self.agent_name)
        kwargs.setdefault("timeout_s", self.timeout_s)
        kwargs.setdefault("meta_key", self._meta_key)
        kwargs.setdefault("allow_unauthenticated_metas", self._allow_unauthenticated)
        with self._in_use():  # registered on our transport agent, which close() must not release meanwhile
            sibling = type(self)(**kwargs, _parent=self)
        if sibling.ssm_state_kind is not None:
            self._ssm_siblings[sibling.ssm_state_kind] = sibling
        return sibling

    def close(self) -> None:
        """Deregister the buffer and release the transport. Idempotent, and safe against every other
        call on other threads: calls that touch the transport (posting a pull, draining notices,
        exporting the meta) and began before are waited for, so their handles are failed and their
        reads ended with the rest; those that begin after raise ``BackendClosedError``. A second
        close() returns once the first is done."""
        me = threading.get_ident()
        with self._gate:
            if self._closed:
                first = self._closer
            else:
                first = None
                self._closed = True
                self._closer = me
                while any(thread != me for thread in self._users):
                    self._gate.wait()
        if first is not None:
            if first != me:  # another thread is closing: return once it is closed
                self._close_done.wait()
            return
        try:
            self._deregister()  # the transport releases its staging registration there too
            self._arena = None
        finally:
            self._close_done.set()

    def _in_use(self) -> "_InUse":
        """Hold the registration open across a call that touches the transport: ``BackendClosedError``
        if close() has begun, else close() waits until this block is left. Re-entrant per thread."""
        return self._use

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "KVTransportBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- shared machinery -----------------------------------------------------------------
    def prepare_peer(self, peer_meta: Mapping[str, Any]) -> PreparedPeer:
        """Verify and parse one source's ``export_meta()`` once, for many requests from it: pass the
        result to ``begin_pull_blocks`` in the meta's place (any sibling registration of the same
        backend type may use it). Only a meta as exported: a wrapper naming several sources, block
        ids or SSM metas is per request, and refused here."""
        self._check_open()
        if (not isinstance(peer_meta, Mapping) or is_whole_request(peer_meta)
                or any(key in peer_meta for key in ("block_ids", "ssm"))):
            raise PeerMetadataError("prepare_peer takes one source's export_meta() as exported (no tp_metas, "
                                    "pp_metas, block_ids or ssm: those are per request)")
        meta = copy.deepcopy(dict(peer_meta))
        return PreparedPeer(self.name, meta, self.parse_peer_meta(meta))

    def parse_peer_meta(self, peer_meta: Mapping[str, Any]) -> PeerGeometry:
        """Check one source record's seal and fields; only sealed fields are read.

        A peer's meta is the same for every request, so a verified one is remembered
        (``_VerifiedMetas``): a later meta whose sealed fields are identical, type for
        type, skips the canonical JSON, hashing and parsing.
        """
        cached = self._verified.lookup(peer_meta)
        if cached is not None:
            return cached
        sealed = check_meta_seal(peer_meta, self._meta_key, allow_unauthenticated=self._allow_unauthenticated)
        if self._meta_key is None and self.reads_other_processes and not self._warned_unauthenticated:
            self._warned_unauthenticated = True
            logger.warning(
                "%s %r: peer metas are UNAUTHENTICATED (no KVXFER_SECRET_FILE): %s; a meta decides where this "
                "process reads from, so set KVXFER_SECRET_FILE to the cluster secret", self.name, self.agent_name,
                "metas from any host are accepted" if self._allow_unauthenticated else
                "only metas sealed on this host are accepted, and any process of this host can pose as a source")
        peer = parse_geometry_meta(sealed)
        if sealed.get("backend") != self.name:
            raise PeerMetadataError(
                f"peer meta field 'backend' is {sealed.get('backend')!r}; this is the {self.name!r} backend, "
                "and both sides must use the same one"
            )
        if not isinstance(sealed.get("agent_name"), str) or not sealed["agent_name"]:
            raise PeerMetadataError("peer meta field 'agent_name' must be a non-empty string")
        self._check_peer_source(sealed, peer_meta[SEAL_FIELD]["sha256"])
        self._verified.store(peer_meta, sealed, peer)
        return peer

    def _check_peer_source(self, sealed: dict[str, Any], digest: str) -> None:
        """A backend's own check that a sealed meta's source is real, once per meta (before it is
        remembered as verified); ``PeerMetadataError`` refuses it. Nothing to check by default."""

    def plan_pull(self, peer: PeerGeometry, src_block_ids: IdList, dst_block_ids: IdList) -> CopyPlan:
        """The direct byte rows one record's pull reads (``kvxfer.plan.request.plan_pull``), bounds-checked."""
        return plan_pull(self.local_pool, peer, src_block_ids, dst_block_ids)

    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError(f"{self.name} backend {self.agent_name!r} is closed")

    def _deliver_read_done(self, request_id: RequestId) -> None:
        if len(self._read_done) >= MAX_PENDING_NOTICES:
            self._stats.notice_dropped()
        else:
            self._read_done.append(request_id)

    def _deliver_read_failed(self, request_id: RequestId, reason: str) -> None:
        if len(self._read_failed) >= MAX_PENDING_NOTICES:
            self._stats.notice_dropped()
        else:
            self._read_failed.append(ReadFailure(request_id, reason))

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    # --- transport hooks ------------------------------------------------------------------
    @abstractmethod
    def _register(self) -> None:
        """Register ``self.memory_buffer`` with the transport."""

    @abstractmethod
    def _deregister(self) -> None:
        """Release everything ``_register`` and transfers acquired."""

    def _transport_meta(self) -> dict[str, Any]:
        """Fields a peer needs to reach our memory (JSON-serialisable)."""
        return {}

    @abstractmethod
    def _post_read(self, pull: "PullRequest") -> TransferHandle:
        """Post the planned reads (already validated and bounds-checked) and return their handle."""

    def _check_plan(self, plan: RequestPlan) -> None:
        """A transport's own refusals of a planned request, before anything is posted (default: none)."""

    def _collect_notifications(self) -> None:
        """Move transport notifications into ``_read_done`` / ``_read_failed``."""

    def _notify_source(self, peer_meta: Mapping[str, Any], request_id: RequestId,
                       failure: Optional[str] = None) -> None:
        """Tell the source of one record that ``request_id`` is over: read-done, or read-failed
        (``failure``, the reason) with none of its reads still in flight.

        For handles whose reads do not report themselves: a staged pull (one notice for all
        its chunk reads), a verified pull whose check could not start. A plain read tells its
        source itself.
        """

    def _register_staging(self, tensor: torch.Tensor) -> None:
        """Register the staging region as a read destination (``supports_staging`` transports);
        ``_deregister`` releases it."""
        raise NotImplementedError(f"the {self.name} backend cannot read into a staging region")


def _identical(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (``1 == 1.0 == True`` does not count)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return a == b


class _VerifiedMetas:
    """Peer metas already verified and parsed, keyed by their seal (bounded, most recent kept)."""

    LIMIT = 64

    def __init__(self) -> None:
        self._entries: "OrderedDict[tuple, tuple[dict[str, Any], PeerGeometry]]" = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(meta: Any) -> Optional[tuple]:
        seal = meta.get("meta_seal") if isinstance(meta, Mapping) else None
        if not isinstance(seal, Mapping):
            return None
        key = (seal.get("sha256"), seal.get("hmac"))
        return key if all(isinstance(part, (str, type(None))) for part in key) else None

    def lookup(self, meta: Any) -> Optional[PeerGeometry]:
        key = self._key(meta)
        if key is None:
            return None
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is None:
            return None
        sealed, peer = entry
        missing = object()
        if all(_identical(meta.get(name, missing), value) for name, value in sealed.items()):
            return peer
        return None

    def store(self, meta: Any, sealed: dict[str, Any], peer: PeerGeometry) -> None:
        key = self._key(meta)
        if key is None:
            return
        with self._lock:
            self._entries[key] = (copy.deepcopy(sealed), peer)  # the caller may mutate its meta later
            while len(self._entries) > self.LIMIT:
                self._entries.popitem(last=False)


def _drain(queue: deque) -> list:
    out = []
    while queue:
        out.append(queue.popleft())
    return out

