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
"""

from __future__ import annotations

import base64
import binascii
import itertools
import logging
import os
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import numpy as np
import torch

from kvxfer.meta import notice as notify
from kvxfer.meta.version import WIRE_VERSION, check_wire_version
from kvxfer.backends.nixl.ucx_env import NixlTransportInfo, keep_idle_ib_module_out, nixl_transport_info
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
from kvxfer.plan.descriptors import CopyPlan
from kvxfer.errors import BackendUnavailableError, GeometryError, PeerMetadataError, TransferError
from kvxfer.plan.geometry import BufferGeometry, PeerGeometry
from kvxfer.meta.seal import HOST_FIELD, host_identity

__all__ = ["NixlBackend", "NixlHandle", "NixlPeer", "NixlTransportInfo", "nixl_transport_info", "parked_registrations",
           "nixl_transport_probe", "slice_indices"]

logger = logging.getLogger("kvxfer.backends.nixl")

INSTALL_HINT = (
    "pip install 'kvxfer[nixl]' (on a CPU-only machine run `pip install torch==2.13.0` first: "
    "otherwise pip resolves nixl's torch dependency to a multi-GB CUDA build)"
)
#: Above this many (outer slice, block) entries a per-slice prepared list costs more
#: memory than it saves time; such pools post Nx3 rows instead.
MAX_PREPPED_ENTRIES = 1 << 22
_MEM_TYPES = ("DRAM", "VRAM")
#: Remote-agent table bounds (issue 26, row 6: 41 sources met one after another left 41 remote
#: agents). A peer whose process exited (pidfd, same host) is removed at once; one unused for
#: PEER_IDLE_S is removed; beyond MAX_PEERS the least recently used one without open READs is.
#: A removed peer is loaded again by its next pull.
MAX_PEERS = 64
PEER_IDLE_S = 300.0
_PEER_SWEEP_S = 1.0
PID_FIELD, START_FIELD = "nixl_pid", "nixl_pid_start"
#: How long ``close()`` waits for READs that failed while active to end before parking the registration.
CLOSE_SETTLE_S = 1.0
#: Closed registrations kept (memory registered, tensor referenced) until their last active READ ends.
_PARKED: "set[NixlBackend]" = set()
_PARKED_LOCK = threading.Lock()


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


def nixl_transport_probe() -> dict[str, Any]:
    """For ``kvxfer info``: what UCX under NIXL will use here (no agent is created)."""
    info = nixl_transport_info()
    return {
        "package": info.nixl_package or "not installed",
        "UCX_TLS": info.ucx_tls if info.ucx_tls is not None else "unset (all UCX can load)",
        "UCX_NET_DEVICES": info.ucx_net_devices or "unset",
        "UCX_MODULES": os.environ.get("UCX_MODULES", "unset (kvxfer sets ^ib when no RDMA device exists)"),
        "transports": ",".join(info.transports),
        "rdma_devices": ",".join(info.rdma_devices) or "none",
        "ucx_error_handling": "none (same-host mode, KVXFER_NIXL_SAME_HOST=1)" if _same_host_or_none() else "peer",
        "DRAM": info.usable_for("DRAM")[1] or "ok",
        "VRAM": _vram_status(info),
    }


def _vram_status(info: NixlTransportInfo) -> str:
    """"ok" only when NIXL is installed, a CUDA device exists and UCX can move its memory."""
    if not info.nixl_package:
        return "nixl not installed"
    try:
        import torch  # noqa: PLC0415

        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA runtime is information, not a crash
        devices = 0
    if devices == 0:
        return "no CUDA device here"
    return info.usable_for("VRAM")[1] or "ok"


def _nixl_api() -> Any:
    """Import nixl only when a backend is built: ``import kvxfer`` must work without it."""
    import nixl._api as api  # noqa: PLC0415

    return api


# --------------------------------------------------------------------------------------------
# peer metadata
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NixlPeer:
    """The NIXL fields of a peer's ``export_meta()``, checked."""

    name: str
    instance: str  # changes when the peer's agent is re-created (restart under the same name)
    metadata: bytes
    buffer_id: int
    mem_type: str


def parse_nixl_peer(meta: Mapping[str, Any]) -> NixlPeer:
    """Validate the NIXL fields of a peer meta; ``PeerMetadataError`` names the bad field."""
    check_wire_version(meta.get("nixl_meta_version"), "meta field 'nixl_meta_version'")
    instance = meta.get("nixl_agent_instance")
    if not isinstance(instance, str) or not instance:
        raise PeerMetadataError("peer meta field 'nixl_agent_instance' must be a non-empty string")
    encoded = meta.get("nixl_agent_metadata")
    if not isinstance(encoded, str) or not encoded:
        raise PeerMetadataError("peer meta field 'nixl_agent_metadata' must be a non-empty base64 string")
    try:
        metadata = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise PeerMetadataError("peer meta field 'nixl_agent_metadata' is not valid base64") from None
    buffer_id = meta.get("nixl_buffer_id")
    if isinstance(buffer_id, bool) or not isinstance(buffer_id, int) or buffer_id < 1:
        raise PeerMetadataError(f"peer meta field 'nixl_buffer_id' must be a positive int, got {buffer_id!r}")
    mem_type = meta.get("nixl_mem_type")
    if mem_type not in _MEM_TYPES:
        raise PeerMetadataError(f"peer meta field 'nixl_mem_type' must be one of {_MEM_TYPES}, got {mem_type!r}")
    name = meta.get("nixl_agent_name")
    if not isinstance(name, str) or not name:
        raise PeerMetadataError("peer meta field 'nixl_agent_name' must be a non-empty string")
    return NixlPeer(name, instance, metadata, buffer_id, mem_type)


# --------------------------------------------------------------------------------------------
# descriptors
# --------------------------------------------------------------------------------------------
def slice_rows(geometry: BufferGeometry) -> np.ndarray:
    """``num_outer`` strided rows ``(addr, len, dev, stride, count)`` covering every
    (outer, block) slice: entry ``outer * num_blocks + block`` of the expanded list."""
    g = geometry
    rows = np.empty((g.num_outer, 5), dtype=np.uint64)
    rows[:, 0] = g.buf_ptr + np.arange(g.num_outer, dtype=np.uint64) * np.uint64(g.outer_stride_bytes)
    rows[:, 1] = g.bytes_per_slice
    rows[:, 2] = g.device_id
    rows[:, 3] = g.bytes_per_slice
    rows[:, 4] = g.num_blocks
    return rows


def slice_indices(plan: CopyPlan, bytes_per_slice: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-slice list indices ``(src, dst)`` for a plan whose rows are whole slices.

    A row of ``n`` slices becomes ``n`` consecutive indices (array ops only).
    """
    n = plan.lengths // bytes_per_slice
    src0 = plan.src_offsets // bytes_per_slice
    dst0 = plan.dst_offsets // bytes_per_slice
    if n.size == 0 or (n == 1).all():
        return src0.astype(np.int32), dst0.astype(np.int32)
    step = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    return (np.repeat(src0, n) + step).astype(np.int32), (np.repeat(dst0, n) + step).astype(np.int32)


def _plan_is_slice_aligned(plan: CopyPlan, local: BufferGeometry, remote: BufferGeometry) -> bool:
    bps = local.bytes_per_slice
    if remote.bytes_per_slice != bps:
        return False
    for g in (local, remote):
        if g.num_outer * g.num_blocks > MAX_PREPPED_ENTRIES:
            return False
    return not ((plan.src_offsets % bps).any() or (plan.dst_offsets % bps).any() or (plan.lengths % bps).any())


def _rows(base: int, offsets: np.ndarray, lengths: np.ndarray, device_id: int) -> np.ndarray:
    rows = np.empty((lengths.size, 3), dtype=np.uint64)
    rows[:, 0] = offsets.astype(np.uint64) + np.uint64(base)
    rows[:, 1] = lengths
    rows[:, 2] = device_id
    return rows


def _remote_key(peer: NixlPeer, g: BufferGeometry) -> tuple:
    return (peer.name, peer.instance, peer.mem_type, g.buf_ptr, g.num_outer, g.num_blocks,
            g.bytes_per_slice, g.device_id)


#: Pause of NIXL's progress thread between rounds, in microseconds. NIXL's Python wrapper
#: hard-codes 0, a busy loop that burns a whole core in every idle process holding an agent.
#: Measured idle over 10 s: 1 ms -> 2.6% of a core, 2 ms -> 1.35%, 5 ms -> 0.6%. 2 ms keeps
#: an idle process under 2% and bounds the extra latency of the progress a peer's one-sided
#: reads need from us (TCP; shared-memory and RDMA reads need none). 0 restores NIXL's default.
PROGRESS_DELAY_ENV = "KVXFER_NIXL_PROGRESS_DELAY_US"
DEFAULT_PROGRESS_DELAY_US = 2000
_create_lock = threading.Lock()


#: ``1``: a same-host deployment (docs/environment.md). The agent's UCX runs without peer
#: failure handling, so reads between processes of this host go over CMA/shared memory
#: (measured, 0.5 MB pulls between two processes: p50 0.67 -> 0.35 ms, p90 2.5 -> 0.39 ms),
#: and metas from other hosts are refused: without that mode a dead remote peer could hang a
#: read or abort the process inside UCX. A dead same-host source still fails its reads at once.
SAME_HOST_ENV = "KVXFER_NIXL_SAME_HOST"


def _same_host_or_none() -> bool:
    try:
        return same_host_mode()
    except BackendUnavailableError:
        return False


def same_host_mode() -> bool:
    raw = os.environ.get(SAME_HOST_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise BackendUnavailableError(f"{SAME_HOST_ENV}={raw!r}: use 1 (same-host deployment) or 0")


def progress_delay_us() -> int:
    raw = os.environ.get(PROGRESS_DELAY_ENV, "")
    try:
        return max(0, int(raw)) if raw.strip() else DEFAULT_PROGRESS_DELAY_US
    except ValueError:
        raise BackendUnavailableError(f"{PROGRESS_DELAY_ENV}={raw!r} is not an integer number of microseconds") from None


def _create_agent(api: Any, name: str, config: Any) -> Any:
    """``nixl_agent(name, config)`` with the progress thread's pause set to ``progress_delay_us()``.

    The wrapper builds its native config itself and sets ``pthrDelay = 0``; for the
    duration of this call (under a lock) it builds ours, which raises that to our delay.
    """
    delay = progress_delay_us()
    native = api.nixlBind.nixlAgentConfig

    class DelayedProgressConfig(native):  # type: ignore[misc, valid-type]
        def __setattr__(self, field: str, value: Any) -> None:
            if field == "pthrDelay":
                value = max(int(value), delay)
            super().__setattr__(field, value)

    with _create_lock:
        api.nixlBind.nixlAgentConfig = DelayedProgressConfig
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgentConfig = native


# --------------------------------------------------------------------------------------------
# the process-wide agent, shared by sibling registrations
# --------------------------------------------------------------------------------------------
class _AgentShare:
    """One NIXL agent per (process, agent name), reference-counted by its registrations.

    Siblings (``new_registered_buffer``: KV pool, SSM pools) share it, so they
    share one connection per peer and one notification stream; notifications are
    routed to the registration named in them. All agent calls go through
    ``lock``: the agent is created without NIXL's own locking (its default when
    no listener thread runs) and handles may be polled from any thread.
    """

    _shares: dict[str, "_AgentShare"] = {}
    _shares_lock = threading.Lock()

    def __init__(self, name: str) -> None:
        api = _nixl_api()
        self.same_host = same_host_mode()
        # NIXL creates its UCX backend with UCX's peer failure mode, which rules out shared memory
        # and CMA: reads between two processes of one host then run as tcp emulation served by
        # the source's progress thread. Same-host mode creates it without (zero-copy, no source CPU).
        config = api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False,
                                       backends=[] if self.same_host else ["UCX"])
        keep_idle_ib_module_out()
        try:
            self.agent = _create_agent(api, name, config)
            if self.same_host:
                self.agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        except Exception as exc:
            # Seen here: UCX_TLS=cma,self or sm,self makes NIXL's own UCX loopback setup fail
            # ("Destination is unreachable"); UCX needs tcp (or an RDMA transport) beside them.
            raise BackendUnavailableError(
                f"could not create NIXL agent {name!r} ({type(exc).__name__}: {exc}); "
                f"{nixl_transport_info().summary()}. If UCX_TLS is set, unset it or add tcp (or rc) to it"
            ) from exc
        if "UCX" not in self.agent.backends:
            raise BackendUnavailableError(
                f"NIXL agent {name!r} has no UCX backend (plugins found: {self.agent.get_plugin_list()}); "
                f"reinstall nixl: {INSTALL_HINT}"
            )
        self.name = name
        self.instance = uuid.uuid4().hex
        self.lock = threading.RLock()
        self.refs = 0
        self.garbage_notifications = 0
        self._buffer_ids = itertools.count(1)
        self._registrations: dict[int, weakref.ref[NixlBackend]] = {}
        self._remote_md: dict[str, bytes] = {}
        self._remote_instance: dict[str, str] = {}
        self._remote_dlists: dict[tuple, Any] = {}
        self._open_reads: dict[str, int] = {}  # peer name -> READs posted and not yet released
        self._forget_later: set[str] = set()  # peers to remove once their open READs end
        self._last_used: "OrderedDict[str, float]" = OrderedDict()  # loaded peers, least recently used first
        self._watches: dict[str, SourceWatch] = {}  # peers of this host, watched by pidfd
        self.max_peers = MAX_PEERS
        self.peer_idle_s = PEER_IDLE_S
        self.peers_dropped = 0
        self._next_sweep = 0.0

    @classmethod
    def acquire(cls, name: str) -> "_AgentShare":
        with cls._shares_lock:
            share = cls._shares.get(name)
            if share is None:
                share = cls._shares[name] = _AgentShare(name)
            share.refs += 1
            return share

    def release(self) -> None:
        """Drop one reference; the last one releases every peer and the agent."""
        with _AgentShare._shares_lock:
            self.refs -= 1
            if self.refs > 0:
                return
            _AgentShare._shares.pop(self.name, None)
        with self.lock:
            for name in list(self._remote_md):
                self._forget(name)
            self.agent = None  # the binding's destructor tears the agent down

    # --- registrations and notifications -----------------------------------------------
    def add_registration(self, backend: "NixlBackend") -> int:
        with self.lock:
            buffer_id = next(self._buffer_ids)
            self._registrations[buffer_id] = weakref.ref(backend)
            return buffer_id

    def remove_registration(self, buffer_id: int) -> None:
        with self.lock:
            self._registrations.pop(buffer_id, None)

    def collect_notifications(self) -> None:
        """Route every new notification to the registration it names; count the rest."""
        with self.lock:
            self.sweep()
            incoming = self.agent.get_new_notifs()
            for messages in incoming.values():
                for message in messages:
                    note = notify.decode(message)
                    ref = self._registrations.get(note.buffer_id) if note is not None else None
                    target = ref() if ref is not None else None
                    if note is None or target is None:
                        self.garbage_notifications += 1
                    elif note.kind == "done":
                        target._deliver_read_done(note.request_id)
                    else:
                        target._deliver_read_failed(note.request_id, note.reason)

    # --- peers ------------------------------------------------------------------------
    def ensure_remote(self, peer: NixlPeer, meta: Optional[Mapping[str, Any]] = None) -> None:
        """Load the peer's metadata unless the same bytes are already loaded (then bound the table).

        ``meta`` (the peer's export_meta) lets a peer of this host be watched by pidfd.

        Changed metadata from the same agent instance (a sibling registered since)
        is loaded over the old (NIXL merges it; live reads are unaffected). A new
        instance under the same name is a restarted peer: the old one is dropped
        with its prepared lists first.
        """
        with self.lock:
            if peer.name == self.name:
                if peer.instance != self.instance:
                    raise PeerMetadataError(
                        f"peer agent name {peer.name!r} is this process's own agent name but the meta comes from "
                        "another agent; give every process a unique agent_name"
                    )
                return  # loopback: our own agent already knows its registrations
            self.sweep()
            if self._remote_md.get(peer.name) == peer.metadata and peer.name not in self._forget_later:
                self._touch(peer.name)
                return
            if self._remote_instance.get(peer.name, peer.instance) != peer.instance or peer.name in self._forget_later:
                if self._open_reads.get(peer.name):
                    raise TransferError(
                        f"peer {peer.name!r} was restarted (or dropped) while {self._open_reads[peer.name]} READ(s) "
                        "from its previous agent may still land; nothing was posted: retry once they have ended "
                        "(they end when that process resumes or exits)"
                    )
                self._forget(peer.name)
            try:
                loaded = self.agent.add_remote_agent(peer.metadata)
            except Exception as exc:
                kind = type(exc).__name__
                if kind in ("nixlMismatchError", "nixlInvalidParamError", "TypeError", "ValueError"):
                    raise PeerMetadataError(
                        f"NIXL rejected peer {peer.name!r}'s agent metadata ({kind}: {exc}); "
                        "pass the peer's export_meta() unchanged"
                    ) from None
                # Loading connects to the peer: a dead peer fails here (seen: NIXL_ERR_BACKEND).
                raise TransferError(
                    f"could not connect to peer {peer.name!r} ({kind}: {exc}); is it alive? nothing was posted"
                ) from None
            loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded_name != peer.name:
                if loaded_name in self._remote_md:
                    self._forget(loaded_name)  # the load replaced a peer we use: set it up afresh next time
                else:
                    self._remove_agent(loaded_name)
                raise PeerMetadataError(
                    f"peer meta says agent {peer.name!r} but its NIXL metadata is agent {loaded_name!r}"
                )
            self._remote_md[peer.name] = peer.metadata
            self._remote_instance[peer.name] = peer.instance
            self._touch(peer.name)
            old = self._watches.pop(peer.name, None)
            if old is not None:
                old.close()
            watch = SourceWatch.for_meta(meta, PID_FIELD, START_FIELD) if meta is not None else None
            if watch is not None:
                self._watches[peer.name] = watch
            self._evict_over_cap()

    def _touch(self, name: str) -> None:
        self._last_used[name] = time.monotonic()
        self._last_used.move_to_end(name)

    def _evict_over_cap(self) -> None:
        """Lock held: beyond ``max_peers``, remove the least recently used peers without open READs."""
        for name in list(self._last_used):
            if len(self._remote_md) <= self.max_peers:
                return
            if not self._open_reads.get(name):
                self._forget(name)
                self.peers_dropped += 1

    def sweep(self) -> None:
        """Lock held, at most once a second: remove peers whose process exited (pidfd) or that went
        unused for ``peer_idle_s``; a peer with READs open is left until they end."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + _PEER_SWEEP_S
        for name in list(self._last_used):
            if self._open_reads.get(name):
                continue
            watch = self._watches.get(name)
            if (watch is not None and watch.exited()) or now - self._last_used[name] > self.peer_idle_s:
                self._forget(name)
                self.peers_dropped += 1

    def peer_count(self) -> int:
        with self.lock:
            return len(self._remote_md)

    def remote_dlist(self, peer: NixlPeer, geometry: BufferGeometry) -> Any:
        """The prepared per-slice list of a peer region (made once, kept until the peer changes)."""
        key = _remote_key(peer, geometry)
        with self.lock:
            handle = self._remote_dlists.get(key)
            if handle is None:
                try:
                    handle = self.agent.prep_xfer_dlist(peer.name, slice_rows(geometry), peer.mem_type)
                except Exception as exc:
                    raise PeerMetadataError(
                        f"peer {peer.name!r}'s exported region ({geometry.region_bytes} B at {geometry.buf_ptr:#x}) "
                        f"is not registered in its NIXL metadata ({type(exc).__name__}: {exc})"
                    ) from None
                self._remote_dlists[key] = handle
            return handle

    def forget(self, name: str) -> None:
        """Remove a peer, or, while READs from it are open, as soon as they end."""
        with self.lock:
            if self._open_reads.get(name):
                self._forget_later.add(name)
            else:
                self._forget(name)

    def read_opened(self, name: str) -> None:
        with self.lock:
            self._open_reads[name] = self._open_reads.get(name, 0) + 1

    def read_closed(self, name: str) -> None:
        with self.lock:
            left = self._open_reads.get(name, 0) - 1
            if left > 0:
                self._open_reads[name] = left
                return
            self._open_reads.pop(name, None)
            if name in self._forget_later:
                self._forget(name)

    def _forget(self, name: str) -> None:
        self._forget_later.discard(name)
        for key in [k for k in self._remote_dlists if k[0] == name]:
            try:
                self._remote_dlists.pop(key).release()
            except Exception as exc:  # a dead peer's list is freed with the agent at the latest
                logger.warning(f"kvxfer nixl: releasing a prepared list of peer {name!r} failed: {exc}")
        if self._remote_md.pop(name, None) is not None:
            self._remove_agent(name)
        self._remote_instance.pop(name, None)
        self._last_used.pop(name, None)
        watch = self._watches.pop(name, None)
        if watch is not None:
            watch.close()

    def _remove_agent(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:
            logger.warning(f"kvxfer nixl: removing peer agent {name!r} failed: {exc}")

    def send(self, peer_name: str, message: bytes) -> bool:
        """Best effort: a dead or unknown peer is not an error for the sender."""
        with self.lock:
            if self.agent is None:
                return False
            try:
                self.agent.send_notif(peer_name, message)
                return True
            except Exception:
                return False


# --------------------------------------------------------------------------------------------
# handle
# --------------------------------------------------------------------------------------------
class NixlHandle(TransferHandle):
    """One posted NIXL READ.

    ``path`` is ``"prepped"`` (indices into prepared lists) or ``"rows"`` (Nx3
    descriptor lists); ``num_descriptors``/``raw_descriptors`` are the coalesced
    and naive row counts; ``build_s`` the time spent building the request.
    The xfer is released only once NIXL reports it over (module docstring).
    """

    def __init__(self, request_id: RequestId, timeout_s: float, backend: "NixlBackend", xfer: Any,
                 peer: NixlPeer, *, path: str, num_descriptors: int,
                 raw_descriptors: int, total_bytes: int, build_s: float, report_failure: bool = True) -> None:
        super().__init__(request_id, timeout_s)
        self._report_failure = report_failure
        self._backend = backend
        self._xfer = xfer
        self._peer = peer
        self._released = False
        self._read_completed = False
        self._failure_reason: Optional[str] = None
        self._failure_sent = False
        self.path = path
        self.num_descriptors = num_descriptors
        self.raw_descriptors = raw_descriptors
        self.total_bytes = total_bytes
        self.build_s = build_s

    def _xfer_state(self) -> str:
        """``DONE``, ``PROC``, ``ERR`` (over: failed, nothing of it moves any more) or ``UNKNOWN``."""
        if self._released:
            return "DONE" if self._read_completed else "ERR"
        share = self._backend._share
        with share.lock:
            if share.agent is None:
                return "UNKNOWN"
            try:
                return share.agent.check_xfer_state(self._xfer)
            except Exception as exc:
                # A remote disconnect ends the READ (measured: nothing lands after it). Anything else
                # (e.g. NOT_FOUND after the peer was invalidated) says nothing about whether it moves.
                return "ERR" if type(exc).__name__ == "nixlRemoteDisconnectError" else "UNKNOWN"

    def _progress(self) -> bool:
        state = self._xfer_state()
        if state == "DONE":
            self._read_completed = True
            self._release()
            return True
        if state == "ERR":
            raise TransferError(
                f"request {self.request_id!r}: NIXL READ from peer {self._peer.name!r} failed "
                "(peer dead or unreachable, or its memory deregistered)"
            )
        return False

    def _release(self) -> bool:
        """Free the xfer handle; only ever called once NIXL reports the READ over."""
        if self._released:
            return True
        share = self._backend._share
        with share.lock:
            try:
                share.agent.release_xfer_handle(self._xfer)
            except Exception:
                return False  # kept; retried when storage_safe is next read
        self._released = True
        # The binding's xfer handle keeps the native agent alive (its fds and threads):
        # a handle kept by the caller after close() must not keep it too.
        self._xfer = None
        self._backend._in_flight.discard(self)
        share.read_closed(self._peer.name)
        return True

    def _abort(self) -> bool:
        """Safe only if the READ is over (then released); an active READ is never released."""
        state = self._xfer_state()
        if state not in ("DONE", "ERR"):
            return False
        # A read that completed right at the deadline has already sent its done notification.
        self._read_completed = state == "DONE"
        return self._release()

    def _settle(self) -> bool:
        return self._abort()

    def _on_failed(self, error: TransferError) -> None:
        self._failure_reason = str(error)
        if self._released:
            self._notify_failed()
        else:
            self._backend._unsettled.add(self)

    def _on_settled(self) -> None:
        self._backend._unsettled.discard(self)
        self._notify_failed()

    def _notify_failed(self) -> None:
        """Tell the source, once no byte of the read can still move."""
        if self._read_completed or self._failure_sent or not self._report_failure:
            return
        self._failure_sent = True
        message = notify.encode("failed", self.request_id, self._peer.buffer_id, self._failure_reason or "")
        self._backend._share.send(self._peer.name, message)


# --------------------------------------------------------------------------------------------
# backend
# --------------------------------------------------------------------------------------------
class NixlBackend(KVTransportBackend):
    """NIXL transport: DRAM or VRAM pools, one READ per request, read-done by notification."""

    name = "nixl"
    is_push = False
    supports_staging = True

    _availability: Optional[tuple[bool, str]] = None

    @classmethod
    def transport_probe(cls) -> dict[str, Any]:
        return nixl_transport_probe()

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if cls._availability is None:
            try:
                _nixl_api()
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
        self._in_flight: set[NixlHandle] = set()
        self._unsettled: set[NixlHandle] = set()  # failed while their READ was active: not yet released
        self._local_dlist: Any = None
        # A sibling (``new_registered_buffer``) shares its parent's agent whatever it is called.
        parent = self._parent
        self._share = _AgentShare.acquire(parent._share.name if isinstance(parent, NixlBackend) else self.agent_name)
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
        self._check_open()
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
        peer = replace(peer, transport=parse_nixl_peer(peer_meta))  # checked before anything is posted
        if self._share.same_host and peer_meta.get(HOST_FIELD) != host_identity():
            raise PeerMetadataError(
                f"peer meta comes from another host ({peer_meta.get(HOST_FIELD)!r}) but this process runs nixl in "
                f"same-host mode ({SAME_HOST_ENV}=1: UCX without peer failure handling); unset it to read from "
                "other hosts")
        return peer

    # --- pulls ---------------------------------------------------------------------------
    def _post_read(self, pull: PullRequest) -> TransferHandle:
        self._settle_unsettled()
        peer = pull.peer.transport  # parsed once, with the rest of the meta (parse_peer_meta)
        if not isinstance(peer, NixlPeer):
            peer = parse_nixl_peer(pull.peer_meta)  # a plan made outside parse_peer_meta
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
                pull.request_id, self.timeout_s, self, xfer, peer, path=path,
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
            if pull.local_base is None and _plan_is_slice_aligned(plan, local, remote):
                remote_list = self._share.remote_dlist(peer, remote)
                src_idx, dst_idx = slice_indices(plan, local.bytes_per_slice)
                return agent.make_prepped_xfer(
                    "READ", self._local_prepped(), dst_idx, remote_list, src_idx, message
                ), "prepped"
            local_rows = agent.get_xfer_descs(
                _rows(local_base, plan.dst_offsets, plan.lengths, local.device_id), self.mem_type
            )
            remote_rows = agent.get_xfer_descs(
                _rows(remote.buf_ptr, plan.src_offsets, plan.lengths, remote.device_id), peer.mem_type
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
        peer = parse_nixl_peer(peer_meta)
        message = (notify.encode("done", request_id, peer.buffer_id) if failure is None else
                   notify.encode("failed", request_id, peer.buffer_id, failure))
        self._share.send(peer.name, message)

    def _collect_notifications(self) -> None:
        self._settle_unsettled()
        self._share.collect_notifications()
        if _PARKED:
            parked_registrations()
