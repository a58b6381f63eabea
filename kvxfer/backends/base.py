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
import enum
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, ClassVar, Hashable, Mapping, Optional, Sequence

import numpy as np
import torch

from kvxfer.plan.descriptors import CopyPlan, IdList, check_plan_bounds, plan_block_copies, validate_block_ids
from kvxfer.errors import (
    BackendClosedError,
    BackendUnavailableError,
    KVXferError,
    LayoutError,
    PeerMetadataError,
    TransferCancelledError,
    TransferError,
    TransferTimeoutError,
)
from kvxfer.plan.geometry import (
    PeerGeometry,
    check_peer_compatible,
    compute_buffer_geometry,
    dtype_name,
    export_geometry_meta,
    parse_geometry_meta,
    staging_geometry,
)
from kvxfer.plan.layout import KVShardLayout
from kvxfer.plan.peer_records import is_whole_request, transfer_peer_records
from kvxfer.plan.reshard import check_covers, check_same_model, intersect
from kvxfer.plan.reshard_descriptors import plan_reshard_pull, reshard_transfers_for_pull
from kvxfer.plan.staged_reshard import StagedChunk, plan_staged_kv, staging_pays
from kvxfer.plan.ssm_layout import SSMShardLayout
from kvxfer.backends.stats import TransferStats
from kvxfer.security.meta_seal import (
    HOST_FIELD, check_meta_seal, host_identity, meta_key_from_env, seal_meta, unauthenticated_metas_allowed_by_env,
)

logger = logging.getLogger("kvxfer.backends")

RequestId = Hashable  # an int or a str in practice; it travels in notifications

DEFAULT_TIMEOUT_S = 30.0

#: Read-done / read-failed reports a source keeps undrained before it drops (and counts) new ones.
MAX_PENDING_NOTICES = 65536


class TransferStartError(TransferError):
    """Starting a transfer failed after part of it may already have been posted.

    The seed's ``transfer_backends.base.TransferStartError``: ``storage_safe`` says
    whether any byte can still land in the destination blocks (False: quarantine
    them), ``cleanup_handles`` are the parts that were posted (already aborted), and
    ``transfer_destinations_safe`` is the attribute Megatron's engine reads. A failure
    before anything was posted is an ordinary ``KVXferError`` and plainly safe.
    """

    def __init__(self, message: str, storage_safe: bool = False, resources: Any = None,
                 cleanup_handles: Sequence["TransferHandle"] = ()) -> None:
        super().__init__(message)
        self.storage_safe = bool(storage_safe)
        self.transfer_destinations_safe = self.storage_safe
        self.resources = resources
        self.cleanup_handles = list(cleanup_handles)


class TransferState(str, enum.Enum):
    """A handle's whole lifecycle: in progress, done, or failed (final)."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


class TransferHandle(ABC):
    """One pull, as seen by the decode side.

    ``poll()`` drives it without blocking; ``wait()`` blocks. A handle that fails
    (transport error or timeout) is final, and ``storage_safe`` says whether the
    destination blocks can be reused: True only once no byte can still land in them.

    The failure contract, as callers read it (Megatron frees the destination on any
    exception that is not a ``TimeoutError``; docs/api.md): a failed handle raises

    - ``TransferTimeoutError`` (a ``TimeoutError``) while ``storage_safe`` is False,
      whatever the cause: some read may still land, keep the blocks quarantined;
    - once ``storage_safe`` is True, the failure itself (a plain ``TransferError``),
      or ``TransferCancelledError`` for a timeout whose cancellation is proven.

    So the class raised follows the storage, not the cause: a handle that timed out
    with a read still posted raises ``TransferTimeoutError`` until the transport
    proves that read over (it completed late, failed, or its source died), then a
    plain error. ``error`` is the cause, as first seen.
    """

    def __init__(self, request_id: RequestId, timeout_s: float) -> None:
        self.request_id = request_id
        self.timeout_s = timeout_s
        self.started_at = time.monotonic()
        self.finished_at: Optional[float] = None
        self._state = TransferState.PROC
        self._error: Optional[TransferError] = None
        self._storage_safe = False
        # Re-entrant: raising reads ``storage_safe``, which may settle the transport under the same lock.
        self._lock = threading.RLock()
        self._raised: dict[bool, TransferError] = {}  # the error as raised, per storage state
        self._stats: Optional[TransferStats] = None  # set by the backend that posted it
        self._num_bytes = 0

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def error(self) -> Optional[TransferError]:
        """The cause of the failure, as first seen (what is *raised* depends on ``storage_safe``)."""
        return self._error

    @property
    def storage_safe(self) -> bool:
        """True once no byte of this transfer can still land in the destination.

        A failed handle whose transport could not prove that at once is checked
        again on every read of this property (``_settle``), so it turns True as soon
        as the late read ends, fails, or its source is gone.
        """
        if self._state is TransferState.DONE:
            return True
        if self._state is TransferState.PROC:
            return False
        if not self._storage_safe:
            with self._lock:
                if not self._storage_safe and self._settle_safely():
                    self._storage_safe = True
                    if self._stats is not None:
                        self._stats.unsafe(-1)
                    self._on_settled()
        return self._storage_safe

    @property
    def elapsed_s(self) -> float:
        return (self.finished_at or time.monotonic()) - self.started_at

    def poll(self) -> bool:
        """True when complete, False while in flight; raises on failure (see the class docstring)."""
        with self._lock:
            if self._state is TransferState.PROC:
                self._advance()
            if self._state is TransferState.ERR:
                raise self._failure_to_raise()
            return self._state is TransferState.DONE

    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Block until done. Past ``timeout_s`` (default: the handle's own timeout) the
        transfer is aborted and the failure raised: ``TransferTimeoutError`` while a read
        may still land, ``TransferCancelledError`` once the cancellation is proven."""
        deadline = self.started_at + self.timeout_s if timeout_s is None else time.monotonic() + timeout_s
        pause = 1e-5
        while not self.poll():
            if time.monotonic() >= deadline:
                with self._lock:
                    if self._state is TransferState.PROC:
                        self._fail(TransferTimeoutError(
                            f"request {self.request_id!r}: transfer not complete after {self.elapsed_s:.3f}s (wait timeout)"
                        ))
                self.poll()  # raises the (possibly concurrent) error
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def _failure_to_raise(self) -> TransferError:
        """The failure in the class the storage calls for (made once per storage state)."""
        safe = self.storage_safe
        raised = self._raised.get(safe)
        if raised is None:
            raised = self._raised[safe] = failure_for_caller(self._error, safe)
        return raised

    def _count_in(self, stats: TransferStats, num_bytes: int) -> None:
        """Attach the posting backend's counters; a handle already finished is counted now."""
        self._stats, self._num_bytes = stats, num_bytes
        if self._state is TransferState.DONE:
            stats.completed(num_bytes)
        elif self._state is TransferState.ERR and not self._storage_safe:
            stats.unsafe(+1)

    def _advance(self) -> None:
        try:
            done = self._progress()
        except TransferError as exc:
            self._fail(exc)
            return
        except Exception as exc:  # any other error still ends the handle: never PROC past its timeout
            failure = TransferError(f"request {self.request_id!r}: {type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            self._fail(failure)
            return
        if done:
            self._state = TransferState.DONE
            self.finished_at = time.monotonic()
            if self._stats is not None:
                self._stats.completed(self._num_bytes)
            self._on_done()
        elif time.monotonic() - self.started_at > self.timeout_s:
            self._fail(TransferTimeoutError(
                f"request {self.request_id!r}: transfer not complete within its {self.timeout_s}s timeout; "
                "the source may be dead or unreachable"
            ))

    def _fail(self, error: TransferError) -> None:
        self._state = TransferState.ERR
        self._error = error
        self.finished_at = time.monotonic()
        if self._stats is not None:
            self._stats.failed(timed_out=isinstance(error, TransferTimeoutError))
        try:
            try:
                self._storage_safe = bool(self._abort())
            except Exception:  # an abort that breaks proves nothing: the storage stays unsafe
                logger.exception("request %r: aborting the transfer failed; its destination stays quarantined",
                                 self.request_id)
                self._storage_safe = False
        finally:
            if not self._storage_safe and self._stats is not None:
                self._stats.unsafe(+1)
            try:
                self._on_failed(error)
            except Exception:  # telling the source is best effort; the handle's failure stands
                logger.exception("request %r: reporting the failure failed", self.request_id)

    def _settle_safely(self) -> bool:
        try:
            return bool(self._settle())
        except Exception:
            logger.exception("request %r: checking whether the failed transfer is over failed", self.request_id)
            return False

    # --- transport hooks ------------------------------------------------------------------
    @abstractmethod
    def _progress(self) -> bool:
        """Advance the transport; True when every byte has landed. Raise ``TransferError`` on failure."""

    def _abort(self) -> bool:
        """Cancel and release what is in flight; return True only if no byte can still land."""
        return True

    def _settle(self) -> bool:
        """After a failure that ``_abort`` could not prove safe: True once no byte can land now."""
        return False

    def _on_settled(self) -> None:
        """Called once when a failed handle's storage turns safe after ``_abort`` (e.g. tell the source)."""

    def _on_done(self) -> None:
        """Called once on success (e.g. tell the source its blocks are free)."""

    def _on_failed(self, error: TransferError) -> None:
        """Called once on failure (e.g. tell the source the request failed)."""


def failure_for_caller(error: Optional[TransferError], storage_safe: bool) -> TransferError:
    """``error`` in the class that tells a caller whether the destination may be reused.

    Unsafe storage is always a ``TransferTimeoutError`` (a ``TimeoutError``: "may
    still be active"); safe storage never is (a timeout whose cancellation is proven
    becomes ``TransferCancelledError``). Any other safe failure is raised as it is.
    """
    if error is None:
        error = TransferError("transfer failed")
    if storage_safe:
        if not isinstance(error, TransferTimeoutError):
            return error
        raised: TransferError = TransferCancelledError(
            f"{error}; it was cancelled and no byte of it can land any more (storage_safe=True)")
    else:
        raised = TransferTimeoutError(
            f"{error}; part of it may still land (storage_safe=False): keep the destination blocks "
            "quarantined until handle.storage_safe is True")
    raised.__cause__ = error
    return raised


class CompletedHandle(TransferHandle):
    """A pull with nothing to move (e.g. a peer holding none of our slices)."""

    def __init__(self, request_id: RequestId) -> None:
        super().__init__(request_id, timeout_s=0.0)
        self._state = TransferState.DONE
        self.finished_at = self.started_at

    def _progress(self) -> bool:
        return True


class GroupHandle(TransferHandle):
    """One request pulled from several peers: done when every part is, failed when any fails.

    Its storage is safe only when every part's is: a part that failed while another is
    still reading makes the group raise ``TransferTimeoutError`` until that one is over.
    """

    def __init__(self, request_id: RequestId, parts: Sequence[TransferHandle], timeout_s: float) -> None:
        super().__init__(request_id, timeout_s)
        self.parts = list(parts)

    def _progress(self) -> bool:
        return all([part.poll() for part in self.parts])  # poll all, even after one is pending

    def _abort(self) -> bool:
        return abort_parts(self.parts, f"request {self.request_id!r}: aborted with its group")

    def _settle(self) -> bool:
        return all(part.storage_safe for part in self.parts)


def abort_parts(parts: Sequence[Optional[TransferHandle]], reason: str) -> bool:
    """Fail every part still in flight; True if no byte of any part can still land."""
    safe = True
    for part in parts:
        if part is None:
            continue
        with part._lock:
            if part.state is TransferState.PROC:
                part._fail(TransferError(reason))
        safe &= part.storage_safe
    return safe


@dataclass(frozen=True)
class PullRequest:
    """One validated pull, handed to a transport's ``_post_read``."""

    peer_meta: Mapping[str, Any]
    peer: PeerGeometry
    src_ids: np.ndarray
    dst_ids: np.ndarray
    plan: CopyPlan
    request_id: RequestId
    notify: bool = True  # send the source a read-done when the read completes
    #: Tell the source when this read fails. False for a read that is part of a larger pull whose
    #: handle tells the source itself, once (the chunks of a staged reshard).
    report_failure: bool = True
    #: A staged reshard (``kvxfer.backends.staged``): chunks read into staging, then placed; ``plan`` is unused.
    staged: tuple[StagedChunk, ...] = ()
    #: Absolute address the plan's destination offsets are from, when not our pool (a staging range).
    local_base: Optional[int] = None

    @property
    def total_bytes(self) -> int:
        return sum(c.read.total_bytes for c in self.staged) if self.staged else self.plan.total_bytes

    @property
    def num_descriptors(self) -> int:
        return sum(c.read.num_descriptors for c in self.staged) if self.staged else self.plan.num_descriptors


@dataclass(frozen=True)
class ReadFailure:
    """A read-failure report received by a source: the request and why it failed."""

    request_id: RequestId
    reason: str


class KVTransportBackend(ABC):
    """One transport's registration of one paged pool (see the module docstring)."""

    name: ClassVar[str]
    is_push: ClassVar[bool] = False
    #: The transport can read into a registered staging region (``local_base``), enabling staged reshard.
    supports_staging: ClassVar[bool] = False

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

    def __init__(
        self,
        agent_name: str,
        memory_buffer: torch.Tensor,
        expected_num_blocks: int,
        tp_size: Optional[int] = None,
        tp_rank: Optional[int] = None,
        num_kv_heads_global: Optional[int] = None,
        heads_per_partition: Optional[int] = None,
        head_dim: Optional[int] = None,
        tokens_per_block: Optional[int] = None,
        global_rank: Optional[int] = None,
        pp_size: Optional[int] = None,
        pp_rank: Optional[int] = None,
        num_layers_global: Optional[int] = None,
        layer_start: Optional[int] = None,
        layer_end: Optional[int] = None,
        ssm_layout: Any = None,
        ssm_state_kind: Optional[str] = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        meta_key: Optional[bytes] = None,
        allow_unauthenticated_metas: Optional[bool] = None,
        staging_bytes: Optional[int] = None,
        _parent: Optional["KVTransportBackend"] = None,
    ) -> None:
        ok, why = self.availability()
        if not ok:
            raise BackendUnavailableError(f"backend {self.name!r} cannot run here: {why}")
        if not isinstance(agent_name, str) or not agent_name:
            raise PeerMetadataError(f"agent_name must be a non-empty string, got {agent_name!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.agent_name = agent_name
        # Metas are signed and checked with the cluster key (kvxfer.security.meta_seal); Megatron
        # passes no kvxfer arguments, so both default from the environment.
        self._meta_key = meta_key if meta_key is not None else meta_key_from_env()
        self._allow_unauthenticated = (unauthenticated_metas_allowed_by_env() if allow_unauthenticated_metas is None
                                       else bool(allow_unauthenticated_metas))
        self._parent = _parent  # the registration whose transport agent a sibling shares
        if staging_bytes is None:  # Megatron passes no kvxfer arguments: the environment sizes it
            from kvxfer.backends.staging import staging_bytes_from_env

            staging_bytes = staging_bytes_from_env()
        if not isinstance(staging_bytes, int) or staging_bytes < 0:
            raise ValueError(f"staging_bytes must be an int >= 0 (0 disables staged reshard), got {staging_bytes!r}")
        self.staging_bytes = staging_bytes
        self._arena: Optional[Any] = None  # kvxfer.backends.staging.StagingArena, made on first staged pull
        self.memory_buffer = memory_buffer
        self.timeout_s = float(timeout_s)
        self.geometry = compute_buffer_geometry(
            memory_buffer, expected_num_blocks, backend_name=self.name,
            tp_size=tp_size, tp_rank=tp_rank, num_kv_heads_global=num_kv_heads_global,
            heads_per_partition=heads_per_partition, head_dim=head_dim, tokens_per_block=tokens_per_block,
            global_rank=global_rank, pp_size=pp_size, pp_rank=pp_rank, num_layers_global=num_layers_global,
            layer_start=layer_start, layer_end=layer_end, ssm_layout=ssm_layout, ssm_state_kind=ssm_state_kind,
        )
        self.dtype = memory_buffer.dtype
        self.ssm_layout = None if ssm_layout is None else SSMShardLayout.coerce(ssm_layout)
        self.ssm_state_kind = ssm_state_kind
        self._closed = False
        self._verified = _VerifiedMetas()
        self._warned_unauthenticated = False
        self._stats = TransferStats()
        self._request_counter = itertools.count()
        self._read_done: deque[RequestId] = deque()
        self._read_failed: deque[ReadFailure] = deque()
        self._register()

    # --- the public contract ----------------------------------------------------------------
    def export_meta(self) -> dict[str, Any]:
        """The geometry wire schema plus this transport's own fields (JSON-serialisable)."""
        self._check_open()
        meta = export_geometry_meta(self.geometry, self.ssm_layout, dtype=self.dtype, ssm_state_kind=self.ssm_state_kind)
        meta["backend"] = self.name
        meta["agent_name"] = self.agent_name
        meta[HOST_FIELD] = host_identity()
        meta.update(self._transport_meta())
        return seal_meta(meta, self._meta_key)

    def begin_pull_blocks(
        self,
        peer_meta: Mapping[str, Any],
        src_block_ids: IdList,
        dst_block_ids: IdList,
        *,
        request_id: Optional[RequestId] = None,
        notify: bool = True,
    ) -> TransferHandle:
        """Read the blocks one request needs from every source the meta names into our ``dst_block_ids``.

        ``peer_meta`` is a peer's ``export_meta()``, extended or wrapped the way
        Megatron's engine does (``kvxfer.plan.peer_records``); each source record reads
        its own ``block_ids`` or else ``src_block_ids``. Everything is validated and
        planned before anything is posted: a bad meta, bad ids, or sources that do not
        hold all this rank needs raise (``PeerMetadataError`` / ``BlockIdError`` /
        ``LayoutError``) with every pool untouched. A failure after a part was posted
        raises ``TransferStartError`` (posted parts aborted, ``storage_safe`` set).

        Sources are told "read done" under ``request_id``; without one (Megatron's
        calls) no read-done is sent, so a source that never drains is not filled up.
        ``notify=False`` also suppresses it, for a caller whose later read carries it
        (``kvxfer.runtime.generations``). Several sources give one ``GroupHandle``.
        """
        self._check_open()
        if request_id is None:
            label: RequestId = f"{self.agent_name}:{next(self._request_counter)}"
            notify = False
        elif not isinstance(request_id, (int, str)) or isinstance(request_id, bool):
            raise PeerMetadataError(f"request_id must be an int or a str, got {request_id!r}")
        else:
            label = request_id
        if self._arena is not None and self._arena.quarantined:
            self._arena.reclaim()  # staging behind reads that have ended since comes back (and tells their sources)
        pulls = self.plan_request(peer_meta, src_block_ids, dst_block_ids, label, notify)
        total = sum(p.total_bytes for p in pulls if p is not None)
        self._stats.started(total, sum(p.num_descriptors for p in pulls if p is not None))
        try:
            handle = self._post_pulls(pulls, label)
        except BaseException:
            self._stats.failed(timed_out=False)  # counted as started above: never left "in flight"
            raise
        handle._count_in(self._stats, total)
        return handle

    def plan_request(self, peer_meta: Mapping[str, Any], src_block_ids: IdList, dst_block_ids: IdList,
                     request_id: RequestId, notify: bool) -> list[Optional["PullRequest"]]:
        """One validated, planned ``PullRequest`` per source record (None: nothing to read there).

        Pure with respect to the transport: nothing is posted here.
        """
        records = transfer_peer_records(peer_meta, src_block_ids)
        if not records:
            raise PeerMetadataError("peer meta names no source (empty tp_metas/pp_metas)")
        peers = [self.parse_peer_meta(meta) for meta, _ in records]
        ids = [validate_block_ids(src, dst_block_ids, peer.geometry.num_blocks, self.geometry.num_blocks)
               for (_, src), peer in zip(records, peers)]
        # A wrapped meta (or several records) is the whole request, as in Megatron; a bare
        # meta is one peer, which reads what it holds of ours (nothing, possibly).
        chosen = self._sources_to_read(peers, complete=is_whole_request(peer_meta) or len(records) > 1)
        pulls: list[Optional[PullRequest]] = []
        for i, ((meta, _), peer, (src_ids, dst_ids)) in enumerate(zip(records, peers, ids)):
            if i not in chosen:
                pulls.append(None)
                continue
            staged = self._plan_staged(peer, src_ids, dst_ids)
            if staged:
                pulls.append(PullRequest(meta, peer, src_ids, dst_ids, staged[0].read, request_id, notify,
                                         staged=tuple(staged)))
                continue
            plan = self.plan_pull(peer, src_ids, dst_ids)
            pulls.append(None if plan.num_descriptors == 0 else
                         PullRequest(meta, peer, src_ids, dst_ids, plan, request_id, notify))
        return pulls

    def _plan_staged(self, peer: PeerGeometry, src_ids: np.ndarray, dst_ids: np.ndarray) -> list[StagedChunk]:
        """Chunks of a staged KV reshard when the transport can stage and per-token fragments would be small."""
        if not self.supports_staging or self.staging_bytes == 0 or self.ssm_state_kind is not None or src_ids.size == 0:
            return []
        transfers = reshard_transfers_for_pull(self, peer)
        if not transfers or not staging_pays(transfers, peer.geometry, self.geometry):
            return []
        if self._arena is not None and self._arena.quarantined > self.staging_bytes // 2:
            # Reads that could not be stopped hold most of the region (a stalled source): read
            # directly into the pool instead of waiting for staging that may not come back soon.
            logger.warning("%s %r: %d B of staging quarantined behind reads that may still land; resharding "
                           "without staging", self.name, self.agent_name, self._arena.quarantined)
            return []
        # Chunks of a quarter of the region: two pulls can each keep two chunks posted (pipelining).
        chunks = plan_staged_kv(peer.geometry, self.geometry, transfers, src_ids, dst_ids, self.staging_bytes // 4)
        for chunk in chunks:
            check_plan_bounds(chunk.read, peer.geometry, staging_geometry(chunk.staging_bytes))
        return chunks

    def _staging_arena(self) -> Any:
        """The staging region (made and registered with the transport on first use)."""
        if self._arena is None:
            from kvxfer.backends.staging import StagingArena

            tensor = torch.empty(self.staging_bytes, dtype=torch.uint8, device=self.memory_buffer.device)
            self._register_staging(tensor)
            self._arena = StagingArena(tensor)
        return self._arena

    def _start_pull(self, pull: "PullRequest") -> TransferHandle:
        if pull.staged:
            from kvxfer.backends.staged import StagedHandle

            return StagedHandle(self, pull)
        return self._post_read(pull)

    def _sources_to_read(self, peers: Sequence[PeerGeometry], complete: bool) -> set[int]:
        """Indices of the records to read: with layouts, one per (layer window, head range),
        the lowest global rank. ``complete``: the records claim to be every source of the
        request, so they must hold all this rank needs."""
        if self.ssm_state_kind is not None:
            own: Any = self.ssm_layout
            layouts: list[Any] = [p.ssm_layout for p in peers]
        else:
            own, layouts = self.geometry.layout, [p.geometry.layout for p in peers]
        if own is None or any(x is None for x in layouts):
            if len(peers) > 1:
                raise LayoutError("pulling from several sources needs a shard layout on this pool and on every source")
            return {0}
        check_same_model([own], layouts)
        best: dict[tuple, int] = {}
        for i in sorted(range(len(layouts)), key=lambda i: layouts[i].global_rank):
            best.setdefault((layouts[i].local_layer_range(), layouts[i].local_head_range()), i)
        chosen = sorted(best.values())
        for pos, a in enumerate(chosen):
            for b in chosen[pos + 1:]:
                la, lb = layouts[a], layouts[b]
                if intersect(la.local_layer_range(), lb.local_layer_range()) and intersect(la.local_head_range(), lb.local_head_range()):
                    raise LayoutError(
                        f"sources of global rank {la.global_rank} and {lb.global_rank} hold overlapping but different "
                        "slices; pass the ranks of one prefill instance"
                    )
        if complete:
            check_covers(own, [layouts[i] for i in chosen])
        return set(chosen)

    def _post_pulls(self, pulls: Sequence[Optional["PullRequest"]], request_id: RequestId) -> TransferHandle:
        """Post every planned part; one part's handle, or a ``GroupHandle`` over all records."""
        handles: list[TransferHandle] = []
        try:
            for pull in pulls:
                handles.append(CompletedHandle(request_id) if pull is None else self._start_pull(pull))
        except KVXferError as exc:
            posted = [h for h in handles if not isinstance(h, CompletedHandle)]
            if not posted and not isinstance(exc, TransferStartError):
                raise  # nothing was posted: plainly safe
            safe = abort_parts(posted, f"request {request_id!r}: aborted, another part failed to start: {exc}")
            safe &= getattr(exc, "storage_safe", True)
            raise TransferStartError(
                f"request {request_id!r}: part {len(handles) + 1} of {len(pulls)} failed to start after "
                f"{len(posted)} part(s) were posted ({exc}); storage_safe={safe}",
                storage_safe=safe, cleanup_handles=posted,
            ) from exc
        return handles[0] if len(handles) == 1 else GroupHandle(request_id, handles, self.timeout_s)

    def drain_read_done(self) -> list[RequestId]:
        """Request ids whose reads of our blocks completed since the last call."""
        self._check_open()
        self._collect_notifications()
        done = _drain(self._read_done)
        self._stats.notified(done=len(done), failed=0)
        return done

    def drain_read_failed(self) -> list[ReadFailure]:
        """Failure reports from readers since the last call: no read of that request is still in flight."""
        self._check_open()
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
        return type(self)(**kwargs, _parent=self)

    def close(self) -> None:
        """Deregister the buffer and release the transport. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._deregister()  # the transport releases its staging registration there too
        self._arena = None

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "KVTransportBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- shared machinery -----------------------------------------------------------------
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
        if self._meta_key is None and not self._warned_unauthenticated:
            self._warned_unauthenticated = True
            logger.warning(
                "%s %r: peer metas are UNAUTHENTICATED (no KVXFER_SECRET_FILE): %s; a meta decides where this "
                "process reads from, so set KVXFER_SECRET_FILE to the cluster secret", self.name, self.agent_name,
                "metas from any host are accepted" if self._allow_unauthenticated else
                "only metas sealed on this host are accepted, and any process of this host can make one")
        peer = parse_geometry_meta(sealed)
        if sealed.get("backend") != self.name:
            raise PeerMetadataError(
                f"peer meta field 'backend' is {sealed.get('backend')!r}; this is the {self.name!r} backend, "
                "and both sides must use the same one"
            )
        if not isinstance(sealed.get("agent_name"), str) or not sealed["agent_name"]:
            raise PeerMetadataError("peer meta field 'agent_name' must be a non-empty string")
        self._verified.store(peer_meta, sealed, peer)
        return peer

    def plan_pull(self, peer: PeerGeometry, src_block_ids: IdList, dst_block_ids: IdList) -> CopyPlan:
        """Validate compatibility and ids, and plan the byte ranges (bounds-checked).

        When both sides carry a shard layout (KV ``layout``, or SSM ``ssm_layout``)
        the plan reads only the layer x head slices this rank owns (``kvxfer.plan.reshard``).
        """
        reshard = plan_reshard_pull(self, peer, src_block_ids, dst_block_ids)
        if reshard is not None:
            return reshard
        check_peer_compatible(self.geometry, self.dtype, peer)
        return plan_block_copies(peer.geometry, self.geometry, src_block_ids, dst_block_ids)

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

