"""The coordinator: one process that registers engines and routes requests between them.

Flow: client ``Submit`` -> a prefill (``AddRequest``) -> its ``HandoffReady`` -> a
decode (``PeerMeta`` once per prefill incarnation, then ``StartDecode``) -> the decode's
``TransferReady`` and ``ReadDone`` (forwarded to the prefill as ``Release``) -> the
decode's ``Finished`` -> the client's ``Result``.

Registration refuses an engine whose model, geometry or transport differs from the
engines already registered, and sends the reason back. An engine is removed when its
control connection closes (socket monitor), when its heartbeats stop
(``heartbeat_timeout_s``), or when its process is gone (same host: its pid is checked
every tick); its requests fail with an error naming it.

Why a dead decode's source pins can be released: a one-sided read is posted by the
reader's process through its transport endpoint (a NIXL agent / UCX worker and its
memory handles). When that process has exited, the kernel has torn the endpoint
down, so no read of it can be in flight or be posted later. A decode that merely
went *silent* may still be reading (a paused process resumes with its reads posted),
so for it the prefill keeps the pins until its death is confirmed: its pid is gone
(same host), it said ``Goodbye``, or (other hosts, where we cannot see the pid) the
same identity registers again, meaning its operator restarted it. Until then the pins
are kept, and reported in ``Stats``: a leak is visible and bounded, garbage is neither.

This module imports no torch, so the coordinator process starts fast.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import zmq

from engine_integration import wire

GEOMETRY_FIELDS = ("schema_version", "backend", "dtype", "element_size", "tokens_per_block", "heads_per_partition",
                   "head_dim", "num_outer", "bytes_per_slice")


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = "127.0.0.1"
    port: int = 0                       #: 0 picks a free port
    heartbeat_timeout_s: float = 3.0    #: an engine silent this long is removed
    request_timeout_s: float = 120.0    #: a request not finished by then fails
    tick_s: float = 0.01
    secret: Optional[str] = None        #: HMAC secret for every frame (see ``wire.Codec``)


@dataclass
class _Engine:
    zmq_id: bytes
    reg: wire.Register
    last_seen: float
    hb: Optional[wire.Heartbeat] = None
    alive: bool = True
    death: str = ""
    death_confirmed: bool = False
    peers_sent: set = field(default_factory=set)       # decode: (prefill identity, incarnation) metas sent
    routed_hashes: set = field(default_factory=set)    # decode: block hashes we routed there (prefix score)
    blocks_sent_since_hb: int = 0
    requests: set = field(default_factory=set)

    @property
    def identity(self) -> str:
        return self.reg.identity


@dataclass
class _Request:
    rid: int
    client: bytes
    client_rid: int
    prompt: list[int]
    max_new_tokens: int
    submitted: float
    stage: str = "pending"                # pending -> prefill -> handoff -> decode
    prefill: Optional[bytes] = None
    decode: Optional[bytes] = None
    descriptor: Optional[dict] = None
    source_pinned: bool = False            # the prefill may still hold pins for it
    timings: dict = field(default_factory=dict)
    cached_prefix_blocks: int = 0
    pulled_blocks: int = 0


def _process_gone(pid: int) -> bool:
    """True when ``pid`` has exited (a zombie counts as exited: it runs nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def compatibility_problem(new: wire.Register, ref: wire.Register) -> Optional[str]:
    """Why ``new`` cannot exchange KV with ``ref`` (``None`` if it can).

    Only the KV geometry fields at the top of each rank's meta are compared; a
    prefill's generation-counter meta nested under ``generations`` is not KV and is
    deliberately left out (decode instances have none).
    """
    where = f"{ref.role} {ref.identity!r}"
    if len(new.transfer_meta) != len(ref.transfer_meta):
        return f"{len(new.transfer_meta)} transfer metas (ranks) here, {len(ref.transfer_meta)} on {where}"
    for i, (a, b) in enumerate(zip(new.transfer_meta, ref.transfer_meta)):
        for name in GEOMETRY_FIELDS:
            if a.get(name) != b.get(name):
                return (f"transfer meta [{i}] field {name!r} is {a.get(name)!r} here but {b.get(name)!r} on {where}; "
                        "prefill and decode must use the same transport and KV geometry")
    if new.model_fingerprint != ref.model_fingerprint:
        return (f"model fingerprint {new.model_fingerprint} differs from {ref.model_fingerprint} on {where}: "
                "the engines run different models or model configs")
    return None


class Coordinator:
    """The routing state machine around one ROUTER socket (``serve`` runs it)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.codec = wire.Codec(config.secret)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if config.port:
            self.sock.bind(f"tcp://{config.host}:{config.port}")
            self.port = config.port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{config.host}")
        self.address = f"tcp://{config.host}:{self.port}"
        # "Socket gone": the monitor reports a closed connection by its fd; each engine
        # message tells us which fd that engine's connection uses (ZMQ_SRCFD).
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._fd_owner: dict[int, bytes] = {}
        self.host = socket.gethostname()
        self.engines: dict[bytes, _Engine] = {}
        self.removed: dict[bytes, str] = {}
        self.dead: list[_Engine] = []       # removed decodes whose pin release awaits confirmed death
        self.requests: dict[int, _Request] = {}
        self.pending: deque[int] = deque()  # waiting for a prefill
        self.pending_handoff: deque[int] = deque()  # prefilled, waiting for a decode
        self._ids = itertools.count(1)
        self._stop = False

    # --- plumbing -----------------------------------------------------------------------
    def send(self, zmq_id: bytes, msg: wire.Msg) -> None:
        try:
            self.sock.send_multipart([zmq_id, self.codec.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # a peer that is gone; heartbeats and pid checks will remove it

    def serve(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.stop("coordinator terminated"))
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        try:
            while not self._stop:
                ready = dict(poller.poll(int(self.config.tick_s * 1000)))
                if self.sock in ready:
                    while self.sock.poll(0):
                        self._receive()
                if self.monitor in ready:
                    self._connection_events()
                self.tick()
        finally:
            for eng in self.engines.values():
                if eng.alive:
                    self.send(eng.zmq_id, wire.Shutdown("coordinator stopping"))
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.sock.close(linger=100)
            self.ctx.term()

    def _receive(self) -> None:
        frames = self.sock.recv_multipart(copy=False)
        if len(frames) != 2:
            return
        zmq_id = frames[0].bytes
        try:
            msg = self.codec.decode(frames[1].bytes)
        except Exception:  # malformed or unauthenticated: dropped (counted by the codec)
            return
        if zmq_id in self.engines or isinstance(msg, wire.Register):
            try:
                self._fd_owner[int(frames[1].get(zmq.SRCFD))] = zmq_id
            except (zmq.ZMQError, AttributeError, TypeError, ValueError):
                pass  # no fd information: heartbeats and pid checks still apply
        self.handle(zmq_id, msg)

    def _connection_events(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            eng = self.engines.get(self._fd_owner.pop(int(event["value"]), b""))
            if eng is not None and eng.alive:
                gone = eng.reg.host == self.host and _process_gone(eng.reg.pid)
                self._remove(eng, f"{eng.reg.role} {eng.identity!r} closed its connection to the coordinator"
                             + (f" (pid {eng.reg.pid} exited)" if gone else ""), confirmed=gone)

    def stop(self, reason: str = "") -> None:
        self._stop = True

    # --- messages -------------------------------------------------------------------------
    def handle(self, zmq_id: bytes, msg: wire.Msg) -> None:
        if isinstance(msg, wire.Register):
            return self._register(zmq_id, msg)
        if isinstance(msg, wire.Submit):
            return self._submit(zmq_id, msg)
        if isinstance(msg, wire.StatsRequest):
            return self.send(zmq_id, self.stats())
        if isinstance(msg, wire.Shutdown):
            return self.stop(msg.reason)
        eng = self.engines.get(zmq_id)
        if eng is None or not eng.alive:
            reason = self.removed.get(zmq_id, "not registered")
            if not isinstance(msg, wire.Goodbye):
                self.send(zmq_id, wire.Shutdown(f"the coordinator does not know this engine: {reason}"))
            return
        eng.last_seen = time.monotonic()
        if isinstance(msg, wire.Heartbeat):
            eng.hb, eng.blocks_sent_since_hb = msg, 0
            self.send(zmq_id, wire.Registered(True))  # keepalive: the engine knows we are here
        elif isinstance(msg, wire.HandoffReady):
            self._handoff_ready(eng, msg)
        elif isinstance(msg, wire.TransferReady):
            req = self.requests.get(msg.request_id)
            if req is not None:
                req.stage = "decode"
                req.cached_prefix_blocks, req.pulled_blocks = msg.cached_prefix_blocks, msg.pulled_blocks
                req.timings.update(pull_s=msg.pull_s, decode_queue_s=msg.queue_s, admit_seq=msg.admit_seq)
                req.timings["handoff_s"] = time.monotonic() - req.timings.pop("_handoff_t0", time.monotonic())
        elif isinstance(msg, wire.ReadDone):
            self._read_done(msg.request_id)
        elif isinstance(msg, wire.Finished):
            self._finish(msg.request_id, tokens=msg.tokens)
        elif isinstance(msg, wire.Failed):
            self._finish(msg.request_id, error=msg.reason)
        elif isinstance(msg, wire.Goodbye):
            self._remove(eng, f"{eng.reg.role} {eng.identity!r} left: {msg.reason or 'goodbye'}", confirmed=True)

    def _register(self, zmq_id: bytes, reg: wire.Register) -> None:
        if reg.role not in ("prefill", "decode"):
            return self.send(zmq_id, wire.Registered(False, f"unknown role {reg.role!r}"))
        existing = self.engines.get(zmq_id)
        if existing is not None and existing.alive:
            return self.send(zmq_id, wire.Registered(True))  # a retry of the same incarnation
        for other in list(self.engines.values()):
            if other.alive and other.identity == reg.identity:
                self._remove(other, f"{other.reg.role} {other.identity!r} was replaced by a new incarnation",
                             confirmed=other.reg.host != reg.host or _process_gone(other.reg.pid))
        for dead in list(self.dead):  # a restart on another host is the only news we get of the old one
            if dead.identity == reg.identity and dead.reg.host != self.host:
                self._confirm_death(dead, "its identity registered again")
        for other in self.engines.values():
            if other.alive:
                problem = compatibility_problem(reg, other.reg)
                if problem is not None:
                    return self.send(zmq_id, wire.Registered(False, problem))
        self.engines[zmq_id] = _Engine(zmq_id, reg, time.monotonic())
        self.removed.pop(zmq_id, None)
        self.send(zmq_id, wire.Registered(True))
        self._dispatch()

    def _submit(self, client: bytes, msg: wire.Submit) -> None:
        rid = next(self._ids)
        self.requests[rid] = _Request(rid, client, msg.client_request_id, list(msg.prompt), msg.max_new_tokens,
                                      time.monotonic())
        self.pending.append(rid)
        self._dispatch()

    def _handoff_ready(self, prefill: _Engine, msg: wire.HandoffReady) -> None:
        req = self.requests.get(msg.request_id)
        if req is None:  # failed meanwhile (e.g. timed out): nobody will read it
            return self.send(prefill.zmq_id, wire.Release([msg.request_id], "request no longer live"))
        req.stage, req.descriptor, req.source_pinned = "handoff", msg.descriptor, True
        req.timings["prefill_s"] = msg.prefill_s
        req.timings["_handoff_t0"] = time.monotonic()
        self.pending_handoff.append(req.rid)
        self._dispatch()

    def _read_done(self, rid: int) -> None:
        req = self.requests.get(rid)
        if req is None or not req.source_pinned:
            return
        req.source_pinned = False
        prefill = self.engines.get(req.prefill) if req.prefill else None
        if prefill is not None and prefill.alive:
            self.send(prefill.zmq_id, wire.Release([rid], "decode read done"))
        if req.stage == "done":
            self._forget(req)

    # --- routing --------------------------------------------------------------------------
    def _alive(self, role: str) -> list[_Engine]:
        return [e for e in self.engines.values() if e.alive and e.reg.role == role]

    def _dispatch(self) -> None:
        prefills = self._alive("prefill")
        while self.pending and prefills:
            req = self.requests.get(self.pending.popleft())
            if req is None:
                continue
            target = min(prefills, key=lambda e: len(e.requests))
            req.stage, req.prefill = "prefill", target.zmq_id
            target.requests.add(req.rid)
            self.send(target.zmq_id, wire.AddRequest(req.rid, req.prompt, req.max_new_tokens))
        decodes = self._alive("decode")
        while self.pending_handoff and decodes:
            req = self.requests.get(self.pending_handoff.popleft())
            if req is None or req.descriptor is None:
                continue
            prefill = self.engines.get(req.prefill) if req.prefill else None
            if prefill is None or not prefill.alive:
                continue
            target = max(decodes, key=lambda e: self._decode_score(e, req))
            self._send_to_decode(target, prefill, req)

    def _decode_score(self, eng: _Engine, req: _Request) -> tuple[int, int]:
        """(cached-prefix blocks we expect there, free blocks): prefix first, then room."""
        match = 0
        for h in req.descriptor["block_hashes"] if req.descriptor else ():
            if h not in eng.routed_hashes:
                break
            match += 1
        free = (eng.hb.free_blocks if eng.hb else eng.reg.capacity_blocks) - eng.blocks_sent_since_hb
        return match, free

    def _send_to_decode(self, decode: _Engine, prefill: _Engine, req: _Request) -> None:
        key = (prefill.identity, prefill.reg.incarnation)
        if key not in decode.peers_sent:
            self.send(decode.zmq_id, wire.PeerMeta(prefill.identity, prefill.reg.incarnation,
                                                   prefill.reg.transfer_meta))
            decode.peers_sent.add(key)
        assert req.descriptor is not None
        req.decode = decode.zmq_id
        decode.requests.add(req.rid)
        decode.routed_hashes.update(req.descriptor["block_hashes"])
        decode.blocks_sent_since_hb += len(req.descriptor["block_ids"])
        self.send(decode.zmq_id, wire.StartDecode(req.rid, req.descriptor, req.max_new_tokens))

    # --- endings ----------------------------------------------------------------------------
    def _finish(self, rid: int, *, tokens: Optional[list[int]] = None, error: Optional[str] = None) -> None:
        req = self.requests.get(rid)
        if req is None or req.stage == "done":
            return
        req.stage = "done"
        req.timings["total_s"] = time.monotonic() - req.submitted
        req.timings.pop("_handoff_t0", None)
        self.send(req.client, wire.Result(req.client_rid, tokens, error, dict(req.timings),
                                          req.cached_prefix_blocks, req.pulled_blocks))
        for zmq_id in (req.prefill, req.decode):
            eng = self.engines.get(zmq_id) if zmq_id else None
            if eng is not None:
                eng.requests.discard(rid)
        if not req.source_pinned:
            self._forget(req)

    def _forget(self, req: _Request) -> None:
        self.requests.pop(req.rid, None)

    def _fail_request(self, req: _Request, error: str) -> None:
        """Fail to the client; tell the engines still holding it to drop it."""
        for zmq_id in (req.prefill, req.decode):
            eng = self.engines.get(zmq_id) if zmq_id else None
            if eng is not None and eng.alive:
                self.send(eng.zmq_id, wire.Abort(req.rid, error))
        if req.source_pinned and req.decode is None:  # prefilled, never handed to a reader
            self._read_done(req.rid)
        self._finish(req.rid, error=error)

    def _remove(self, eng: _Engine, reason: str, *, confirmed: bool) -> None:
        """Take a dead engine out of routing and fail its requests; pins wait for confirmed death."""
        if not eng.alive:
            return
        eng.alive, eng.death = False, reason
        self.removed[eng.zmq_id] = reason
        self.send(eng.zmq_id, wire.Shutdown(f"removed: {reason}"))
        for rid in sorted(eng.requests):
            req = self.requests.get(rid)
            if req is not None and req.stage != "done":
                self._fail_request(req, f"request failed: {reason}")
        if eng.reg.role == "decode":
            self.dead.append(eng)
            if confirmed:
                self._confirm_death(eng, reason)
        else:
            for rid in list(self.requests):  # its pins died with it
                req = self.requests[rid]
                if req.prefill == eng.zmq_id:
                    req.source_pinned = False
                    if req.stage == "done":
                        self._forget(req)

    def _confirm_death(self, eng: _Engine, why: str) -> None:
        """No read by ``eng`` can be in flight any more: release what it was reading."""
        eng.death_confirmed = True
        if eng in self.dead:
            self.dead.remove(eng)
        for req in list(self.requests.values()):
            if req.decode == eng.zmq_id and req.source_pinned:
                self._read_done(req.rid)

    def tick(self) -> None:
        now = time.monotonic()
        for eng in list(self.engines.values()):
            if not eng.alive:
                continue
            gone = eng.reg.host == self.host and _process_gone(eng.reg.pid)
            if gone:
                self._remove(eng, f"{eng.reg.role} {eng.identity!r} (pid {eng.reg.pid}) exited", confirmed=True)
            elif now - eng.last_seen > self.config.heartbeat_timeout_s:
                self._remove(eng, f"{eng.reg.role} {eng.identity!r} sent no heartbeat for "
                                  f"{now - eng.last_seen:.1f}s (limit {self.config.heartbeat_timeout_s}s)",
                             confirmed=False)
        for eng in list(self.dead):
            if eng.reg.host == self.host and _process_gone(eng.reg.pid):
                self._confirm_death(eng, "its process exited")
        for req in list(self.requests.values()):
            if req.stage != "done" and now - req.submitted > self.config.request_timeout_s:
                self._fail_request(req, f"request timed out after {self.config.request_timeout_s}s "
                                        f"(stage: {req.stage})")

    def stats(self) -> wire.Stats:
        engines: dict[str, dict[str, Any]] = {}
        for eng in self.engines.values():
            if eng.identity in engines and not eng.alive:
                continue  # the live incarnation wins
            engines[eng.identity] = {
                "role": eng.reg.role, "alive": eng.alive, "pid": eng.reg.pid, "incarnation": eng.reg.incarnation,
                "death": eng.death, "requests": len(eng.requests),
                **({k: getattr(eng.hb, k) for k in eng.hb.__struct_fields__} if eng.hb else {}),
            }
        live = sum(1 for r in self.requests.values() if r.stage != "done")
        return wire.Stats(engines, live, self.codec.dropped)


# --- running it as a process ------------------------------------------------------------
def start_coordinator_process(config: CoordinatorConfig = CoordinatorConfig(), *,
                              start_timeout_s: float = 30.0) -> tuple[Any, str]:
    """Start a coordinator process; returns ``(process, address)`` once it is bound."""
    from engine_integration import procs

    proc, ready = procs.spawn("engine_integration.coordinator", asdict(config), start_timeout_s=start_timeout_s)
    return proc, ready["address"]


def stop_coordinator_process(proc: Any, timeout_s: float = 10.0) -> None:
    from engine_integration import procs

    procs.stop(proc, timeout_s, terminate_first=True)  # SIGTERM is its orderly stop


def main(argv: Optional[list[str]] = None) -> None:
    import json
    import sys

    from engine_integration import procs

    args = sys.argv[1:] if argv is None else argv
    config = CoordinatorConfig(**json.loads(args[0])) if args else CoordinatorConfig()
    coord = Coordinator(config)
    procs.report({"address": coord.address, "pid": os.getpid()}, int(args[1]))
    coord.serve()


if __name__ == "__main__":
    main()
