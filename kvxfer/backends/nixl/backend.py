"""``nixl``: one-sided READs of a peer's KV pool through a NIXL agent (UCX underneath).

How a pull works
    The source registers its pool with its process's NIXL agent and exports the
    geometry plus the agent's metadata (base64). The decode side loads that
    metadata once per peer (again only if the peer's metadata changed: a new
    sibling registration, or a restarted peer under the same name), then posts
    *one* NIXL READ for the whole request. The READ carries a notification naming
    the request; NIXL delivers it to the source when the read has completed, and
    the source's ``drain_read_done()`` turns it into the request id. A read that
    fails or times out is released first (so nothing of it is in flight) and only
    then reported to the source with a failure notification
    (``drain_read_failed()``). Formats: ``kvxfer.meta.notice``.

Descriptors: prepared lists, indexed per request
    Every registration and every (peer, peer region) gets one *prepared*
    descriptor list with one entry per (outer slice, block), built from
    ``num_outer`` strided rows ``(addr, len, dev, stride, count)`` that NIXL 1.5
    expands (strided rows exist only in ``prep_xfer_dlist``'s Nx5 numpy form; a
    plain ``nixlXferDList`` takes Nx3 only). A request is then just two int32
    index arrays computed with numpy from the coalesced ``CopyPlan`` and passed to
    ``make_prepped_xfer``; NIXL merges adjacent entries again when it posts.
    Measured on this project's 2-core CPU box, 4096 scattered blocks x 64 planes
    (262 144 rows, nothing to coalesce): building the request by index took
    17-64 ms against 90-210 ms for two Nx3 ``nixlXferDList``s + ``initialize_xfer``
    (two agents in one process, idle machine), and 188-244 ms against 229-383 ms
    between two processes on the loaded machine (``tools/bench_nixl.py
    --compare-rows``). The Nx3 path re-validates every row against the
    registrations on every call; the prepared lists did that once. So indexing is
    the default. (At that size the copy itself, one UCX operation per 256-byte
    row, costs seconds: coalescing, not descriptor building, is what matters.)
    A plan whose rows are not whole slices (a future head-resharding plan) or a
    pool too large for a per-slice list (``MAX_PREPPED_ENTRIES``) falls back to
    Nx3 rows straight from the plan's arrays, with no Python loop per row either.

Timeouts and storage safety
    NIXL has no transfer timeout: the handle's (``timeout_s``, default 30 s) is
    ours. NIXL cannot cancel a READ that is still moving: releasing the xfer
    handle of an active READ "succeeds", yet UCX keeps writing (measured over TCP
    with a SIGSTOPped source: 5.4 M of 7.9 M elements of the destination
    overwritten after the source resumed, 3 s after the release). So an xfer is
    released only once NIXL reports it over: ``DONE``, ``ERR``, or a remote
    disconnect (measured: a killed source ends its READs with
    ``NIXL_ERR_REMOTE_DISCONNECT`` within 0.05 s and nothing lands after). A
    handle that failed or timed out while its READ was still ``PROC`` keeps
    ``storage_safe`` False (it raises ``TransferTimeoutError``) and is checked
    again whenever ``storage_safe`` is read, the backend posts, drains or closes;
    the failure notification to the source is sent once it is over. For the same
    reason a peer with READs still open is never removed from the agent (after
    ``invalidateRemoteMD`` NIXL can no longer say whether they ended, and they do
    not stop: measured), and a backend closed with such READs keeps its
    registration and memory until they end (``parked_registrations()``).

The package, one job per module (as ``ucx/``): ``environment.py`` (settings and the probe),
``peer.py`` (the meta's NIXL section), ``slices.py`` (descriptors from a plan), ``agent.py``
(the shared agent and its peer table), ``handle.py`` (one READ), this module (the backend).
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any, Mapping, Optional

import torch

from kvxfer.meta import notice as notify
from kvxfer.meta.version import WIRE_VERSION
from kvxfer.backends.nixl.agent import AgentShare
from kvxfer.backends.nixl.environment import (
    INSTALL_HINT, SAME_HOST_ENV, nixl_api, nixl_transport_probe, other_hosts_refused,
)
from kvxfer.backends.nixl.handle import NixlHandle
from kvxfer.backends.nixl.peer import PID_FIELD, START_FIELD, NixlPeer, parse_nixl_peer
from kvxfer.backends.nixl.slices import plan_is_slice_aligned, plan_rows, slice_indices, slice_rows
from kvxfer.backends.nixl.ucx_env import NixlTransportInfo, nixl_transport_info
from kvxfer.backends.same_host import SourceWatch, process_start_time
from kvxfer.backends.base import (
    CompletedHandle,
    KVTransportBackend,
    PullRequest,
    RequestId,
    TransferStartError,
    TransferHandle,
    TransferState,
)
from kvxfer.errors import BackendUnavailableError, GeometryError, PeerMetadataError, TransferError
from kvxfer.plan.geometry import PeerGeometry
from kvxfer.meta.records import transfer_peer_records
from kvxfer.meta.seal import HOST_FIELD, host_identity

__all__ = ["NixlBackend", "NixlHandle", "NixlPeer", "NixlTransportInfo", "nixl_transport_info", "parked_registrations",
           "nixl_transport_probe", "slice_indices"]

logger = logging.getLogger(__name__)

#: How long ``close()`` waits for READs that failed while active to end before parking the registration.
CLOSE_SETTLE_S = 1.0
#: ``confirm_peer``'s pauses between loads of a source's agent that failed (doubling up to the second).
CONFIRM_RETRY_FIRST_S, CONFIRM_RETRY_MAX_S = 0.1, 1.0
#: Closed registrations kept (memory registered, tensor referenced) until their last active READ ends.
_PARKED: "set[NixlBackend]" = set()
_PARKED_LOCK = threading.Lock()
#: The reads-over-TCP warnings this process has logged (each once, at the first setup it applies to).
_TCP_WARNED: set[str] = set()


def parked_registrations() -> int:
    """Closed nixl registrations still kept because a READ into them may land; checks them first."""
    with _PARKED_LOCK:
        parked = list(_PARKED)
    for backend in parked:
        if backend._settle_unsettled() == 0:
            with _PARKED_LOCK:
                _PARKED.discard(backend)
            backend._release_registration()
    with _PARKED_LOCK:
        return len(_PARKED)


class NixlBackend(KVTransportBackend):
    """NIXL transport: DRAM or VRAM pools, one READ per request, read-done by notification."""

    name = "nixl"
    is_push = False
    supports_staging = True
    capability_meta_fields = ("nixl_agent_metadata",)  # it carries the registered regions' rkeys

    _availability: Optional[tuple[bool, str]] = None

    @classmethod
    def transport_probe(cls) -> dict[str, Any]:
        return nixl_transport_probe()

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if cls._availability is None:
            try:
                nixl_api()
                cls._availability = (True, "")
            except Exception as exc:  # ImportError, or a broken native library
                cls._availability = (False, f"cannot import nixl ({type(exc).__name__}: {exc}); fix: {INSTALL_HINT}")
        return cls._availability

    # --- registration -----------------------------------------------------------------
    def _register(self) -> None:
        device = self.memory_buffer.device.type
        if device not in ("cpu", "cuda"):
            raise GeometryError(f"[nixl] can register CPU or CUDA tensors, not {device!r} memory")
        self.mem_type = "VRAM" if device == "cuda" else "DRAM"
        self.transport_info = nixl_transport_info()
        ok, why = self.transport_info.usable_for(self.mem_type)
        if not ok:
            raise BackendUnavailableError(f"[nixl] cannot move {self.mem_type} memory with this UCX setup: {why}")
        risk, text = self.transport_info.tcp_reads(
            self.mem_type, same_host_only=other_hosts_refused(self._meta_key, self._allow_unauthenticated))
        #: The setup warning when NIXL's UCX would serve this pool's reads over TCP (docs/nixl.md), else None.
        self.tcp_read_risk: Optional[str] = text if risk else None
        if risk and text not in _TCP_WARNED:
            _TCP_WARNED.add(text)
            logger.warning("nixl %r: %s", self.agent_name, text)
        self._in_flight: set[NixlHandle] = set()
        self._unsettled: set[NixlHandle] = set()  # failed while their READ was active: not yet released
        self._local_dlist: Any = None
        # A sibling (``new_registered_buffer``) shares its parent's agent whatever it is called.
        parent = self._parent
        self._share = AgentShare.acquire(parent._share.name if isinstance(parent, NixlBackend) else self.agent_name)
        g = self.geometry
        try:
            self.buffer_id = self._share.add_registration(self)
            with self._share.lock:
                self._reg_descs = self._share.agent.register_memory(
                    [(g.buf_ptr, g.region_bytes, g.device_id, "")], self.mem_type
                )
        except Exception as exc:
            self._share.remove_registration(getattr(self, "buffer_id", -1))
            self._share.release()
            raise BackendUnavailableError(
                f"[nixl] registering {g.region_bytes} B of {self.mem_type} (device {g.device_id}) failed: {exc}"
            ) from exc

    def _register_staging(self, tensor: torch.Tensor) -> None:
        with self._share.lock:
            self._staging_descs = self._share.agent.register_memory(
                [(tensor.data_ptr(), tensor.numel(), self.geometry.device_id, "")], self.mem_type
            )

    def _deregister(self) -> None:
        for handle in list(self._in_flight):
            with handle._lock:
                if handle.state is TransferState.PROC:
                    handle._fail(TransferError(f"request {handle.request_id!r}: backend closed while in flight"))
        deadline = time.monotonic() + CLOSE_SETTLE_S
        while self._settle_unsettled() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._unsettled:
            # Deregistering (or letting the caller free the tensor) while a READ still writes into
            # it would hand those bytes to whoever gets the memory next: keep it all until they end.
            self._parked_arena = self._arena
            with _PARKED_LOCK:
                _PARKED.add(self)
            logger.error("kvxfer nixl: %r closed with %d READ(s) that may still land (a stalled source?); its "
                         "registration and memory are kept until they end", self.agent_name, len(self._unsettled))
            return
        self._release_registration()

    def _release_registration(self) -> None:
        share = self._share
        with share.lock:
            if self._local_dlist is not None:
                try:
                    self._local_dlist.release()
                except Exception as exc:
                    logger.warning(f"kvxfer nixl: releasing the local prepared list failed: {exc}")
                self._local_dlist = None
            staging = getattr(self, "_staging_descs", None)
            try:
                if staging is not None:
                    share.agent.deregister_memory(staging)
                    self._staging_descs = None
                share.agent.deregister_memory(self._reg_descs)
            except Exception as exc:
                logger.warning(f"kvxfer nixl: deregistering {self.agent_name!r} failed: {exc}")
        share.remove_registration(self.buffer_id)
        share.release()
        self._parked_arena = None

    def _settle_unsettled(self) -> int:
        """Check the READs that failed while active; release those now over. Returns how many are left."""
        for handle in list(self._unsettled):
            _ = handle.storage_safe  # settles (releases, tells the source) once NIXL says it is over
        return len(self._unsettled)

    def _transport_meta(self) -> dict[str, Any]:
        share = self._share
        with share.lock:
            metadata = share.agent.get_agent_metadata()
        return {
            "nixl_meta_version": WIRE_VERSION,
            "nixl_agent_name": share.name,
            "nixl_agent_instance": share.instance,
            "nixl_agent_metadata": base64.b64encode(metadata).decode("ascii"),
            "nixl_buffer_id": self.buffer_id,
            "nixl_mem_type": self.mem_type,
            PID_FIELD: os.getpid(),  # so that a reader of this host can watch us (pidfd) and forget us when we exit
            START_FIELD: process_start_time(os.getpid()) or 0,
        }

    # --- public extras -------------------------------------------------------------------
    @property
    def garbage_notifications(self) -> int:
        """Notifications this agent received that were not ours (or named a closed registration)."""
        return self._share.garbage_notifications

    def drop_peer(self, agent_name: str) -> None:
        """Forget a peer (e.g. known dead): its agent, connection and prepared lists.

        A peer with READs still open is removed only once they have ended (NIXL
        cannot stop them, and could no longer report them after the removal).
        A later pull from it loads it again.
        """
        with self._in_use():
            self._share.forget(agent_name)

    def peer_count(self) -> int:
        """Remote agents loaded in this process's agent (bounded: see ``MAX_PEERS``)."""
        return self._share.peer_count()

    @property
    def peers_dropped(self) -> int:
        """Remote agents removed because their process exited, they went idle, or the table was full."""
        return self._share.peers_dropped

    def parse_peer_meta(self, peer_meta: Mapping[str, Any]) -> PeerGeometry:
        peer = super().parse_peer_meta(peer_meta)
        if self._share.same_host and peer_meta.get(HOST_FIELD) != host_identity():
            raise PeerMetadataError(
                f"peer meta comes from another host ({peer_meta.get(HOST_FIELD)!r}) but this process runs nixl in "
                f"same-host mode ({SAME_HOST_ENV}=1: UCX without peer failure handling); unset it to read from "
                "other hosts")
        return replace(peer, transport=parse_nixl_peer(peer_meta, self._meta_key))  # checked before anything is posted

    def confirm_peer(self, peer_meta: Any, timeout_s: Optional[float] = None) -> bool:
        """Check a peer meta's sources as a pull would and load their agents' metadata now, e.g. from a
        background thread when the meta arrives, so the first pull does not: loading connects to the peer
        (NIXL's ``loadRemoteMD``: 0.1-0.2 s on a loaded 2-core machine, 0.6 s seen; it releases the GIL).
        In a vLLM decode that load ran in the first read from each new producer, on the engine step
        (issue 39). Cheap when done already.

        A load that fails is tried again until ``timeout_s`` (default: this backend's transfer timeout)
        has passed: a suite run saw NIXL's UCX refuse one endpoint with "Destination is unreachable" while
        the prefill it named lived, and the handshake was refused for it. A source of this host that
        exited is not waited for (``SourceWatch``).

        ``peer_meta`` is anything ``begin_pull_blocks`` takes. Returns False when a source's agent could
        not be loaded in that time (logged; a pull tries again and fails with the reason); raises
        ``PeerMetadataError`` for a meta that is refused. Thread-safe; posts nothing.
        """
        self._check_open()
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        for record, _ in transfer_peer_records(peer_meta, []):
            peer = self.parse_peer_meta(record).transport
            if not self._load_agent_until(peer, record, deadline):
                return False
        return True

    def _load_agent_until(self, peer: NixlPeer, record: Mapping[str, Any], deadline: float) -> bool:
        """``ensure_remote`` for ``confirm_peer``, tried again with a growing pause while the source may
        live and ``deadline`` has not passed."""
        pause, tries = CONFIRM_RETRY_FIRST_S, 0
        while True:
            tries += 1
            try:
                self._share.ensure_remote(peer, record)
                return True
            except TransferError as exc:
                watch = SourceWatch.for_meta(record, PID_FIELD, START_FIELD)
                gone = watch is None and record.get(HOST_FIELD) == host_identity()  # its pid exited (or was reused)
                if watch is not None:
                    gone = watch.exited()
                    watch.close()
                if gone or time.monotonic() + pause > deadline or self._closed:
                    logger.warning("nixl %r: a source's agent could not be loaded ahead of the pull (%d tries%s): %s",
                                   self.agent_name, tries, ", its process exited" if gone else "", exc)
                    return False
                logger.info("nixl %r: loading %r failed (%s); trying again in %.2fs", self.agent_name, peer.name,
                            exc, pause)
                time.sleep(pause)
                pause = min(2 * pause, CONFIRM_RETRY_MAX_S)

    # --- pulls ---------------------------------------------------------------------------
    def _post_read(self, pull: PullRequest) -> TransferHandle:
        self._settle_unsettled()
        peer = pull.peer.transport  # parsed once, with the rest of the meta (parse_peer_meta)
        if not isinstance(peer, NixlPeer):
            peer = parse_nixl_peer(pull.peer_meta, self._meta_key)  # a plan made outside parse_peer_meta
        share = self._share
        share.ensure_remote(peer, pull.peer_meta)
        plan = pull.plan
        # ``notify=False`` (a caller whose later read carries the read-done): an empty
        # message makes NIXL send no notification at all. Failures are still reported.
        wants_done = pull.notify
        message = notify.encode("done", pull.request_id, peer.buffer_id) if wants_done else b""
        if plan.num_descriptors == 0:
            if message:
                share.send(peer.name, message)
            return CompletedHandle(pull.request_id)
        started = time.perf_counter()
        with share.lock:
            xfer, path = self._make_xfer(pull, peer, message)
            handle = NixlHandle(
                pull.request_id, self.timeout_s, share, self._in_flight, self._unsettled, xfer, peer, path=path,
                num_descriptors=plan.num_descriptors, raw_descriptors=plan.raw_descriptors,
                total_bytes=plan.total_bytes, build_s=time.perf_counter() - started,
                report_failure=pull.report_failure,
            )
            share.read_opened(peer.name)  # from here the handle owns the xfer; its release closes it
            self._in_flight.add(handle)
            try:
                share.agent.transfer(xfer)
            except Exception as exc:
                # NIXL may have posted part of the READ before failing, and releasing an active READ
                # does not stop it: the handle finds out whether it is over, and keeps it until it is.
                with handle._lock:
                    handle._fail(TransferError(
                        f"request {pull.request_id!r}: NIXL failed to start the READ from {peer.name!r} "
                        f"({type(exc).__name__}: {exc})"))
                if type(exc).__name__ == "nixlRemoteDisconnectError":
                    share.forget(peer.name)  # a dead peer is not kept: a restart is loaded afresh
                safe = handle.storage_safe
                raise TransferStartError(
                    f"request {pull.request_id!r}: NIXL failed to start the READ from {peer.name!r} "
                    f"({type(exc).__name__}: {exc}); part of it may have run; "
                    + ("it is over, no byte can still land" if safe else
                       "it may still be moving: quarantine the destination blocks until the handle in "
                       "cleanup_handles is storage_safe"),
                    storage_safe=safe, cleanup_handles=[handle],
                ) from exc
        return handle

    def _make_xfer(self, pull: PullRequest, peer: NixlPeer, message: bytes) -> tuple[Any, str]:
        """Build the READ (see the module docstring for why prepared lists come first)."""
        agent = self._share.agent
        plan, local, remote = pull.plan, self.geometry, pull.peer.geometry
        local_base = local.buf_ptr if pull.local_base is None else pull.local_base  # pool, or a staging range
        try:
            if pull.local_base is None and plan_is_slice_aligned(plan, local, remote):
                remote_list = self._share.remote_dlist(peer, remote)
                src_idx, dst_idx = slice_indices(plan, local.bytes_per_slice)
                return agent.make_prepped_xfer(
                    "READ", self._local_prepped(), dst_idx, remote_list, src_idx, message
                ), "prepped"
            local_rows = agent.get_xfer_descs(
                plan_rows(local_base, plan.dst_offsets, plan.lengths, local.device_id), self.mem_type
            )
            remote_rows = agent.get_xfer_descs(
                plan_rows(remote.buf_ptr, plan.src_offsets, plan.lengths, remote.device_id), peer.mem_type
            )
            return agent.initialize_xfer("READ", local_rows, remote_rows, peer.name, message), "rows"
        except PeerMetadataError:
            raise
        except Exception as exc:
            raise PeerMetadataError(
                f"NIXL could not build a READ from peer {pull.peer_meta.get('agent_name')!r} "
                f"({type(exc).__name__}: {exc}); is the peer's exported region still registered?"
            ) from None

    def _local_prepped(self) -> Any:
        if self._local_dlist is None:
            self._local_dlist = self._share.agent.prep_xfer_dlist("", slice_rows(self.geometry), self.mem_type)
        return self._local_dlist

    def _notify_source(self, peer_meta: Mapping[str, Any], request_id: RequestId,
                       failure: Optional[str] = None) -> None:
        peer = parse_nixl_peer(peer_meta, self._meta_key)
        message = (notify.encode("done", request_id, peer.buffer_id) if failure is None else
                   notify.encode("failed", request_id, peer.buffer_id, failure))
        self._share.send(peer.name, message)

    def _collect_notifications(self) -> None:
        self._settle_unsettled()
        self._share.collect_notifications()
        if _PARKED:
            parked_registrations()
