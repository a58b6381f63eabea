"""kvxfer's SGLang transfer backend classes: what ``get_kv_class`` returns for ``kvxfer_nixl`` /
``kvxfer_ucx`` (``docs/sglang.md``).

They subclass SGLang's ``Common*`` machinery, as SGLang's own NIXL backend does: SGLang's
decode reads more than ``BaseKV*`` declares (``prefill_info_table``, ``try_ensure_parallel_info``,
``bootstrap_infos``), and the bootstrap server, rank mapping, room table and heartbeats
are SGLang's own. What changes is the data path: the prefill offers pages,
the decode reads them with kvxfer (``puller``), the prefill frees them on kvxfer's read-done
(``source``). Only this module imports SGLang.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, ClassVar, Optional

import numpy as np
import torch
import zmq
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_ACK_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_disagg
from sglang.srt.utils.network import NetworkAddress

from kvxfer.backends.base import transfer_timeout_from_env
from kvxfer.defaults import bounded_float, bounded_int
from kvxfer.meta.seal import meta_key_from_env
from kvxfer.integrations.sglang import wire
from kvxfer.integrations.sglang.hellos import REFUSALS_PER_S, Budget, HelloPacer, pace_from_env
from kvxfer.integrations.sglang.names import BACKENDS
from kvxfer.integrations.sglang.pool import PoolRegistration
from kvxfer.integrations.sglang.puller import Puller
from kvxfer.integrations.sglang.regions import kv_layout
from kvxfer.integrations.sglang.sockets import EndpointSockets
from kvxfer.handoff.guard import LeaseTable
from kvxfer.integrations.sglang.source import SourceRooms
from kvxfer.integrations.sglang.tp import parallel_refusal, plan_pair

logger = logging.getLogger(__name__)

#: Rooms a prefill rank may have in flight (lease slots), and lease reads a decode rank may have in flight.
MAX_ROOMS_ENV = "KVXFER_SGLANG_MAX_ROOMS"
#: Seconds between the decode's liveness checks of each prefill it pulls from (SGLang's own minimum is 2 s).
HEARTBEAT_ENV = "KVXFER_SGLANG_HEARTBEAT_S"


def unsupported_options(disagg: Any, role: str, *, staging: bool = False) -> Optional[str]:
    """Why SGLang's disaggregation settings ``disagg`` (``get_disagg()``) and ``staging``
    (``SGLANG_DISAGG_STAGING_BUFFER``) need what kvxfer does not do, naming the flag; None when kvxfer can
    serve them. Refused when the manager is made (SGLang's queues make it in their ``__init__``), before any
    request."""
    if staging:
        return ("kvxfer's SGLang backend does not take part in SGLang's staging buffer (SGLANG_DISAGG_STAGING_BUFFER=1: "
                "the prefill gathers heads into a staging region its push backend writes from, and the decode "
                "scatters them; the scheduler calls those backends' prefetch and staging handlers). kvxfer needs "
                "none of it: across attention TP sizes each decode rank reads its own heads straight from the "
                "prefill's pages. Unset SGLANG_DISAGG_STAGING_BUFFER on both roles")
    if role == "decode" and float(getattr(disagg, "disaggregation_decode_host_receive_threshold", 1.0)) < 1:
        return ("kvxfer's SGLang backend reads into the decode's device KV pool only, not into host (HiCache) "
                "destinations: launch the decode without --disaggregation-decode-host-receive-threshold below 1 "
                f"(got {disagg.disaggregation_decode_host_receive_threshold}); no SGLang 0.5.23 backend supports "
                "host destinations either (supports_host_destination is False on all of them)")
    if getattr(disagg, "disaggregation_decode_allocation_policy", "early") != "early":
        return ("kvxfer's SGLang backend supports --disaggregation-decode-allocation-policy early only (got "
                f"{disagg.disaggregation_decode_allocation_policy!r}): launch both roles with the default")
    if role == "decode" and getattr(disagg, "disaggregation_decode_enable_radix_cache", False):
        return ("kvxfer's SGLang backend does not read a decode-side prefix (decode_prefix_len): launch the decode "
                "without --disaggregation-decode-enable-radix-cache")
    return None


def _endpoint(key: str) -> tuple[str, str, bool]:
    ip, _, port = key.rpartition(":")
    na = NetworkAddress(ip, int(port))
    return ip, na.to_tcp(), na.is_ipv6


class KvxferKVManager(CommonKVManager):
    """One SGLang rank's manager: registers SGLang's pool with kvxfer once, then serves (prefill) or
    pulls (decode) rooms. ``kvxfer_backend`` names the kvxfer transport."""

    kvxfer_backend: ClassVar[str] = BACKENDS["kvxfer"].kvxfer_backend  # a subclass per backend: names.BACKENDS
    kv_status_msg_tag = b"KVXFER_STATUS"  # kvxfer sends none (KVXFER_REVOKED instead); a decode drops any
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: Optional[bool] = False) -> None:
        self._kvxfer_status_lock = threading.Lock()  # before SGLang's init, which may set a status
        refused = unsupported_options(get_disagg(), "prefill" if disaggregation_mode == DisaggregationMode.PREFILL
                                      else "decode", staging=bool(envs.SGLANG_DISAGG_STAGING_BUFFER.get()))
        if refused:
            raise RuntimeError(refused)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.kvxfer_timeout_s = transfer_timeout_from_env()
        slots = bounded_int(MAX_ROOMS_ENV, os.environ.get(MAX_ROOMS_ENV) or 4096, 1, 1 << 24, unit="lease slots")
        device = str(getattr(server_args, "device", None) or "cuda")
        if device.startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"  # no CUDA in this process: SGLang's pool is host memory
        role = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        self.kvxfer_pool = PoolRegistration(args, self.kvxfer_backend, device=device, table_slots=slots, role=role,
                                            timeout_s=self.kvxfer_timeout_s)
        # SGLang sets the KV head counts on a non-MLA prefill only (the decode's KVArgs has none): read them there
        heads = ((int(args.kv_head_num), int(args.total_kv_head_num))
                 if role == "prefill" and not is_mla_backend else None)
        # the prefill's pipeline stage: SGLang sets its first (and last) layer on the prefill only
        stage = (int(args.prefill_start_layer), args.prefill_end_layer) if role == "prefill" else None
        self.kvxfer_layout = kv_layout(args, model=str(getattr(server_args, "model_path", "")),
                                       tp_size=self.attn_tp_size, pp_size=self.pp_size,
                                       tp_rank=self.attn_tp_rank % max(1, self.attn_tp_size),
                                       mla=bool(is_mla_backend), heads=heads, stage=stage)
        self.kvxfer_key = wire.peer_key(self.local_ip, self.rank_port)
        self._kvxfer_stop = threading.Event()
        self.kvxfer_junk = 0  # messages dropped for breaking kvxfer's wire schema (or its signature)
        self.kvxfer_frames = wire.FrameKey(meta_key_from_env())  # signs frames with the cluster key, if set
        self._kvxfer_junk_logged_at = float("-inf")
        self.kvxfer_unsent = 0  # messages zmq would not take (the peer's queue full, no connection)
        self._kvxfer_unsent_logged_at: dict[bytes, float] = {}
        # kvxfer's frames go on sockets of its own, bounded and closed when idle (SGLang's ``_connect`` keeps one
        # per endpoint for good: ``sockets``)
        self.kvxfer_sockets = EndpointSockets(self._zmq_ctx)
        self._kvxfer_swept_at = time.monotonic()
        self.kvxfer_rooms: Optional[SourceRooms] = None
        self.kvxfer_puller: Optional[Puller] = None
        self.kvxfer_hellos: Optional[HelloPacer] = None
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._kvxfer_export = self.kvxfer_pool.export()
            self.kvxfer_hellos = HelloPacer(self._kvxfer_hello, pace_s=pace_from_env())
            self._kvxfer_checks = Budget(REFUSALS_PER_S)  # layouts compared on a REG's arrival (hellos.py)
            self.kvxfer_refused = 0  # decodes told at once that their layout cannot be served
            self._kvxfer_refused_logged_at = float("-inf")
            self.kvxfer_rooms = SourceRooms(LeaseTable(self.kvxfer_pool.table), prefill_key=self.kvxfer_key,
                                            timeout_s=2 * self.kvxfer_timeout_s, send=self._kvxfer_push,
                                            conclude=self._kvxfer_conclude, max_early=slots,
                                            early_s=float(self.bootstrap_timeout), busy=self._kvxfer_busy)
            self._kvxfer_threads(self._prefill_listen, self._prefill_service)
        else:
            self.kvxfer_puller = Puller(self.kvxfer_pool, self.kvxfer_layout, succeed=self._kvxfer_succeed,
                                        fail=self._kvxfer_fail, send=self._kvxfer_push, endpoint=self.kvxfer_key)
            self._kvxfer_threads(self._decode_listen)
            self.heartbeat_interval = bounded_float(HEARTBEAT_ENV, os.environ.get(HEARTBEAT_ENV) or 1.0, 0.01, 3600.0,
                                                    unit="seconds")
            self._start_heartbeat_checker_thread()

    def update_status(self, bootstrap_room: int, status: KVPoll) -> None:
        """SGLang's update (a read, then a ``max`` write) under one lock: kvxfer's threads conclude rooms
        while SGLang's scheduler marks them Transferring, and a Failed overwritten by Transferring would
        leave the room held for good."""
        with self._kvxfer_status_lock:
            super().update_status(bootstrap_room, status)

    # --- plumbing ----------------------------------------------------------------------------
    def _kvxfer_threads(self, *targets: Any) -> None:
        for target in targets:
            threading.Thread(target=self._guarded, args=(target,), name=f"kvxfer-sglang{target.__name__}",
                             daemon=True).start()

    def _guarded(self, target: Any) -> None:
        try:
            target()
        except Exception:
            if not self._kvxfer_stop.is_set():
                logger.exception("kvxfer sglang: %s died; this rank's transfers will fail by timeout", target.__name__)

    def _kvxfer_push(self, key: str, frames: list[bytes]) -> bool:
        """Send ``frames`` (signed) to the rank at ``key`` without blocking; True if zmq took them. SGLang's
        scheduler thread and kvxfer's threads call this (``SourceRooms`` under its lock: this takes only the
        socket table's lock), and a dead or stalled peer must cost them nothing. A message zmq will not
        take is dropped and logged (one line per 10 s per kind of message); the caller decides what that means for its room
        (a chunk fails it at once)."""
        self._kvxfer_sweep()
        try:
            _, tcp, ipv6 = _endpoint(key)
            self.kvxfer_sockets.send(tcp, self.kvxfer_frames.sign(frames), ipv6=ipv6)
            return True
        except Exception as exc:  # zmq.Again (no live connection, or its queue is full), a bad address, ...
            self.kvxfer_unsent += 1
            now, tag = time.monotonic(), bytes(frames[0][:16])  # kvxfer's own tags: a handful of keys
            if now - self._kvxfer_unsent_logged_at.get(tag, float("-inf")) > 10.0:
                self._kvxfer_unsent_logged_at[tag] = now
                logger.warning("kvxfer sglang: sending %s to %s failed (%d so far): %s", bytes(frames[0][:16]), key,
                               self.kvxfer_unsent, f"{type(exc).__name__}: {exc}")
            return False

    def _kvxfer_sweep(self) -> None:
        """Close the idle endpoint sockets, at most every 0.25 s (the prefill's service loop and every send call it)."""
        now = time.monotonic()
        if now - self._kvxfer_swept_at >= 0.25:
            self._kvxfer_swept_at = now
            self.kvxfer_sockets.sweep()

    def _kvxfer_busy(self, key: str, busy: bool) -> None:
        """``SourceRooms``: the decode at ``key`` has its first room in flight here (its socket is kept open, its
        REG answered now, before that room's first chunk), or its last one ended."""
        self.kvxfer_sockets.hold(_endpoint(key)[1], busy)
        self.kvxfer_hellos.busy(key, busy)

    def _recv(self) -> Optional[list[bytes]]:
        if not self.server_socket.poll(200):
            return None
        return self.server_socket.recv_multipart()

    def _listen(self, handle: Any) -> None:
        """Receive on this rank's socket until stopped, ``handle`` each message: a message that breaks
        its schema (or the handler) is counted and dropped, never the end of the listener."""
        while not self._kvxfer_stop.is_set():
            msg = self._recv()
            if not msg:
                continue
            try:
                handle(msg)
            except Exception as exc:  # a junk or hostile peer: this rank keeps serving the others
                self.kvxfer_junk += 1
                now = time.monotonic()
                if now - self._kvxfer_junk_logged_at > 10.0:
                    self._kvxfer_junk_logged_at = now
                    logger.warning("kvxfer sglang: dropped a message that broke kvxfer's wire schema (%d so far): "
                                   "%s: %s", self.kvxfer_junk, type(exc).__name__, exc)

    # --- prefill -----------------------------------------------------------------------------
    def _prefill_listen(self) -> None:
        self._listen(self._prefill_message)

    def _prefill_message(self, msg: list[bytes]) -> None:
        parsed = wire.decode(msg, self.kvxfer_frames)
        if parsed is None:
            if msg[0] == b"ABORT":
                note = AbortNotification.from_zmq(msg)
                if note is not None:  # the room's other decode ranks (if any) are told; the aborting one need not be
                    aborter = (None if note.decode_ip is None or note.decode_port is None
                               else wire.peer_key(note.decode_ip, note.decode_port))
                    self.kvxfer_rooms.abort(note.room, "the decode aborted the request", skip=aborter)
                return
            raise wire.WireError(f"unexpected message {msg[0][:20]!r}")
        tag, body = parsed
        if tag == wire.REG:  # kept, answered once the decode has a room here (hellos.py); refused ones at once
            if self._kvxfer_checks.take():
                refused, _ = plan_pair(self.kvxfer_layout, body["layout"])
                if refused:
                    self._kvxfer_refuse(body["endpoint"], refused)
                    return
            self.kvxfer_hellos.reg(body, size=len(msg[1]))
        elif tag == wire.META:
            room = body["room"]
            if self.kvxfer_rooms.metadata(room, body):  # a room SGLang has a sender for (else kept, bounded)
                self.update_status(room, KVPoll.WaitingForInput)
        elif tag == wire.FAILED:
            self.kvxfer_rooms.decode_failed(body["room"], body["lease"], body["endpoint"], body["reason"],
                                            chunk=body["chunk"])
        else:
            raise wire.WireError(f"{tag.decode()} is a message for a decode, not a prefill")

    def _kvxfer_hello(self, reg: dict) -> None:
        """Answer a decode's registration (it has a room here now): this prefill's metas and layout, or why its
        layout cannot be served."""
        refused, _ = plan_pair(self.kvxfer_layout, reg["layout"])
        if refused:
            self._kvxfer_refuse(reg["endpoint"], refused)
            return
        self._kvxfer_push(reg["endpoint"], wire.encode(wire.HELLO, {
            "prefill": self.kvxfer_key, "metas": self._kvxfer_export, "layout": self.kvxfer_layout}))

    def _kvxfer_refuse(self, endpoint: str, refused: str) -> None:
        """Tell a decode its layout cannot be served: a HELLO with the reason and no metas (nothing to read with)."""
        self.kvxfer_refused += 1
        now = time.monotonic()
        if now - self._kvxfer_refused_logged_at > 10.0:  # a stranger's REGs must not flood the log
            self._kvxfer_refused_logged_at = now
            logger.error("kvxfer sglang: refusing decode %s, its KV layout differs (%d refused so far): %s", endpoint,
                         self.kvxfer_refused, refused)
        self._kvxfer_push(endpoint, wire.encode(wire.HELLO, {"prefill": self.kvxfer_key, "layout": self.kvxfer_layout,
                                                             "refused": refused}))

    def _prefill_service(self) -> None:
        rooms, pool = self.kvxfer_rooms, self.kvxfer_pool
        while not self._kvxfer_stop.is_set():
            busy = False
            for rid in pool.table_backend.drain_read_done():
                rooms.read_done(str(rid))
                busy = True
            for backend in pool.all_backends():
                for failure in backend.drain_read_failed():
                    rooms.read_failed(failure.request_id, failure.reason)
                    busy = True
            rooms.expire()
            rooms.flush()
            self.kvxfer_hellos.flush()
            self._kvxfer_sweep()
            if not busy:
                time.sleep(0.0005)

    def _kvxfer_conclude(self, room: int, success: bool, reason: Optional[str]) -> None:
        """SGLang's status for a room ``SourceRooms`` concluded (it tells the decode itself: KVXFER_REVOKED)."""
        if success:
            self.update_status(room, KVPoll.Success)
            return
        logger.warning("kvxfer sglang: room %s failed on the prefill: %s", room, reason)
        if room in self.request_status:  # a room with no sender (only the decode's metadata came) has no record
            self.record_failure(room, reason or "kvxfer transfer failed")
            self.update_status(room, KVPoll.Failed)

    def add_transfer_request(self, bootstrap_room: int, kv_indices: np.ndarray, index_slice: slice,
                             is_last_chunk: bool, aux_index: Optional[int] = None,
                             state_indices: Optional[list] = None, **_: Any) -> None:
        """SGLang's ``CommonKVSender.send`` calls this per chunk: offer the pages to the decode."""
        self.update_status(bootstrap_room, KVPoll.Transferring)
        self.kvxfer_rooms.add_chunk(bootstrap_room, np.asarray(kv_indices), index_slice.start, index_slice.stop,
                                    is_last_chunk, aux_index, state_indices)

    # --- decode ------------------------------------------------------------------------------
    def _decode_listen(self) -> None:
        self._listen(self._decode_message)

    def _decode_message(self, msg: list[bytes]) -> None:
        parsed = wire.decode(msg, self.kvxfer_frames)
        if parsed is not None:
            tag, body = parsed
            kinds = {wire.HELLO: "hello", wire.CHUNK: "chunk", wire.REVOKED: "revoked"}
            if tag not in kinds:
                raise wire.WireError(f"{tag.decode()} is a message for a prefill, not a decode")
            self.kvxfer_puller.post(kinds[tag], body)
            return
        if msg[0] == ABORT_ACK_TAG:
            return
        if msg[0] == self.kv_status_msg_tag:  # bound to no peer and no lease: a replay could fail any room
            raise wire.WireError("a status message: a kvxfer prefill reports failures with KVXFER_REVOKED (bound to "
                                 "the room's prefill and lease), and the decode's own reads say Success")
        raise wire.WireError(f"unexpected message {bytes(msg[0][:20])!r}")

    def _kvxfer_succeed(self, room: int) -> None:
        self.update_status(room, KVPoll.Success)

    def _kvxfer_fail(self, room: int, reason: str) -> None:
        logger.warning("kvxfer sglang: room %s failed on the decode: %s", room, reason)
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's checks (page size, KV dtype, ...) and its rank mapping, then kvxfer's: a decode of PP 1 (a
        prefill of any PP at the same attention TP, no state), attention TP sizes that divide one another, and
        no state across different TP sizes (what the layouts say, heads and layers included, is checked when
        the prefill's HELLO comes: ``tp.plan_pair``)."""
        if not super().try_ensure_parallel_info(bootstrap_addr):
            return False
        info = self.prefill_info_table[bootstrap_addr]
        refused = parallel_refusal(prefill_tp=info.attn_tp_size, prefill_pp=info.pp_size, decode_tp=self.attn_tp_size,
                                   decode_pp=self.pp_size, decode_state=list(self.kv_args.state_types))
        if refused:
            self.prefill_info_table.pop(bootstrap_addr, None)
            raise RuntimeError(
                f"kvxfer ({self.kvxfer_backend}) cannot read from this prefill: {refused}; prefill {bootstrap_addr} "
                f"has attn_tp_size={info.attn_tp_size} pp_size={info.pp_size}, this decode has attn_tp_size="
                f"{self.attn_tp_size} pp_size={self.pp_size}. Launch the decode with --pp-size 1 and, when the prefill "
                "has PP > 1, the same attention TP as the prefill (or use SGLang's nixl/mooncake backend)")
        return True

    def build_receiver_registration_message(self) -> list[bytes]:
        return self.kvxfer_frames.sign(wire.encode(wire.REG, {"endpoint": self.kvxfer_key,
                                                              "layout": self.kvxfer_layout}))

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int,
                                        kv_indices: np.ndarray, aux_index: Optional[int],
                                        state_indices: Optional[list], decode_prefix_len: Optional[int],
                                        is_dummy: bool, device_kv_indices: Optional[np.ndarray] = None,
                                        ) -> list[bytes]:
        return self.kvxfer_frames.sign(wire.encode(wire.META, {
            "room": int(bootstrap_room), "endpoint": self.kvxfer_key, "readers": int(required_dst_info_num or 1),
            "dummy": bool(is_dummy)}))

    # --- for tests and operators -------------------------------------------------------------
    def kvxfer_sizes(self) -> dict[str, int]:
        """Entries in every table this manager keeps (all zero once no request is in flight)."""
        out = {"request_status": _entries(self.request_status), "failure_records": len(self.failure_records)}
        if self.kvxfer_rooms is not None:
            out.update({f"source_{k}": v for k, v in self.kvxfer_rooms.sizes().items()})
            out["transfer_infos"] = len(self.transfer_infos)
        if self.kvxfer_puller is not None:
            out.update({f"puller_{k}": v for k, v in self.kvxfer_puller.sizes().items()})
            out["prefill_response_tracker"] = len(self.prefill_response_tracker)
            out["required_prefill_response_num_table"] = len(self.required_prefill_response_num_table)
        return out

    def kvxfer_close(self) -> None:
        self._kvxfer_stop.set()
        if self.kvxfer_puller is not None:
            self.kvxfer_puller.close()
        self.kvxfer_sockets.close()
        self.kvxfer_pool.close()


def _entries(table: Any) -> int:
    """Entries of SGLang's room-status table: a dict, or on a prefill of PP > 1 SGLang's ``PPConsensusStore``
    (a dict-like without ``len``; 0.5.23 keeps this rank's entries in ``_local_map``)."""
    try:
        return len(table)
    except TypeError:
        return len(getattr(table, "_local_map", {}))


class KvxferNixlKVManager(KvxferKVManager):
    kvxfer_backend = BACKENDS["kvxfer_nixl"].kvxfer_backend


class KvxferUcxKVManager(KvxferKVManager):
    kvxfer_backend = BACKENDS["kvxfer_ucx"].kvxfer_backend


class KvxferKVSender(CommonKVSender):
    """SGLang's sender; its ``send`` reaches ``KvxferKVManager.add_transfer_request``."""

    def __init__(self, mgr: KvxferKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        early = mgr.kvxfer_rooms.open(bootstrap_room)
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        if early and self.conclude_state is None:  # the decode's metadata came before this sender
            mgr.update_status(bootstrap_room, KVPoll.WaitingForInput)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.kvxfer_rooms.close(self.bootstrap_room)

    def abort(self) -> None:
        super().abort()
        self.kv_mgr.kvxfer_rooms.abort(self.bootstrap_room, "aborted by the prefill")
        self.kv_mgr.kvxfer_rooms.flush()


class KvxferKVReceiver(CommonKVReceiver):
    """SGLang's receiver; its metadata names the destination pages the puller reads into."""

    def poll(self) -> KVPoll:
        """SGLang's poll, except that it never answers Failed while a read of this room may still land:
        SGLang frees the pages on Failed, and its own paths to Failed (``abort()``, its waiting timeout)
        do not ask the manager. Until the puller has let go of the room, it is Transferring (and its
        reads are cancelled)."""
        status = super().poll()
        puller = self.kv_mgr.kvxfer_puller
        if status == KVPoll.Failed and puller.holds(self.bootstrap_room):
            puller.cancel(self.bootstrap_room)
            return KVPoll.Transferring
        return status

    def _register_kv_args(self) -> bool:
        """SGLang registers this decode with its prefill ranks: the puller then takes a HELLO from those
        ranks only (one from anyone else is a stranger's)."""
        for info in getattr(self, "bootstrap_infos", None) or []:
            self.kv_mgr.kvxfer_puller.post("expect", wire.peer_key(info["rank_ip"], info["rank_port"]))
        return super()._register_kv_args()

    def send_metadata(self, kv_indices: np.ndarray, aux_index: Optional[int] = None,
                      state_indices: Optional[list] = None, decode_prefix_len: Optional[int] = None,
                      destination: Any = None, device_kv_indices: Optional[np.ndarray] = None) -> None:
        infos = getattr(self, "bootstrap_infos", None)
        if infos:  # the prefill ranks SGLang pairs this decode rank with for the room, its dummy pairings left out;
            # the last pipeline stage first (SGLang fetches them so, said here): the aux row is read from the first,
            # and the last stage is the one that samples the first token (and holds the hidden states)
            infos = sorted(infos, key=lambda info: -int(info.get("pp_rank") or 0))
            meta = {"dst_pages": [int(p) for p in np.asarray(kv_indices).reshape(-1)],
                    "aux_index": None if aux_index is None else int(aux_index),
                    "state_indices": None if not state_indices else
                    [None if s is None else [int(x) for x in np.asarray(s).reshape(-1)] for s in state_indices]}
            sources = list(dict.fromkeys(wire.peer_key(info["rank_ip"], info["rank_port"]) for info in infos
                                         if not info.get("is_dummy")))
            self.kv_mgr.kvxfer_puller.post_meta(self.bootstrap_room, sources, meta)
        kwargs = {} if destination is None else {"destination": destination}
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, **kwargs)

    def abort(self) -> None:
        super().abort()
        self.kv_mgr.kvxfer_puller.cancel(self.bootstrap_room)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.kvxfer_puller.post("clear", self.bootstrap_room)


class KvxferKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's own bootstrap server (rank table, ``/route``, ``/health``)."""
