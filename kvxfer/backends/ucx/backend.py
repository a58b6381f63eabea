"""``ucx``: one-sided reads with UCX's UCP directly (no NIXL in between).

Decode side: ``begin_pull_blocks`` opens (or reuses) an endpoint to the source's
worker, unpacks the source's packed rkey once per endpoint, and posts one
``ucp_get_nbx`` per coalesced row of the copy plan. When every get has completed
it sends the source an active message with the request id (read-done); a failed
transfer sends a failure AM instead, but only once no get can still land.

Source side: the AM handler queues the notices; ``drain_read_done()`` and
``drain_read_failed()`` return them. A notice that cannot leave is kept and retried (``notices.py``).

The package, in reading order: ``source.py`` (the meta's ucx section), ``peer.py`` (one endpoint to a
source), ``handle.py`` (one pull), ``notices.py`` (read-done / read-failed both ways), this module (the
backend: registration, posting, the peer table, the progress thread's housekeeping, teardown), then the
layers under it: ``binding.py`` (the cffi objects; ``binding_build.py`` builds the C), ``served.py``
(reads a source serves where there is no hardware GET, over ``served_binding.py``) and ``confirm.py``
(an unsigned meta of this host confirmed by its exporter).

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

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import replace
from typing import Any, Mapping, Optional

import torch

from kvxfer.backends.ucx import binding as _ucp
from kvxfer.backends.ucx import served as _served
from kvxfer.backends.ucx.confirm import CONFIRM_FIELD, CONFIRM_TIMEOUT_S, confirm_exported, confirm_server
from kvxfer.backends.ucx.handle import UcxHandle
from kvxfer.backends.ucx.notices import AM_ID, NoticeOutbox, Notice, Send
from kvxfer.backends.ucx.peer import Peer
from kvxfer.backends.ucx.source import CAPABILITY_FIELDS, UcxSource, b64, unb64
from kvxfer.backends.same_host import SourceWatch, own_identity
from kvxfer.backends.ucx_reach import UCS_ERR_UNREACHABLE, UNREACHABLE_HINT
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
from kvxfer.meta.version import WIRE_VERSION

logger = logging.getLogger(__name__)

_CLOSE_GRACE_S = 1.0  # how long close() lets read-done notices leave
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


def _unreachable(request_id: Any, exc: "_ucp.UcpError") -> TransferError:
    """A source this worker could not make an endpoint to: nothing was posted."""
    hint = f"; if it is alive, {UNREACHABLE_HINT}" if exc.status == UCS_ERR_UNREACHABLE else ""
    return TransferError(f"request {request_id!r}: cannot reach the source: {exc}{hint}")


class UcxBackend(NoticeOutbox, KVTransportBackend):
    """UCP transport: ``ucp_mem_map`` + packed rkey, ``ucp_get_nbx`` reads, AM read-done."""

    name = "ucx"
    supports_staging = True
    chains_guard_reads = True
    is_push = False
    capability_meta_fields = CAPABILITY_FIELDS

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
        self._peers: "OrderedDict[bytes, Peer]" = OrderedDict()  # least recently used first
        self.max_peers = MAX_PEERS
        self.peer_idle_s = PEER_IDLE_S
        self.peers_dropped = 0  # gone, idle or evicted: see _sweep_peers
        self._next_sweep = 0.0
        self._retired: list[Peer] = []  # dropped from the cache, endpoint still to close
        self._abandoned: list[Peer] = []  # closed, with gets that can never complete: freed at close()
        self._live: set[UcxHandle] = set()
        self._deferred: list[UcxHandle] = []  # failed, gets not all completed yet
        self._sends: list[Send] = []  # AM requests in flight
        self._outbox: dict[bytes, deque[Notice]] = {}  # source address -> notices waiting for a retry
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
            "ucx_meta_version": WIRE_VERSION,
            **own_identity(),
            CONFIRM_FIELD: confirm_server().name,
            "ucx_worker_address": b64(self._worker.address),
            "ucx_rkey": b64(self._region.packed_rkey),
            "ucx_read_token": b64(self._read_token),
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
        if self._meta_key is not None:  # the signature first: a box of another cluster's meta is not ours to open
            peer = super().parse_peer_meta(peer_meta)
            return replace(peer, transport=UcxSource.parse(peer_meta, self._meta_key))
        section = UcxSource.parse(peer_meta)  # checked first: a malformed meta is not worth asking about
        return replace(super().parse_peer_meta(peer_meta), transport=section)

    # --- pulls ------------------------------------------------------------------------------
    def _post_read(self, pull: PullRequest) -> TransferHandle:
        source = pull.peer.transport  # parsed once, with the rest of the meta (parse_peer_meta)
        if not isinstance(source, UcxSource):
            source = UcxSource.parse(pull.peer_meta, self._meta_key)  # a plan made outside parse_peer_meta
        plan = pull.plan
        with self._worker.lock:
            token = source.read_token
            try:
                peer = self._peer_for(source.address, pull.peer_meta)
                rkey = None if peer.served and token else peer.rkey(source.rkey)
            except _ucp.UcpError as exc:
                raise _unreachable(pull.request_id, exc) from None
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
                raise _unreachable(request_id, exc) from None
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

    def _peer_for(self, address: bytes, meta: Optional[Mapping[str, Any]] = None) -> Peer:
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
            peer = self._peers[address] = Peer(self, address, watch)
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

    def _drop_peer(self, peer: Peer) -> None:
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

    def _release_batch(self, peers: tuple[Peer, ...], batch: _ucp.GetBatch) -> None:
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
                found = self._peers.get(unb64(peer_meta, "ucx_worker_address"))
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
