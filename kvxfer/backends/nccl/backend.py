"""``nccl``: a push backend on ``torch.distributed`` point-to-point (NCCL for GPU pools, Gloo for host pools).

Both sides take part (``docs/nccl.md``). The decode's ``begin_pull_blocks`` posts one
receive per source record into a staging buffer; the prefill's
``begin_push_blocks`` gathers, per decode rank, every byte that rank needs into one
staging buffer behind a 64-byte header and posts one send. Sends and receives pair
by post order per (prefill rank, decode rank): both sides run the same planner
(``push_plan``), and the receiver checks the header (size, ranks, fingerprint of the
source blocks) before it scatters a byte into its pool.

What the reference (Megatron's ``NcclTransferBackend``) lacks and this adds: one
message per (request, peer) instead of one per block x head fragment, reusable
staging on the device, a timeout and an honest ``storage_safe`` on every handle,
the process group's error on a dead peer, and a refusal to reuse a peer pair whose
message order can no longer be trusted.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from kvxfer.backends.base import (
    CompletedHandle, KVTransportBackend, PullRequest, RequestId, TransferHandle, TransferStartError,
)
from kvxfer.backends.nccl.completion import Completion, peer_error
from kvxfer.backends.nccl.push_plan import check_replica_source, placeholder_destination, plan_push
from kvxfer.backends.nccl.staging import ByteRows, Lease, StagingPool, pool_bytes
from kvxfer.backends.nccl.wire import HEADER_BYTES, MessageHeader
from kvxfer.errors import BackendUnavailableError, KVXferError, PeerMetadataError, TransferError
from kvxfer.plan.descriptors import IdList, validate_block_ids
from kvxfer.meta.records import transfer_peer_records
from kvxfer.plan.request import RequestPlan
from kvxfer.meta.seal import check_meta_seal

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover - torch builds without distributed
    dist = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: Gloo matches on it, keeping kvxfer's messages apart from an engine's own tag-0 traffic.
#: NCCL ignores tags: there, only post order pairs messages (give kvxfer its own group).
P2P_TAG = 0x6B76

_NO_GROUP_FIX = (
    "the nccl backend moves KV with torch.distributed point-to-point operations and needs an initialised "
    "default process group spanning the prefill and decode ranks: call torch.distributed.init_process_group("
    "'nccl') for GPU pools, ('gloo') for host-memory pools, or ('cpu:gloo,cuda:nccl') for both, on every rank, "
    "before constructing the backend"
)


@dataclass
class _Abandoned:
    """Buffers of an aborted transfer that a transport may still touch, kept until its works settle."""

    completion: Completion
    leases: list[Lease]
    pool: StagingPool
    peers: tuple[int, ...]
    reason: str


class _Transport:
    """What one rank's registrations share: the group, this rank, staging pools, unsettled aborted ops."""

    def __init__(self, group: Any) -> None:
        if dist is None or not dist.is_available():
            raise BackendUnavailableError("torch was built without torch.distributed; " + _NO_GROUP_FIX)
        if not dist.is_initialized():
            raise BackendUnavailableError(_NO_GROUP_FIX)
        self.group = group
        self.group_key = id(group if group is not None else dist.group.WORLD)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if group is not None and dist.get_rank(group) < 0:
            raise BackendUnavailableError(f"global rank {self.rank} is not a member of the process group passed as process_group")
        self.group_backend = str(dist.get_backend(group))
        self._pools: dict[str, StagingPool] = {}
        self._abandoned: list[_Abandoned] = []
        self._lock = threading.Lock()

    def check_device(self, device: torch.device) -> None:
        """The group must have a backend for the pool's device: NCCL for CUDA, Gloo for host memory."""
        need = "nccl" if device.type == "cuda" else "gloo"
        if device.type not in ("cuda", "cpu"):
            raise BackendUnavailableError(f"the nccl backend moves CUDA or host-memory pools, not {device.type}")
        if need not in self.group_backend.lower():
            raise BackendUnavailableError(
                f"the pool is in {'GPU' if need == 'nccl' else 'host'} memory, which needs a {need.upper()} process "
                f"group, but the group's backend is {self.group_backend!r}; initialise it with "
                f"init_process_group('{need}') or 'cpu:gloo,cuda:nccl'"
            )

    def staging(self, device: torch.device) -> StagingPool:
        with self._lock:
            return self._pools.setdefault(str(device), StagingPool(device))

    def peer_rank(self, meta: Mapping[str, Any], device_type: str) -> int:
        """The rank a (sealed) peer meta names, checked against this transport.

        Called after ``parse_peer_meta`` authenticated the meta (cluster key or host);
        here only its sealed fields are read.
        """
        sealed = check_meta_seal(meta, allow_unauthenticated=True)
        if sealed.get("transport") != "nccl":
            raise PeerMetadataError(f"peer meta field 'transport' is {sealed.get('transport')!r}, expected 'nccl'")
        rank = sealed.get("nccl_rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise PeerMetadataError(f"peer meta field 'nccl_rank' must be a rank in [0, {self.world_size}), got {rank!r}")
        if sealed.get("nccl_world_size") != self.world_size:
            raise PeerMetadataError(
                f"the peer's process group has {sealed.get('nccl_world_size')!r} ranks, ours {self.world_size}: "
                "both sides must share one default process group"
            )
        if sealed.get("nccl_device") != device_type:
            raise PeerMetadataError(
                f"the peer's pool is in {sealed.get('nccl_device')!r} memory, ours in {device_type!r}: NCCL moves "
                "GPU pools and Gloo host pools, and both sides must use the same one"
            )
        if rank == self.rank:
            raise PeerMetadataError(f"the peer meta names this rank ({rank}); point-to-point needs two ranks")
        return rank

    def check_usable(self, peer: int) -> None:
        """Refuse a peer whose message order cannot be trusted (see ``docs/nccl.md``)."""
        error = peer_error(self.group_key, peer)
        if error is not None:
            raise TransferError(
                f"point-to-point with rank {peer} failed earlier ({error}); the pair is unusable. Recreate the "
                "process group (restart the ranks) before transferring with it again"
            )
        self.prune()
        with self._lock:
            stale = next((a for a in self._abandoned if peer in a.peers), None)
        if stale is not None:
            raise TransferError(
                f"an operation with rank {peer} from an aborted transfer ({stale.reason}) is still posted: a new "
                "message would pair with it. Retry once the peer has caught up, or recreate the process group"
            )

    def post(self, ops: Sequence[tuple[Any, torch.Tensor, int]], device: torch.device) -> Completion:
        """Post one batch of isend/irecv; a failure to post is a ``TransferError`` with the group's error."""
        p2p = [dist.P2POp(op, tensor, peer, group=self.group, tag=P2P_TAG) for op, tensor, peer in ops]
        try:
            works = dist.batch_isend_irecv(p2p)
        except Exception as exc:
            raise TransferError(f"posting point-to-point operations with rank(s) {[p for *_, p in ops]} failed: "
                                f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}") from None
        return Completion(works, [peer for *_, peer in ops], threaded=device.type != "cuda", group_key=self.group_key)

    def abandon(self, entry: _Abandoned) -> None:
        logger.warning("transfer with rank(s) %s aborted while posted (%s); its buffers are kept until it settles",
                       list(entry.peers), entry.reason)
        with self._lock:
            self._abandoned.append(entry)

    def prune(self) -> None:
        """Return the buffers of aborted transfers whose works have settled."""
        with self._lock:
            settled = [a for a in self._abandoned if a.completion.settled()]
            self._abandoned = [a for a in self._abandoned if a not in settled]
        for entry in settled:
            for lease in entry.leases:
                entry.pool.release(lease)


class _P2PHandle(TransferHandle):
    """Shared by both directions: the posted batch, its staging, and what an abort does with them."""

    def __init__(self, request_id: RequestId, backend: "NcclBackend", peers: Sequence[int], leases: list[Lease],
                 completion: Completion) -> None:
        super().__init__(request_id, backend.timeout_s)
        self._backend = backend
        self._peers = tuple(peers)
        self._leases = leases
        self._completion = completion
        self._released = False

    def _release(self) -> None:
        if not self._released:
            self._released = True
            for lease in self._leases:
                self._backend._staging.release(lease)

    def _settle_or_abandon(self, reason: str) -> None:
        """After a failure: give the staging back if no transport can touch it, else keep it aside."""
        if self._completion.settled():
            self._release()
        else:
            self._released = True
            self._backend._transport.abandon(_Abandoned(self._completion, self._leases, self._backend._staging,
                                                        self._peers, reason))


class NcclRecvHandle(_P2PHandle):
    """Decode side, one source record: receive into staging, check the header, scatter, done.

    The pool is written only after the whole message arrived and matched, so a
    receive that failed or timed out leaves it untouched: ``storage_safe`` is True
    after any failure (the staging it may still land in is ours and is set aside).
    """

    def __init__(self, request_id: RequestId, backend: "NcclBackend", peer: int, lease: Lease, rows: ByteRows,
                 header: MessageHeader, completion: Completion) -> None:
        super().__init__(request_id, backend, [peer], [lease], completion)
        self._rows = rows
        self._header = header
        self._scatter_event: Optional[torch.cuda.Event] = None

    def _progress(self) -> bool:
        if self._scatter_event is None:
            if not self._completion.check():
                return False
            data = self._leases[0].tensor
            self._header.check_received(data[:HEADER_BYTES].cpu())
            self._rows.scatter(data[HEADER_BYTES:], self._backend._pool_bytes)
            if not data.is_cuda:
                self._release()
                return True
            self._scatter_event = torch.cuda.Event()
            self._scatter_event.record(torch.cuda.current_stream(data.device))
        if not self._scatter_event.query():
            return False
        self._release()
        return True

    def _abort(self) -> bool:
        if self._scatter_event is not None:
            self._scatter_event.synchronize()  # a verified message is being scattered: let it land
            self._release()
            return True
        self._settle_or_abandon(f"receive of request {self.request_id!r} aborted")
        return True


class NcclSendHandle(_P2PHandle):
    """Prefill side, one push: every decode rank's message, sent from staging.

    ``storage_safe`` here means the source blocks are no longer read by the
    transport: the bytes were gathered into staging before anything was posted,
    so that holds as soon as the gather has run, failure or not.
    """

    def __init__(self, request_id: RequestId, backend: "NcclBackend", peers: Sequence[int], leases: list[Lease],
                 completion: Completion, gather_event: Optional[torch.cuda.Event], notify: bool) -> None:
        super().__init__(request_id, backend, peers, leases, completion)
        self._gather_event = gather_event
        self._notify = notify

    def _progress(self) -> bool:
        return self._completion.check()

    def _on_done(self) -> None:
        self._release()
        if self._notify:
            self._backend._deliver_read_done(self.request_id)

    def _abort(self) -> bool:
        if self._gather_event is not None:
            self._gather_event.synchronize()
        self._settle_or_abandon(f"push of request {self.request_id!r} aborted")
        return True

    def _on_failed(self, error: TransferError) -> None:
        if self._notify:
            self._backend._deliver_read_failed(self.request_id, str(error))


class NcclBackend(KVTransportBackend):
    """Push transport over ``torch.distributed`` (see the module docstring and ``docs/nccl.md``).

    Takes the common constructor plus keyword-only ``process_group`` (default: the
    default group; siblings from ``new_registered_buffer`` share their parent's).
    """

    name = "nccl"
    is_push = True

    def __init__(self, *args: Any, process_group: Any = None, **kwargs: Any) -> None:
        self._process_group = process_group
        super().__init__(*args, **kwargs)

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if dist is None or not dist.is_available():
            return False, "this torch build has no torch.distributed; install a torch build with it"
        if not (dist.is_gloo_available() or dist.is_nccl_available()):
            return False, "this torch build has neither Gloo nor NCCL"
        return True, ""

    @classmethod
    def transport_probe(cls) -> dict[str, Any]:
        if dist is None or not dist.is_available():
            return {"torch.distributed": False}
        nccl = dist.is_nccl_available() and torch.cuda.is_available()
        return {
            "torch.distributed": True,
            "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(),
            "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "pools": "GPU pools over NCCL, host pools over Gloo" if nccl else "host pools over Gloo (no NCCL/CUDA here)",
            "process_group": (f"initialised ({dist.get_backend()}, {dist.get_world_size()} ranks)"
                              if dist.is_initialized() else "none in this process; the engine must call "
                              "torch.distributed.init_process_group on every rank before constructing the backend"),
        }

    # --- registration ------------------------------------------------------------------------
    def _register(self) -> None:
        parent = self._parent
        if isinstance(parent, NcclBackend):
            if self._process_group is not None and self._process_group is not parent._transport.group:
                raise BackendUnavailableError("a sibling registration must use its parent's process group")
            self._transport = parent._transport
        else:
            self._transport = _Transport(self._process_group)
        self._device = self.memory_buffer.device
        self._transport.check_device(self._device)
        self._staging = self._transport.staging(self._device)
        self._pool_bytes = pool_bytes(self.memory_buffer)
        self._kind = self.ssm_state_kind or "kv"
        self._push_counter = itertools.count()
        logger.info("nccl backend %r: %d-block %s pool on %s, rank %d of %d (%s)", self.agent_name,
                    self.geometry.num_blocks, self._kind, self._device, self._transport.rank,
                    self._transport.world_size, self._transport.group_backend)

    def _deregister(self) -> None:
        """Nothing is registered with the transport; in-flight handles keep what they use."""

    def _transport_meta(self) -> dict[str, Any]:
        return {"transport": "nccl", "nccl_rank": self._transport.rank,
                "nccl_world_size": self._transport.world_size, "nccl_device": self._device.type}

    # --- decode side: the receives ----------------------------------------------------------
    def _check_plan(self, plan: RequestPlan) -> None:
        """Each chosen source must be a rank that pushes, and must be reachable."""
        for record in plan.to_read:
            if self.ssm_state_kind is None and self.geometry.layout is not None:
                check_replica_source(record.peer.geometry.layout)
            self._transport.check_usable(self._transport.peer_rank(record.meta, self._device.type))

    def _post_read(self, pull: PullRequest) -> TransferHandle:
        peer = self._transport.peer_rank(pull.peer_meta, self._device.type)
        rows = ByteRows(pull.plan.dst_offsets, pull.plan.lengths, self._device)
        header = MessageHeader.for_request(self._kind, peer, self._transport.rank, pull.src_ids, rows.total_bytes)
        lease = self._staging.acquire(HEADER_BYTES + rows.total_bytes)
        try:
            completion = self._transport.post([(dist.irecv, lease.tensor, peer)], self._device)
        except TransferError:
            self._staging.release(lease)
            raise
        logger.debug("posted receive of %d B from rank %d (%d rows)", rows.total_bytes, peer, rows.offsets.size)
        return NcclRecvHandle(pull.request_id, self, peer, lease, rows, header, completion)

    # --- prefill side: the sends -------------------------------------------------------------
    def begin_push_blocks(self, peer_meta: Mapping[str, Any], src_block_ids: IdList, *,
                          request_id: Optional[RequestId] = None) -> TransferHandle:
        """Send our ``src_block_ids`` to every decode rank ``peer_meta`` names that needs part of them.

        ``peer_meta`` is the decode side's meta as Megatron passes it: one
        ``export_meta()`` or ``{"tp_metas": [...]}`` (``pp_metas`` too). Each decode
        rank posts one receive per source record for the same request, in the same
        order: requests must be pushed to a peer pair in the order the decode posted
        them. Everything is validated and planned before anything is posted.

        With ``request_id`` the completion is also reported by ``drain_read_done()``
        (failure by ``drain_read_failed()``), as a pull backend's source reports reads.
        """
        self._check_open()
        if request_id is None:
            label: RequestId = f"{self.agent_name}:push:{next(self._push_counter)}"
        elif not isinstance(request_id, (int, str)) or isinstance(request_id, bool):
            raise PeerMetadataError(f"request_id must be an int or a str, got {request_id!r}")
        else:
            label = request_id
        n = self.geometry.num_blocks
        src_ids = validate_block_ids(src_block_ids, src_block_ids, n, n)[0]
        records = transfer_peer_records(peer_meta, [])
        if not records:
            raise PeerMetadataError("decode meta names no destination (empty tp_metas/pp_metas)")
        sends = self._plan_sends(records, src_ids)
        total = sum(plan.total_bytes for _, plan in sends)
        descriptors = sum(plan.num_descriptors for _, plan in sends)
        with self._in_use():  # a close() racing this push waits for its post, or refuses it
            self._stats.started(total, descriptors)
            if not sends:
                handle: TransferHandle = CompletedHandle(label)
            else:
                handle = self._post_sends(sends, src_ids, label, notify=request_id is not None)
        handle._count_in(self._stats, total, descriptors)
        if isinstance(handle, CompletedHandle) and request_id is not None:
            self._deliver_read_done(request_id)
        return handle

    def _plan_sends(self, records: Sequence[tuple[Mapping[str, Any], Any]], src_ids: np.ndarray) -> list:
        """``[(decode rank, plan)]`` for every decode record that receives something, checked."""
        sends, seen = [], set()
        for meta, record_ids in records:
            decode = self.parse_peer_meta(meta)
            peer = self._transport.peer_rank(meta, self._device.type)
            if peer in seen:
                raise PeerMetadataError(f"decode rank {peer} is named twice in one push; name each decode rank once")
            seen.add(peer)
            if src_ids.size == 0:
                continue
            plan = plan_push(self, decode, src_ids, placeholder_destination(record_ids, src_ids.size, decode))
            if plan is not None:
                sends.append((peer, plan))
        for peer, _ in sends:
            self._transport.check_usable(peer)
        return sends

    def _post_sends(self, sends: list, src_ids: np.ndarray, label: RequestId, notify: bool) -> NcclSendHandle:
        leases, ops = [], []
        for peer, plan in sends:
            rows = ByteRows(plan.src_offsets, plan.lengths, self._device)
            lease = self._staging.acquire(HEADER_BYTES + rows.total_bytes)
            header = MessageHeader.for_request(self._kind, self._transport.rank, peer, src_ids, rows.total_bytes)
            lease.tensor[:HEADER_BYTES].copy_(header.encode())
            rows.gather(self._pool_bytes, lease.tensor[HEADER_BYTES:])
            leases.append(lease)
            ops.append((dist.isend, lease.tensor, peer))
        gather_event = None
        if self._device.type == "cuda":
            gather_event = torch.cuda.Event()
            gather_event.record(torch.cuda.current_stream(self._device))
        try:
            completion = self._transport.post(ops, self._device)
        except KVXferError as exc:
            self._stats.failed(timed_out=False)
            # Some sends of the batch may be posted: their staging is set aside, never reused.
            self._transport.abandon(_Abandoned(_NeverSettles(), leases, self._staging, tuple(p for p, _ in sends),
                                               f"posting push {label!r} failed"))
            raise TransferStartError(f"push {label!r}: {exc}", storage_safe=True) from exc
        logger.debug("push %r: %d message(s), %d B", label, len(ops), sum(l.tensor.numel() for l in leases))
        return NcclSendHandle(label, self, [p for p, _ in sends], leases, completion, gather_event, notify)


class _NeverSettles(Completion):
    """The completion of a batch whose posting failed part-way: nothing tells when it is over."""

    def __init__(self) -> None:
        super().__init__([], [], threaded=True, group_key=-1)

    def settled(self) -> bool:
        return False
