"""``ucx``: one-sided reads with UCX's UCP directly (no NIXL in between).

Decode side: ``begin_pull_blocks`` opens (or reuses) an endpoint to the source's
worker, unpacks the source's packed rkey once per endpoint, and posts one
``ucp_get_nbx`` per coalesced row of the copy plan. When every get has completed
it sends the source an active message with the request id (read-done); a failed
transfer sends a failure AM instead, but only once no get can still land.

Source side: the AM handler queues the notices; ``drain_read_done()`` and
``drain_read_failed()`` return them.

A notice that cannot leave (the send fails, or hangs: e.g. a new endpoint
connecting through a cut cable) is kept per source address and sent again, with
a backoff, on a fresh endpoint until it goes or ``_NOTICE_KEEP_S`` has passed; so
a source behind a long link cut still learns of the failure once it is
reachable again, as NIXL's notifications do. Kept notices are bounded
(``_NOTICE_MAX_PENDING``); one that is dropped is logged. Delivery means UCX
completed the send: a repeat may reach the source twice (releases are idempotent).

Why the details are as they are:
- A peer that errors (``UCP_ERR_HANDLING_MODE_PEER``) is dropped from the
  endpoint cache at once; its endpoint is force-closed later by the progress
  thread, so a restarted peer (a new worker address) just gets a new endpoint.
- On failure or timeout the in-flight gets are cancelled; if UCX cannot cancel
  them quickly the endpoint is force-closed (which completes them all).
  ``storage_safe`` stays False until that has happened.
- Each backend instance has its own context and worker, and a progress thread
  that sleeps on the worker's event fd, so an idle backend uses no CPU.
"""

from __future__ import annotations

import base64
import binascii
import os
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import torch

from kvxfer.backends.ucx import binding as _ucp
from kvxfer.backends.ucx import served as _served
from kvxfer.backends.ucx.confirm import CONFIRM_FIELD, CONFIRM_TIMEOUT_S, confirm_exported, confirm_server
from kvxfer.backends.same_host import SourceWatch, own_identity, shared_memory_permitted
from kvxfer.backends.base import (
    ChainedGuard, KVTransportBackend, PullRequest, RequestId, TransferHandle, TransferStartError, TransferState,
)
from kvxfer.errors import BackendClosedError, PeerMetadataError, TransferError
from kvxfer.meta.records import PreparedPeer
from kvxfer.plan.descriptors import IdList, validate_block_ids
from kvxfer.plan.geometry import PeerGeometry
from kvxfer.meta import notice as notify
from kvxfer.meta.records import transfer_peer_records
from kvxfer.meta.seal import HOST_FIELD, SEAL_FIELD, host_identity

logger = logging.getLogger(__name__)

AM_ID = 0x4B56  # "KV": the active-message id of read-done / read-failed notices
_CANCEL_GRACE_S = 0.5  # how long an abort waits for cancelled gets before force-closing the endpoint
_CLOSE_GRACE_S = 1.0  # how long close() lets read-done notices leave
_NOTICE_RETRY_FIRST_S = 0.25  # first retry of a notice that could not leave; doubles per attempt...
_NOTICE_RETRY_MAX_S = 2.0     # ...up to this
_NOTICE_STALL_S = 4.0  # a notice send pending this long on an endpoint without gets is retried on a fresh one
_NOTICE_KEEP_S = 120.0  # a notice still undelivered after this is dropped (logged)
_NOTICE_MAX_PENDING = 4096
#: Peers' notices received and not yet drained: a source that never drains (or a flooding peer)
#: costs at most this many headers of at most ``notice.MAX_NOTIFY_BYTES`` each.
_MAX_RAW_NOTICES = 16384
#: Pulls up to this size are progressed once by the posting thread: on shared memory or CMA they
#: usually complete there, and waking the progress thread for them cost more than the read
#: (measured in vLLM: the wake-up and the lock it then holds were a quarter of a handoff).
INLINE_PROGRESS_BYTES = 4 << 20
#: Peer table bounds (issue 26, row 6: 41 sources met one after another left 41 endpoints, rkeys
#: and pidfds). A peer whose source exited (pidfd) or whose endpoint failed is dropped at once;
#: one unused for PEER_IDLE_S is dropped; beyond MAX_PEERS the least recently used peer with no
#: read in flight is dropped. A dropped peer is just connected again by its next pull.
MAX_PEERS = 64
PEER_IDLE_S = 300.0
_PEER_SWEEP_S = 1.0  # how often the progress thread looks for peers to drop


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@dataclass(frozen=True)
class UcxSource:
    """The ucx section of a source's meta, decoded and checked once: the worker address to reach it,
    the packed rkey of its pool, and the token its served reads need (absent: it serves none)."""

    address: bytes
    rkey: bytes
    read_token: Optional[bytes]

    @staticmethod
    def parse(meta: Mapping[str, Any]) -> "UcxSource":
        token = _unb64(meta, "ucx_read_token") if meta.get("ucx_read_token") is not None else None
        return UcxSource(_unb64(meta, "ucx_worker_address"), _unb64(meta, "ucx_rkey"), token)


def _unb64(meta: Mapping[str, Any], field: str) -> bytes:
    value = meta.get(field)
    if not isinstance(value, str) or not value:
        raise PeerMetadataError(f"peer meta field {field!r} must be a non-empty base64 string; export it with the ucx backend")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PeerMetadataError(f"peer meta field {field!r} is not valid base64: {exc}") from None


class _Peer:
    """One endpoint to a source worker and the rkeys unpacked on it."""

    def __init__(self, backend: "UcxBackend", address: bytes, watch: Optional[SourceWatch] = None) -> None:
        self.address = address
        # A source on this host, watched by pidfd. It skips UCX's peer failure mode only where UCX may
        # use shared memory or CMA at all: that mode is what makes a force-close complete pending gets,
        # and without shared memory the same-host path would buy nothing for giving it up.
        self.watch = watch
        self._exit_seen = False
        error_handling = (backend.peer_error_handling if backend.peer_error_handling is not None
                          else watch is None or not shared_memory_permitted())
        self.path = "peer-error-mode" if error_handling else "same-host"
        self.endpoint = _ucp.Endpoint(backend._worker, address, backend._on_endpoint_error,
                                      peer_error_handling=error_handling)
        # No hardware GET on this endpoint (tcp): UCX would emulate gets with a handler in the
        # source that aborts it when we are gone by the time it answers; so reads are asked of
        # the source instead (served.py). Host memory only: a CUDA pool keeps ucp_get.
        self.served = error_handling and not backend._region.cuda and \
            _served.needs_serving(self.endpoint.transports())
        self.rkeys: dict[bytes, _ucp.RemoteKey] = {}
        self.batches: set[_ucp.GetBatch] = set()  # posted, not yet released
        self.abandoned = False  # closed with gets that can never complete (kept until close())
        self.last_used = time.monotonic()

    def rkey(self, packed: bytes) -> _ucp.RemoteKey:
        key = self.rkeys.get(packed)
        if key is None:
            key = self.rkeys[packed] = _ucp.RemoteKey(self.endpoint, packed)
        return key

    @property
    def failed(self) -> bool:
        return self.endpoint.error is not None or self.endpoint.handle is None or self.source_exited

    @property
    def source_exited(self) -> bool:
        """The pidfd saw the source exit (sticky: once seen, always True)."""
        if not self._exit_seen and self.watch is not None and self.watch.exited():
            self._exit_seen = True
        return self._exit_seen

    @property
    def gets_cannot_land(self) -> bool:
        """No get on this endpoint can write any more: it is closed and its source process is gone.

        Without UCX's peer failure mode a force-close does not complete pending gets (measured over
        tcp: they stay pending for good), so their completion cannot be what proves it.
        """
        return self.endpoint.handle is None and self.source_exited

    def close(self) -> bool:
        """Force-close the endpoint (completing its gets), then destroy the rkeys. True when fully closed.

        The pidfd stays open while a get is pending: it is what can still prove the source gone.
        """
        self.endpoint.close()
        if any(not batch.done for batch in self.batches):
            if not self.gets_cannot_land:
                return False
            # Gets that will never complete (see gets_cannot_land): their requests, rkeys and
            # counters stay allocated until the worker goes (``abandon``, at close()).
            self.abandoned = True
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if not self.abandoned:
            for key in self.rkeys.values():
                key.close()
            self.rkeys.clear()
        return True

    def abandon(self) -> list[_ucp.GetBatch]:
        """Worker closing: free what pending gets still hold (UCX releases a request freed before it
        completed when it does) and the rkeys, before the worker is destroyed. Returns the batches:
        the caller keeps them until the worker is gone (its teardown may still run their callbacks,
        which write their counters)."""
        batches = list(self.batches)
        for batch in batches:
            batch.abandon()
        self.batches.clear()
        for key in self.rkeys.values():
            key.close()
        self.rkeys.clear()
        return batches


@dataclass
class _Notice:
    """A read-done / read-failed notice on its way to one source address."""

    payload: bytes
    what: str  # for log lines: "read-failed of request 7"
    created: float
    attempts: int = 0
    due: float = 0.0


@dataclass
class _Send:
    """An active-message send UCX has not completed yet."""

    peer: _Peer
    request: Any
    notice: _Notice
    posted: float


class UcxHandle(TransferHandle):
    """One pull: a batch of gets on one endpoint; with ``guard_peer``, the guard read chained behind it
    on the endpoint to the guard's source (``begin_chained_pull``), which also hears the notices."""

    def __init__(self, request_id: RequestId, timeout_s: float, backend: "UcxBackend", peer: _Peer,
                 batch: _ucp.GetBatch, notify: bool = True, report_failure: bool = True,
                 guard_peer: Optional[_Peer] = None) -> None:
        super().__init__(request_id, timeout_s)
        self._notify_done = notify
        self._report_failure = report_failure
        self._backend = backend
        self._peer = peer
        self._notice_peer = guard_peer or peer
        self._chained = guard_peer is not None  # a GetBatch with a GuardGet (``begin_chained_pull``)
        self._done_told = False  # the binding sent the read-done (a chained read whose guard landed)
        #: every endpoint a get of this handle goes through (the guard's too)
        self._peers = (peer,) if guard_peer is None or guard_peer is peer else (peer, guard_peer)
        self._batch = batch
        self._failure_reason: Optional[str] = None
        self._failure_sent = False

    @property
    def _in_flight_peers(self) -> tuple[_Peer, ...]:
        """The endpoints a get of this handle may still be on: the guard's only once it was posted."""
        if len(self._peers) == 1 or self._batch.guard_in_flight:
            return self._peers
        return self._peers[:1]

    @property
    def _cannot_land(self) -> bool:
        return all(peer.gets_cannot_land for peer in self._in_flight_peers)

    def _release(self) -> None:
        """Release the batch. A chained read-done the binding sent is remembered (no "failed" follows
        it); one still leaving is handed to the backend, which tracks it like its own notices."""
        if self._chained:
            state, request = self._batch.take_notice()
            if request is not None:
                self._backend._adopt_notice(self._notice_peer, request, "done", self.request_id)
            self._done_told = state == 2 or request is not None
        self._backend._release_batch(self._peers, self._batch)

    @property
    def path(self) -> str:
        """"same-host" (zero-copy shared memory, death seen by pidfd) or "peer-error-mode"."""
        return self._peer.path

    def _progress(self) -> bool:
        batch = self._batch
        if not batch.done:
            if self._backend.closed:  # failed here, by the thread that polls: close() need not wait for its lock
                raise TransferError(f"request {self.request_id!r}: the ucx backend was closed")
            self._backend._worker.progress()
        if not batch.done:
            for peer in self._peers:
                if peer.source_exited:
                    raise TransferError(f"request {self.request_id!r}: the source process exited during the read")
                if peer.endpoint.error is not None:
                    raise TransferError(f"request {self.request_id!r}: the endpoint to the source failed "
                                        f"({_ucp.status_string(peer.endpoint.error)}) during the read")
            return False
        if not _ucp.is_ok(batch.status):
            what = ("UCX get of the guard (chained behind the data read, which landed)"
                    if self._chained and _ucp.is_ok(int(batch.counter.status)) else "UCX get")
            raise TransferError(
                f"request {self.request_id!r}: {what} failed: {_ucp.status_string(batch.status)}"
                + ("; the source endpoint reported an error (the source process may have died)"
                   if any(peer.failed for peer in self._peers) else "")
            )
        return True

    def _abort(self) -> bool:
        batch = self._batch
        if not batch.done:
            batch.cancel()
            self._wait_batch(_CANCEL_GRACE_S)
        if not batch.done:
            # Not cancellable in time: force-close the endpoints, which completes every get on them
            # (the guard endpoint, shared by every chained read from that source, only while this
            # guard read is on it: ``cancel`` already stopped the chain from posting one).
            for peer in self._in_flight_peers:
                self._backend._drop_peer(peer)
                peer.endpoint.close()
            self._wait_batch(_CANCEL_GRACE_S)
        if batch.done:
            self._release()
            return True
        return self._cannot_land or self._backend._worker_closed

    def _settle(self) -> bool:
        # batch done: every get completed or was cancelled (the progress thread releases it and
        # tells the source); or the endpoints are closed and the source gone, or the whole worker
        # destroyed (close()): none can complete.
        return self._batch.done or self._cannot_land or self._backend._worker_closed

    def _wait_batch(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._batch.done and time.monotonic() < deadline:
            self._backend._worker.progress()
            time.sleep(0.0005)

    def _on_done(self) -> None:
        self._release()
        self._backend._finish(self)
        if self._notify_done and not self._done_told:  # a chained read's went from the binding already
            self._backend._notify(self._notice_peer, "done", self.request_id)

    def _on_failed(self, error: TransferError) -> None:
        self._failure_reason = str(error)
        self._backend._finish(self)
        if self._batch.released:
            self._send_failure()
        else:
            self._backend._defer(self)  # sent by the progress thread once every get has completed

    def _send_failure(self) -> None:
        if self._failure_sent or not self._report_failure or self._done_told:
            return  # (told "done" already: the guard landed and the binding said so before this failure)
        self._failure_sent = True
        # Sent even if the endpoint failed: a cut link looks like a dead source, and the
        # source must hear of it when the link returns (kept and retried, bounded).
        self._backend._notify(self._notice_peer, "failed", self.request_id, self._failure_reason or "")


class UcxBackend(KVTransportBackend):
    """UCP transport: ``ucp_mem_map`` + packed rkey, ``ucp_get_nbx`` reads, AM read-done."""

    name = "ucx"
    supports_staging = True
    chains_guard_reads = True
    is_push = False

    def __init__(self, *args: Any, peer_error_handling: Optional[bool] = None, **kwargs: Any) -> None:
        """Same arguments as every backend, plus ``peer_error_handling``.

        ``None`` (default) chooses per source: one on this host (same boot id and
        network namespace, its pid alive with the start time its meta names), where
        ``UCX_TLS`` permits shared memory or CMA, gets an endpoint without UCX's peer
        failure mode, so UCX may use them (zero-copy gets, no source CPU); any other
        source gets ``UCP_ERR_HANDLING_MODE_PEER``. ``True``/``False`` force one mode
        for every source. Every source of this host is watched through a pidfd
        whatever the mode (``kvxfer.backends.same_host``): its exit fails its
        pulls at once and proves their gets can no longer land. A handle's ``path``
        says which mode was taken.
        """
        self.peer_error_handling = None if peer_error_handling is None else bool(peer_error_handling)
        super().__init__(*args, **kwargs)

    def new_registered_buffer(self, **kwargs: Any) -> "KVTransportBackend":
        kwargs.setdefault("peer_error_handling", self.peer_error_handling)
        return super().new_registered_buffer(**kwargs)

    @classmethod
    def transport_probe(cls) -> dict[str, Any]:
        return ucx_transport_info()

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            _ucp.load()
        except ImportError as exc:
            return False, str(exc)
        return True, ""

    # --- registration -----------------------------------------------------------------------
    def _register(self) -> None:
        self._state_lock = threading.Lock()
        self._peers: "OrderedDict[bytes, _Peer]" = OrderedDict()  # least recently used first
        self.max_peers = MAX_PEERS
        self.peer_idle_s = PEER_IDLE_S
        self.peers_dropped = 0  # gone, idle or evicted: see _sweep_peers
        self._next_sweep = 0.0
        self._retired: list[_Peer] = []  # dropped from the cache, endpoint still to close
        self._abandoned: list[_Peer] = []  # closed, with gets that can never complete: freed at close()
        self._live: set[UcxHandle] = set()
        self._deferred: list[UcxHandle] = []  # failed, gets not all completed yet
        self._sends: list[_Send] = []  # AM requests in flight
        self._outbox: dict[bytes, deque[_Notice]] = {}  # source address -> notices waiting for a retry
        self._outbox_size = 0
        self.notices_dropped = 0  # notices given up on (too old, or too many kept)
        self._notices: deque[bytes] = deque()
        self._staging_region: Optional[_ucp.MemoryRegion] = None
        self._worker_closed = False  # after close(): no get of ours can write any more
        #: set by close() under the worker lock before it drops the peers: from then on no endpoint is
        #: made (``_peer_for`` refuses), so none outlives the peer table into the worker's destruction
        self._shut = False
        self._offered: set[str] = set()  # seal digests of our exported metas (see confirm.py)
        self.sources_confirmed = 0  # unauthenticated metas of this host their sources confirmed
        self._confirm_wait = threading.local()  # confirm_peer's timeout, seen by _check_peer_source in its thread
        self._context = _ucp.Context()
        try:
            self._worker = _ucp.Worker(self._context, AM_ID, self._on_notice)
            self._region = _ucp.MemoryRegion(self._context, self.geometry.buf_ptr, self.geometry.region_bytes,
                                             cuda=self.memory_buffer.is_cuda)
            self._read_token = _served.new_token()
            if not self._region.cuda:  # reads of our pool served to readers that have no hardware GET
                _served.Server(self._worker, self._read_token, self.geometry.buf_ptr, self.geometry.region_bytes)
            self._served = _served.ServedReads(self._worker)
        except Exception:
            if getattr(self, "_worker", None) is not None:
                self._worker.close()
            self._context.close()
            raise
        self._worker.idle_tasks.append(self._housekeeping)
        self._worker.unlocked_tasks.append(self._complete_landed)
        self._worker.start_progress_thread(f"kvxfer-ucx-{self.agent_name}")

    def _register_staging(self, tensor: torch.Tensor) -> None:
        # Mapped like the pool, so gets into it use the same (zero-copy where possible) paths.
        self._staging_region = _ucp.MemoryRegion(self._context, tensor.data_ptr(), tensor.numel(), cuda=tensor.is_cuda)

    def _transport_meta(self) -> dict[str, Any]:
        return {
            **own_identity(),
            CONFIRM_FIELD: confirm_server().name,
            "ucx_worker_address": _b64(self._worker.address),
            "ucx_rkey": _b64(self._region.packed_rkey),
            "ucx_read_token": _b64(self._read_token),
            "ucx_version": _ucp.version(),
            "memory_type": "cuda" if self._region.cuda else "host",
        }

    def export_meta(self) -> dict[str, Any]:
        with self._in_use():  # close() withdraws every offer: none may be made behind it
            meta = super().export_meta()
            digest = meta[SEAL_FIELD]["sha256"]
            if digest not in self._offered:  # so that a reader of this host can ask whether we exported it
                self._offered.add(digest)
                confirm_server().offer(digest)
        return meta

    def _check_peer_source(self, sealed: dict[str, Any], digest: str) -> None:
        """Without the cluster key, a meta of this host is trusted only once the process it names
        says it exported exactly this meta (``confirm.py``): a re-sealed forgery is refused here."""
        if self._meta_key is not None or sealed.get(HOST_FIELD) != host_identity():
            return  # signed: authenticated already; another host's (opted in): no one to ask
        wait = getattr(self._confirm_wait, "seconds", None)  # set by confirm_peer, for its thread only
        if confirm_exported(sealed, digest, timeout_s=min(CONFIRM_TIMEOUT_S, self.timeout_s) if wait is None else wait):
            self.sources_confirmed += 1

    def confirm_peer(self, peer_meta: Any, timeout_s: Optional[float] = None) -> bool:
        """Confirm a peer meta's sources ahead of the pull, e.g. from a background thread when the
        meta arrives, so the pull itself does not wait on it. Cheap when done already.

        ``peer_meta`` is anything ``begin_pull_blocks`` takes (one meta, or TP/PP wrapped). Each
        source record is checked as a pull would check it (seal, fields, and, for an unsigned meta
        of this host, the source's confirmation, waiting at most ``timeout_s``: default
        ``min(5 s, timeout_s of this backend)``), and remembered. Returns True when every record
        is accepted; False when a source could not be asked in time (stalled or gone): that is
        remembered too, and pulls through the meta then fail after a short check instead of each
        waiting the timeout, until the source answers. Raises ``PeerMetadataError`` for a meta
        that is refused (forged, malformed). Thread-safe; posts nothing.
        """
        self._check_open()
        self._confirm_wait.seconds = None if timeout_s is None else float(timeout_s)
        try:
            for record, _ in transfer_peer_records(peer_meta, []):
                self.parse_peer_meta(record)
        except TransferError as exc:
            logger.warning("ucx %r: a source could not confirm its meta ahead of the pull: %s", self.agent_name, exc)
            return False
        finally:
            self._confirm_wait.seconds = None
        return True

    def parse_peer_meta(self, peer_meta: Mapping[str, Any]) -> PeerGeometry:
        section = UcxSource.parse(peer_meta)  # checked first: a malformed meta is not worth asking about
        return replace(super().parse_peer_meta(peer_meta), transport=section)

    # --- pulls ------------------------------------------------------------------------------
    def _post_read(self, pull: PullRequest) -> TransferHandle:
        source = pull.peer.transport  # parsed once, with the rest of the meta (parse_peer_meta)
        if not isinstance(source, UcxSource):
            source = UcxSource.parse(pull.peer_meta)  # a plan made outside parse_peer_meta
        plan = pull.plan
        with self._worker.lock:
            token = source.read_token
            try:
                peer = self._peer_for(source.address, pull.peer_meta)
                rkey = None if peer.served and token else peer.rkey(source.rkey)
            except _ucp.UcpError as exc:
                raise TransferError(f"request {pull.request_id!r}: cannot reach the source: {exc}") from None
            local_base = self.geometry.buf_ptr if pull.local_base is None else pull.local_base  # pool or staging
            batch: Any
            if rkey is None:
                batch = _served.make_batch(self._served, peer.endpoint, token, local_base, plan)
            else:
                batch = _ucp.GetBatch(peer.endpoint, rkey, local_base, pull.peer.geometry.buf_ptr,
                                      plan.src_offsets, plan.dst_offsets, plan.lengths, cuda=self._region.cuda)
            peer.batches.add(batch)
            handle = UcxHandle(pull.request_id, self.timeout_s, self, peer, batch, notify=pull.notify,
                               report_failure=pull.report_failure)
            self._live.add(handle)
            if plan.total_bytes <= INLINE_PROGRESS_BYTES:
                self._worker.progress()  # a small zero-copy read often completes right here
        if not batch.done:
            self._worker.signal(only_if_idle=True)  # else the progress thread need not wake for it
        return handle

    def begin_chained_pull(self, peer_meta: PreparedPeer, src_block_ids: IdList, dst_block_ids: IdList,
                           guard: ChainedGuard, *, request_id: RequestId) -> Optional[TransferHandle]:
        """The data gets and the guard get on this worker, the guard posted by the data's last completion
        in C (``_ucp.GetBatch`` with a ``GuardGet``), and the read-done sent by the guard's completion,
        in C too (a send still leaving is adopted by the handle: tracked and retried as ours are).

        None (the caller chains in Python) where a side is not a prepared ucx source, the pair needs
        the general planner, there is no byte to read, either source's reads are served (tcp), or the
        pool is CUDA memory."""
        self._check_open()
        if not (isinstance(peer_meta, PreparedPeer) and isinstance(guard.source, PreparedPeer)) \
                or peer_meta.backend != self.name or guard.source.backend != self.name:
            return None
        data_source, guard_source = peer_meta.peer.transport, guard.source.peer.transport
        if not (isinstance(data_source, UcxSource) and isinstance(guard_source, UcxSource)) or self._region.cuda:
            return None
        if not isinstance(request_id, (int, str)) or isinstance(request_id, bool):
            raise PeerMetadataError(f"request_id must be an int or a str, got {request_id!r}")
        table = guard.source.peer.geometry
        if table.num_outer != 1 or table.bytes_per_slice != guard.nbytes:
            return None  # the guard's slot is not what the caller's memory holds: its own read refuses it
        if type(guard.block) is not int or not 0 <= guard.block < table.num_blocks:
            validate_block_ids([guard.block], [0], table.num_blocks, 1)  # the guard's slot: refused as a pull would
        copier = self._copier_for(peer_meta)
        if copier is None:
            return None
        src_offsets, dst_offsets, lengths = copier.rows(src_block_ids, dst_block_ids)  # lists: no numpy here
        if not lengths:
            return None
        total_bytes, descriptors = sum(lengths), len(lengths)
        try:
            notice = notify.encode("done", request_id, 0)  # the read-done the binding sends after the guard
        except ValueError:
            notice = b""  # too long for a notice: left to the handle, which says so as any read does
        with self._in_use(), self._worker.lock:  # close() waits for this post, then fails its handle
            try:
                guard_peer = self._peer_for(guard_source.address, guard.source.meta)
                peer = self._peer_for(data_source.address, peer_meta.meta)
                if self._peers.get(guard_source.address) is not guard_peer or guard_peer.endpoint.handle is None:
                    return None  # the data peer's arrival evicted it (a full table): the caller chains in Python
                if peer.served or guard_peer.served:
                    return None
                rkey, guard_rkey = peer.rkey(data_source.rkey), guard_peer.rkey(guard_source.rkey)
                guard_get = _ucp.GuardGet(guard_peer.endpoint, guard_rkey, guard.address,
                                          table.buf_ptr + guard.block * table.bytes_per_slice, table.bytes_per_slice,
                                          notice=notice, am_id=AM_ID)
                batch = _ucp.GetBatch(peer.endpoint, rkey, self.geometry.buf_ptr, peer_meta.peer.geometry.buf_ptr,
                                      src_offsets, dst_offsets, lengths, cuda=False, guard=guard_get)
            except _ucp.UcpError as exc:
                raise TransferError(f"request {request_id!r}: cannot reach the source: {exc}") from None
            peer.batches.add(batch)
            guard_peer.batches.add(batch)
            handle = UcxHandle(request_id, self.timeout_s, self, peer, batch, notify=True, guard_peer=guard_peer)
            self._live.add(handle)
        self._stats.started(total_bytes, descriptors)
        handle._count_in(self._stats, total_bytes, descriptors)
        try:
            if total_bytes <= INLINE_PROGRESS_BYTES:
                self._worker.progress()  # on shared memory or CMA both reads often complete right here
            if not batch.done:
                self._worker.signal(only_if_idle=True)
        except Exception as exc:  # posted: the caller gets the handle's outcome, never a bare error
            with handle._lock:
                if handle.state is TransferState.PROC:
                    handle._fail(TransferError(f"request {request_id!r}: progressing the read failed: {exc}"))
            raise TransferStartError(f"request {request_id!r}: progressing the read failed: {exc}",
                                     storage_safe=handle.storage_safe, cleanup_handles=[handle]) from exc
        return handle

    def _peer_for(self, address: bytes, meta: Optional[Mapping[str, Any]] = None) -> _Peer:
        """The cached endpoint to ``address`` (a failed one replaced); a new one to a source of
        this host is watched by pidfd and skips UCX's peer failure mode (see ``__init__``).
        Worker lock held. ``BackendClosedError`` once close() has dropped the peers."""
        if self._shut:
            raise BackendClosedError(f"ucx backend {self.agent_name!r} is closed")
        peer = self._peers.get(address)
        if peer is not None and peer.failed:
            self._drop_peer(peer)
            peer = None
        if peer is None:
            # A source of this host is watched by pidfd whatever the mode: its death then ends
            # the reads at once and proves that none of them can still land.
            watch = SourceWatch.for_meta(meta) if meta is not None else None
            peer = self._peers[address] = _Peer(self, address, watch)
            self._evict_over_cap()
        else:
            self._peers.move_to_end(address)
        peer.last_used = time.monotonic()
        return peer

    def _evict_over_cap(self) -> None:
        """Worker lock held: beyond ``max_peers``, drop the least recently used peers without reads in flight."""
        over = len(self._peers) - self.max_peers
        if over <= 0:
            return
        sending = {id(send.peer) for send in self._sends}
        for peer in list(self._peers.values()):
            if over <= 0:
                return
            if not peer.batches and id(peer) not in sending:
                logger.debug("ucx %r: peer table full (%d): dropping the least recently used", self.agent_name,
                             len(self._peers))
                self._drop_peer(peer)
                self.peers_dropped += 1
                over -= 1

    def _sweep_peers(self) -> None:
        """Worker lock held (progress thread, at most once a second): drop peers whose source exited,
        whose endpoint failed, or that went unused for ``peer_idle_s``; never one with reads in flight.
        Notices still waiting for a source that exited are dropped with it: nobody is left to tell."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + _PEER_SWEEP_S
        sending = {id(send.peer) for send in self._sends}
        for peer in list(self._peers.values()):
            if peer.batches or id(peer) in sending:
                continue
            gone = peer.source_exited
            if gone or peer.failed or now - peer.last_used > self.peer_idle_s:
                self._drop_peer(peer)
                self.peers_dropped += 1
                if gone:
                    dropped = self._outbox.pop(peer.address, None)
                    if dropped:
                        self._outbox_size -= len(dropped)
                        logger.info("ucx %r: dropped %d notice(s) for a source that exited", self.agent_name,
                                    len(dropped))

    def peer_count(self) -> int:
        """Sources this backend holds an endpoint to (bounded: see ``MAX_PEERS``)."""
        with self._worker.lock:
            return len(self._peers)

    def _drop_peer(self, peer: _Peer) -> None:
        with self._worker.lock:
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
            if peer not in self._retired:
                self._retired.append(peer)

    def _on_endpoint_error(self, endpoint: _ucp.Endpoint, status: int) -> None:
        """UCX's error callback (progress thread, worker lock held): forget that peer."""
        peer = self._peers.get(endpoint.peer_address)
        if peer is not None and peer.endpoint is endpoint:
            self._drop_peer(peer)

    def _release_batch(self, peers: tuple[_Peer, ...], batch: _ucp.GetBatch) -> None:
        with self._worker.lock:
            batch.release()
            for peer in peers:
                peer.batches.discard(batch)

    def _finish(self, handle: UcxHandle) -> None:
        with self._worker.lock:
            self._live.discard(handle)

    def _defer(self, handle: UcxHandle) -> None:
        with self._worker.lock:
            self._deferred.append(handle)
        self._worker.signal()

    # --- notices ----------------------------------------------------------------------------
    def _notify(self, peer: _Peer, kind: notify.Kind, request_id: RequestId, reason: str = "") -> None:
        """Send a notice to ``peer``'s source; one that cannot leave now is kept and retried."""
        self._notify_address(peer.address, kind, request_id, reason, peer)

    def _notify_address(self, address: bytes, kind: notify.Kind, request_id: RequestId, reason: str = "",
                        peer: Optional[_Peer] = None) -> None:
        """The shared notice format (``kvxfer.meta.notice``); each registration has a worker of its own,
        so the notice's buffer id is always 0 here."""
        payload = notify.encode(kind, request_id, 0, reason)
        notice = _Notice(payload, f"read-{kind} of request {request_id!r}", time.monotonic())
        with self._worker.lock:
            self._post_notice(address, notice, peer)

    def _adopt_notice(self, peer: _Peer, request: Any, kind: notify.Kind, request_id: RequestId) -> None:
        """A notice the binding posted (a chained read-done) still in flight: tracked like ours."""
        notice = _Notice(notify.encode(kind, request_id, 0), f"read-{kind} of request {request_id!r}",
                         time.monotonic(), attempts=1)
        with self._worker.lock:
            self._sends.append(_Send(peer, request, notice, time.monotonic()))
            self._worker.inflight += 1
        self._worker.signal(only_if_idle=True)

    def _notify_source(self, peer_meta: Mapping[str, Any], request_id: RequestId,
                       failure: Optional[str] = None) -> None:
        address = _unb64(peer_meta, "ucx_worker_address")
        if failure is None:
            self._notify_address(address, "done", request_id)
        else:
            self._notify_address(address, "failed", request_id, failure)

    def _post_notice(self, address: bytes, notice: _Notice, peer: Optional[_Peer] = None) -> None:
        """Worker lock held. On ``peer``'s endpoint if still usable, else on the cached (or a new) one."""
        if self._shut:  # closed: nothing can leave any more (a staged pull failing after close, say)
            logger.debug("ucx %r: closed; %s not sent", self.agent_name, notice.what)
            return
        notice.attempts += 1
        try:
            if peer is None or peer.failed:
                peer = self._peer_for(address)
            request = _ucp.send_active_message(peer.endpoint, AM_ID, notice.payload)
        except _ucp.UcpError as exc:
            self._requeue(address, notice, str(exc))
            return
        if request is not None:
            self._sends.append(_Send(peer, request, notice, time.monotonic()))
            self._worker.inflight += 1
            self._worker.signal(only_if_idle=True)
        elif notice.attempts > 1:
            logger.info("ucx %r: %s delivered to the source after %d attempts (%.1fs)", self.agent_name,
                        notice.what, notice.attempts, time.monotonic() - notice.created)

    def _requeue(self, address: bytes, notice: _Notice, why: str) -> None:
        """Worker lock held: keep a notice that did not leave, for a later attempt."""
        if self._outbox_size >= _NOTICE_MAX_PENDING:
            self.notices_dropped += 1
            self._stats.notice_undelivered()
            logger.warning("ucx %r: dropped %s: %d notices already wait for unreachable sources",
                           self.agent_name, notice.what, self._outbox_size)
            return
        now = time.monotonic()
        notice.due = now + min(_NOTICE_RETRY_FIRST_S * 2 ** (notice.attempts - 1), _NOTICE_RETRY_MAX_S)
        log = logger.info if notice.attempts == 1 else logger.debug
        log("ucx %r: %s could not reach the source (%s); retrying for up to %.0fs",
            self.agent_name, notice.what, why, _NOTICE_KEEP_S - (now - notice.created))
        self._outbox.setdefault(address, deque()).append(notice)
        self._outbox_size += 1

    def _reap_sends(self) -> None:
        """Worker lock held: finish completed AM sends; keep failed ones; unstick hung ones."""
        now = time.monotonic()
        still = []
        for send in self._sends:
            status = _ucp.request_status(self._worker, send.request)
            if _ucp.in_progress(status):
                if now - send.posted > _NOTICE_STALL_S and not send.peer.batches:
                    # e.g. a new endpoint connecting through a cut cable: retire it (its force-close
                    # completes this send as cancelled, and the notice is kept); a later attempt
                    # connects afresh. An endpoint with gets in flight is left to their timeouts.
                    self._drop_peer(send.peer)
                still.append(send)
                continue
            self._worker.inflight -= 1
            if not _ucp.is_ok(status):
                self._requeue(send.peer.address, send.notice, _ucp.status_string(status))
            elif send.notice.attempts > 1:
                logger.info("ucx %r: %s delivered to the source after %d attempts (%.1fs)", self.agent_name,
                            send.notice.what, send.notice.attempts, now - send.notice.created)
        self._sends = still

    def _retry_notices(self) -> None:
        """Worker lock held: send again what is due, one attempt at a time per source; drop the too old."""
        now = time.monotonic()
        busy = {send.peer.address for send in self._sends}
        for address in list(self._outbox):
            queue = self._outbox[address]
            while queue and now - queue[0].created > _NOTICE_KEEP_S:
                notice = queue.popleft()
                self._outbox_size -= 1
                self.notices_dropped += 1
                self._stats.notice_undelivered()
                logger.warning("ucx %r: gave up on %s: the source stayed unreachable for %.0fs (%d attempts)",
                               self.agent_name, notice.what, now - notice.created, notice.attempts)
            if not queue:
                del self._outbox[address]
                continue
            if address in busy or queue[0].due > now:
                continue
            del self._outbox[address]
            self._outbox_size -= len(queue)
            for notice in queue:
                self._post_notice(address, notice)

    def _on_notice(self, header: bytes) -> None:
        """A peer's read-done / read-failed (worker lock held): kept raw until drained, bounded. A header
        larger than any notice, or one past ``_MAX_RAW_NOTICES`` undrained, is dropped and counted."""
        if len(header) > notify.MAX_NOTIFY_BYTES or len(self._notices) >= _MAX_RAW_NOTICES:
            self._stats.notice_dropped()
            return
        self._notices.append(header)

    def _collect_notifications(self) -> None:
        self._worker.progress()
        while self._notices:
            message = notify.decode(self._notices.popleft())
            if message is None:
                continue  # not one of ours (or another wire version): dropped, never raised
            if message.kind == "done":
                self._deliver_read_done(message.request_id)
            else:
                self._deliver_read_failed(message.request_id, message.reason)

    def _housekeeping(self) -> None:
        """Progress-thread work (worker lock held): AM sends and retries, deferred failures, dead endpoints."""
        self._reap_sends()
        self._served.reap()
        self._sweep_peers()
        waiting = []
        for handle in self._deferred:
            if handle._batch.done:
                handle._release()
                handle._send_failure()
            elif not handle._cannot_land:  # else its source is gone: nobody to tell
                waiting.append(handle)
        self._deferred = waiting
        if self._outbox:
            self._retry_notices()
        still = []
        for peer in self._retired:
            if not peer.close():
                still.append(peer)
            elif peer.abandoned:
                self._abandoned.append(peer)
        self._retired = still

    def _complete_landed(self) -> None:
        """Progress thread, worker lock released: finish handles whose gets have all landed.

        So the read-done notice leaves as soon as the data is in place, even if the
        engine polls its handle late. A handle busy in another thread is skipped
        (never waited for: that thread finishes it).
        """
        with self._worker.lock:
            landed = [handle for handle in self._live if handle._batch.done]
        for handle in landed:
            if handle._lock.acquire(blocking=False):
                try:
                    if handle.state is TransferState.PROC:
                        handle._advance()
                finally:
                    handle._lock.release()

    # --- teardown ---------------------------------------------------------------------------
    def _deregister(self) -> None:
        for digest in self._offered:  # a closed registration confirms nothing any more
            confirm_server().withdraw(digest)
        self._offered.clear()
        for handle in list(self._live):
            with handle._lock:
                if handle.state is TransferState.PROC:
                    handle._fail(TransferError(f"request {handle.request_id!r}: the ucx backend was closed"))
        deadline = time.monotonic() + _CLOSE_GRACE_S
        while (self._sends or self._deferred) and time.monotonic() < deadline:
            with self._worker.lock:
                self._worker.progress()
                self._housekeeping()
            time.sleep(0.0005)
        self._worker.stop_progress_thread()
        with self._worker.lock:
            for send in self._sends:  # notices still leaving (e.g. to a stalled source): not waited for
                self._worker.wait_request(send.request, time.monotonic(), give_up=True)
            self._sends = []
            self._served.give_up(time.monotonic())
            if self._outbox_size:
                logger.warning("ucx %r: closed with %d notices still undelivered (their sources unreachable)",
                               self.agent_name, self._outbox_size)
                self._outbox.clear()
                self._outbox_size = 0
            self._shut = True  # no endpoint from here on: the table below is the last one
            for peer in list(self._peers.values()):
                self._drop_peer(peer)
            for peer in self._retired:
                peer.endpoint.close()
            self._worker.progress()
            for handle in self._deferred:
                if handle._batch.done:
                    handle._release()
            # Whatever gets are still pending (a source that never answered, or one gone for
            # good) are freed with the worker; their counters stay referenced until it is gone.
            leftovers: list[Any] = [peer for peer in self._retired if not peer.close() or peer.abandoned] + \
                self._abandoned
            for peer in list(leftovers):
                leftovers += peer.abandon()
            self._retired.clear()
            self._abandoned = []
        self._region.close()
        if self._staging_region is not None:
            self._staging_region.close()
            self._staging_region = None
        if self._worker.close():
            self._worker_closed = True
            del leftovers  # now that no completion can run any more
            self._context.close()
        else:  # its teardown hung: it may still complete gets, so they stay unsafe; nothing more is freed
            self._hung_teardown = leftovers

    def disconnect(self, peer_meta: Optional[Mapping[str, Any]] = None) -> None:
        """Close the cached endpoint to one source (or to all): e.g. a prefill instance went away.

        Transfers still in flight on it fail (their gets are cancelled); the next
        pull from that source connects again.
        """
        with self._in_use(), self._worker.lock:
            if peer_meta is None:
                peers = list(self._peers.values())
            else:
                found = self._peers.get(_unb64(peer_meta, "ucx_worker_address"))
                peers = [found] if found is not None else []
            for peer in peers:
                self._drop_peer(peer)
            self._housekeeping()

    # --- introspection ----------------------------------------------------------------------
    def transports_in_use(self) -> dict[str, list[tuple[str, str]]]:
        """(transport, device) lanes of each cached endpoint, keyed by a short peer tag."""
        with self._worker.lock:
            peers = list(self._peers.values())
        return {peer.address[:8].hex(): peer.endpoint.transports() for peer in peers}


def ucx_transport_info(backend: Optional[UcxBackend] = None) -> dict[str, Any]:
    """What ``kvxfer info`` shows for UCX: version, UCX_TLS, and the lanes of a live backend's endpoints."""
    ok, why = UcxBackend.availability()
    info: dict[str, Any] = {"available": ok, "UCX_TLS": _ucp.ucx_tls()}
    if not ok:
        info["reason"] = why
        return info
    info["version"] = _ucp.version()
    pidfd = hasattr(os, "pidfd_open")
    info["paths"] = ("same host: zero-copy shared memory/CMA, a dead source seen by pidfd; other hosts: "
                     "UCX peer failure mode" if pidfd else "peer failure mode everywhere (no pidfd_open here)")
    if backend is not None and not backend.closed:
        info["endpoints"] = backend.transports_in_use()
    return info
