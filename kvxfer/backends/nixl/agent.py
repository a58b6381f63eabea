"""The process-wide NIXL agent: created once per name with kvxfer's settings, shared by sibling
registrations, holding the bounded table of remote peers and routing notifications."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from typing import Any, Mapping, Optional, Protocol

from kvxfer.meta import notice as notify
from kvxfer.backends.nixl.environment import INSTALL_HINT, nixl_api, progress_delay_us, same_host_mode
from kvxfer.backends.nixl.peer import PID_FIELD, START_FIELD, NixlPeer
from kvxfer.backends.nixl.slices import slice_rows
from kvxfer.backends.nixl.ucx_env import keep_idle_ib_module_out, nixl_transport_info
from kvxfer.backends.same_host import SourceWatch
from kvxfer.backends.ucx_reach import UNREACHABLE_HINT
from kvxfer.errors import BackendUnavailableError, PeerMetadataError, TransferError
from kvxfer.plan.geometry import BufferGeometry

logger = logging.getLogger(__name__)

#: Remote-agent table bounds (issue 26, row 6: 41 sources met one after another left 41 remote
#: agents). A peer whose process exited (pidfd, same host) is removed at once; one unused for
#: PEER_IDLE_S is removed; beyond MAX_PEERS the least recently used one without open READs is.
#: A removed peer is loaded again by its next pull.
MAX_PEERS = 64
PEER_IDLE_S = 300.0
_PEER_SWEEP_S = 1.0
_create_lock = threading.Lock()


class Registration(Protocol):
    """What the agent needs of a registration: where its notifications go."""

    def _deliver_read_done(self, request_id: Any) -> None: ...

    def _deliver_read_failed(self, request_id: Any, reason: str) -> None: ...


def _remote_key(peer: NixlPeer, g: BufferGeometry) -> tuple:
    return (peer.name, peer.instance, peer.mem_type, g.buf_ptr, g.num_outer, g.num_blocks,
            g.bytes_per_slice, g.device_id)


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


class AgentShare:
    """One NIXL agent per (process, agent name), reference-counted by its registrations.

    Siblings (``new_registered_buffer``: KV pool, SSM pools) share it, so they
    share one connection per peer and one notification stream; notifications are
    routed to the registration named in them. All agent calls go through
    ``lock``: the agent is created without NIXL's own locking (its default when
    no listener thread runs) and handles may be polled from any thread.
    """

    _shares: dict[str, "AgentShare"] = {}
    _shares_lock = threading.Lock()

    def __init__(self, name: str) -> None:
        api = nixl_api()
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
        self._registrations: dict[int, weakref.ref[Registration]] = {}
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
    def acquire(cls, name: str) -> "AgentShare":
        with cls._shares_lock:
            share = cls._shares.get(name)
            if share is None:
                share = cls._shares[name] = AgentShare(name)
            share.refs += 1
            return share

    def release(self) -> None:
        """Drop one reference; the last one releases every peer and the agent."""
        with AgentShare._shares_lock:
            self.refs -= 1
            if self.refs > 0:
                return
            AgentShare._shares.pop(self.name, None)
        with self.lock:
            for name in list(self._remote_md):
                self._forget(name)
            self.agent = None  # the binding's destructor tears the agent down

    # --- registrations and notifications -----------------------------------------------
    def add_registration(self, backend: Registration) -> int:
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
                # Loading connects to the peer: a dead peer fails here (seen: NIXL_ERR_BACKEND). So does a
                # live one whose published address is gone (``ucx_reach``; NIXL hides UCX's status from us).
                raise TransferError(
                    f"could not connect to peer {peer.name!r} ({kind}: {exc}); is it alive? If it is, "
                    f"{UNREACHABLE_HINT}. Nothing was posted"
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
