"""The coordinator: one process that registers engines and routes requests between them.

Flow: client ``Submit`` -> a prefill (``AddRequest``) -> its ``HandoffReady`` -> a
decode (``PeerMeta`` once per prefill incarnation, then ``StartDecode``) -> the decode's
``TransferReady`` and ``ReadDone`` (forwarded to the prefill as ``Release``) -> the
decode's ``Finished`` -> the client's ``Result``.

Every fleet decision is ``control_plane.policy``'s, the same the etcd plane makes:
registration refuses an engine whose model, geometry or transport differs from the
engines already registered (``fleet_refusal``, the reason sent back; and, before
anything changes, a registration naming a live engine's identity), admission refuses
at submit what no live pool could hold (``admission_problem``), and routing picks the
prefill (``pick_prefill``) and the decode (``pick_decode``, from each decode's last
heartbeat, the blocks and prefixes routed there since, its pulls pending). An engine is removed when its
control connection closes (socket monitor), when its heartbeats stop
(``heartbeat_timeout_s``), or when its process is gone (same host: its pid is checked
every tick); its requests fail with an error naming it.

Why a dead decode's source pins can be released: a one-sided read is posted by the
reader's process through its transport endpoint (a NIXL agent / UCX worker and its
memory handles). When that process has exited, the kernel has torn the endpoint
down, so no read of it can be in flight or be posted later. A decode that merely
went *silent* may still be reading (a paused process resumes with its reads posted),
so for it the prefill keeps the pins until its death is confirmed: its pid is gone
(same host) or it said ``Goodbye``. Past that, a reader silent for ``pin_grace_s`` (or
whose identity registers again from another host: the only news of a restart there, but
an insider can claim it too) is *presumed* dead and its pins are freed, but only for
requests whose descriptor carries the source's generation counters: a zombie reader
that wakes up later re-reads those counters after the data and fails its torn-read
check, so it can never commit the reused blocks (``kvxfer.handoff.generations``). A
request without counters keeps its pins until death is confirmed: without the check, a
timer must never free a pin.

Trust: every frame arrives through ``channel`` (encrypted,
authenticated, replay-proof) and is schema-validated by ``wire``; on top, a message
must fit the sender's role and state (only the decode a request was routed to may say
it was read, only its prefill may hand it off, naming itself as the source). Anything
else is refused and counted in ``Stats.dropped``, never a crash.

This module imports no torch, so the coordinator process starts fast.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import zmq

from engine_integration.control_plane import policy
from engine_integration.control_plane.policy import process_gone
from engine_integration.control_plane.zmq import wire
from engine_integration.control_plane.zmq.channel import (HANDSHAKE_TIMEOUT_S, MAX_CONNECTIONS, MAX_FRAME_BYTES,
                                                          SESSION_GRACE_S, ServerChannel, resolve_secret)
from kvxfer.defaults import MAX_TIMEOUT_S, MIN_TIMEOUT_S, bounded_float, bounded_int

#: its module's name, written out: run with ``python -m`` (a process of its own), ``__name__`` is "__main__"
log = logging.getLogger("engine_integration.control_plane.zmq.coordinator")


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = "127.0.0.1"
    port: int = 0                       #: 0 picks a free port
    heartbeat_timeout_s: float = 3.0    #: an engine silent this long is removed
    request_timeout_s: float = 120.0    #: a request not finished by then fails
    tick_s: float = 0.01
    secret: Optional[str] = None        #: cluster secret (prefer ``secret_file``: never in argv or config dumps)
    secret_file: Optional[str] = None   #: a 0600 file holding it; else ``$KVXFER_SECRET_FILE``
    insecure: bool = False              #: run with no secret at all: must be asked for by name (logged loudly)
    max_frame_bytes: int = MAX_FRAME_BYTES  #: larger frames drop their connection before being buffered
    max_connections: int = MAX_CONNECTIONS  #: authenticated connections beyond this are refused (logged)
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S  #: a connection not through its handshake by then is closed
    session_grace_s: float = SESSION_GRACE_S  #: a session whose connection closed is freed after this
    max_sessions: Optional[int] = None  #: sessions held at most (None: twice ``max_connections``)
    #: a decode silent this long past its removal is presumed dead: pins of requests whose reads are
    #: torn-read checked (generation counters) are freed. None: only confirmed death frees pins.
    pin_grace_s: Optional[float] = 10.0
    #: a live decode that has not released a failed request's source this long after it was told to
    #: drop it (``Abort``) is a stuck reader: the pins of that request are freed if its reads are
    #: torn-read checked, else kept (and counted in ``Stats.stuck_requests``) until it reports or dies.
    stuck_reader_grace_s: Optional[float] = 30.0
    #: route a request to the decode expected to cache its prefix while that decode has room
    #: (``policy.pick_decode``); False: least loaded only (the benchmark's baseline)
    prefix_routing: bool = True

    def __post_init__(self) -> None:
        """Every number finite and in range (``kvxfer.defaults.bounded_float``): an infinite grace or
        timeout would hold a dead engine's pins or a stuck request for ever."""
        optional = ("pin_grace_s", "stuck_reader_grace_s")  # None: only confirmed death frees pins
        for name in ("heartbeat_timeout_s", "request_timeout_s", "handshake_timeout_s", "session_grace_s", *optional):
            if name not in optional or getattr(self, name) is not None:
                bounded_float(f"CoordinatorConfig.{name}", getattr(self, name), MIN_TIMEOUT_S, MAX_TIMEOUT_S,
                              unit="seconds")
        bounded_float("CoordinatorConfig.tick_s", self.tick_s, MIN_TIMEOUT_S, 1.0, unit="seconds")
        bounded_int("CoordinatorConfig.port", self.port, 0, 65535)
        bounded_int("CoordinatorConfig.max_frame_bytes", self.max_frame_bytes, 1024, 1 << 30, unit="bytes")
        bounded_int("CoordinatorConfig.max_connections", self.max_connections, 1, 1 << 16)
        if self.max_sessions is not None:
            bounded_int("CoordinatorConfig.max_sessions", self.max_sessions, 1, 1 << 20)


@dataclass
class _Engine:
    zmq_id: bytes
    reg: wire.Register
    last_seen: float
    hb: Optional[wire.Heartbeat] = None
    alive: bool = True
    death: str = ""
    death_confirmed: bool = False
    removed_at: float = 0.0
    peers_sent: set = field(default_factory=set)       # decode: (prefill identity, incarnation) metas sent
    routed: policy.RoutedPrefixes = field(default_factory=policy.RoutedPrefixes)  # decode: hashes routed there
    #: decode: blocks routed there since its last heartbeat, minus those of its requests finished since
    #: (one connection delivers in order, so a heartbeat counts exactly the finishes it follows)
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
    descriptor: Optional[wire.Descriptor] = None
    source_pinned: bool = False            # the prefill may still hold pins for it
    push_forwarded: bool = False           # push backends: the prefill was told to push (PushKV)
    aborted_at: float = 0.0                # failed while a live decode held it: when it was told to drop it
    stuck: bool = False                    # its decode never released it within stuck_reader_grace_s
    timings: dict = field(default_factory=dict)
    cached_prefix_blocks: int = 0
    pulled_blocks: int = 0
    reserved_blocks: int = 0               # what routing expected it to take from its decode's free pool
    committed: bool = False                # its decode reported the KV committed (its blocks are reserved there)


def member(reg: wire.Register) -> policy.Member:
    """A registered engine as the fleet policy sees it."""
    return policy.Member(reg.identity, reg.role, reg.capacity_blocks, tuple(reg.transfer_meta), reg.model_fingerprint)


def _raise_fd_limit() -> None:
    """Lift the soft open-file limit to the hard one: idle connections must not lock clients out at 1,024."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536),
                                                        hard))
    except (ImportError, ValueError, OSError):
        pass


class Coordinator:
    """The routing state machine around one ROUTER socket (``serve`` runs it)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        secret = resolve_secret(config.secret, secret_file=config.secret_file, insecure=config.insecure,
                                who="the coordinator")
        _raise_fd_limit()
        self.ctx = zmq.Context()
        self.channel = ServerChannel(self.ctx, config.host, config.port, secret,
                                     max_frame_bytes=config.max_frame_bytes, max_connections=config.max_connections,
                                     handshake_timeout_s=config.handshake_timeout_s,
                                     session_grace_s=config.session_grace_s, max_sessions=config.max_sessions)
        self.sock = self.channel.sock
        self.port = self.channel.port
        self.address = f"tcp://{config.host}:{self.port}"
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
        self.channel.send(zmq_id, msg)

    def serve(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.stop("coordinator terminated"))
        poller = zmq.Poller()
        for sock in self.channel.sockets():
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop:
                poller.poll(int(self.config.tick_s * 1000))
                self._connection_events()
                n = 0
                while self.sock.poll(0) and n < 1000:  # bounded: connection events and ticks keep running
                    self._receive()
                    n += 1
                self.tick()
        finally:
            for eng in self.engines.values():
                if eng.alive:
                    self.send(eng.zmq_id, wire.Shutdown("coordinator stopping"))
            self.channel.close()
            self.ctx.term()

    def _receive(self) -> None:
        try:
            got = self.channel.receive()
        except Exception as exc:  # the channel refuses by counting; anything else must cost one frame, not the plane
            self.channel.count("invalid")
            # one line: a peer sending junk must not fill the log with tracebacks (the detail is at DEBUG)
            log.warning("coordinator: a control frame could not be read (%s: %s); dropped", type(exc).__name__,
                        str(exc)[:200])
            log.debug("coordinator: the unreadable control frame's traceback", exc_info=True)
            return
        if got is None:  # a handshake, or refused and counted
            return
        zmq_id, msg, _frame = got
        try:
            self.handle(zmq_id, msg)
        except Exception:  # a bug must cost one message, not the cluster
            self.channel.count("handler error")
            log.exception("coordinator: handling %s from %r failed; message dropped", type(msg).__name__, zmq_id[:64])

    def _refuse(self, eng: Optional[_Engine], msg: wire.Msg, why: str) -> None:
        """An authenticated message that does not fit its sender's role or state: counted and logged."""
        self.channel.count("refused")
        who = f"{eng.reg.role} {eng.identity!r}" if eng is not None else "a client"
        log.warning("coordinator: refused %s from %s: %s", type(msg).__name__, who, why)

    def _connection_events(self) -> None:
        for peer in self.channel.events():  # "socket gone", by the connection each peer last spoke on
            eng = self.engines.get(peer)
            if eng is not None and eng.alive:
                gone = eng.reg.host == self.host and process_gone(eng.reg.pid)
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
            log.info("coordinator: stopping on request of %r: %s", zmq_id[:64], msg.reason)
            return self.stop(msg.reason)
        eng = self.engines.get(zmq_id)
        if eng is None or not eng.alive:
            reason = self.removed.get(zmq_id, "not registered")
            if not isinstance(msg, wire.Goodbye):
                self.send(zmq_id, wire.Shutdown(f"the coordinator does not know this engine: {reason}"))
            return
        eng.last_seen = time.monotonic()
        why = self._misfit(eng, msg)
        if why is not None:
            return self._refuse(eng, msg, why)
        if isinstance(msg, wire.Heartbeat):
            eng.hb, eng.blocks_sent_since_hb = msg, 0
            eng.routed.evicted(msg.evictions, msg.evicted)
            self.send(zmq_id, wire.Registered(True))  # keepalive: the engine knows we are here
        elif isinstance(msg, wire.HandoffReady):
            self._handoff_ready(eng, msg)
        elif isinstance(msg, wire.TransferReady):
            req = self.requests.get(msg.request_id)
            if req is not None:
                req.stage, req.committed = "decode", True
                req.cached_prefix_blocks, req.pulled_blocks = msg.cached_prefix_blocks, msg.pulled_blocks
                req.timings.update(pull_s=msg.pull_s, decode_queue_s=msg.queue_s, admit_seq=msg.admit_seq)
                req.timings["handoff_s"] = time.monotonic() - req.timings.pop("_handoff_t0", time.monotonic())
        elif isinstance(msg, wire.ReadDone):
            self._read_done(msg.request_id)
        elif isinstance(msg, wire.SendKV):
            self._send_kv(eng, msg)
        elif isinstance(msg, wire.Finished):
            self._finish(msg.request_id, tokens=msg.tokens)
        elif isinstance(msg, wire.Failed):
            req = self.requests.get(msg.request_id)
            if req is not None and req.push_forwarded and eng.zmq_id == req.prefill and req.stage != "done":
                self._fail_request(req, msg.reason)  # a refused push: the decode's receives must be dropped too
            else:
                self._finish(msg.request_id, error=msg.reason)
        elif isinstance(msg, wire.Goodbye):
            self._remove(eng, f"{eng.reg.role} {eng.identity!r} left: {msg.reason or 'goodbye'}", confirmed=True)

    def _misfit(self, eng: _Engine, msg: wire.Msg) -> Optional[str]:
        """Why ``msg`` cannot come from ``eng`` in the current state (``None`` if it can).

        Schema checks say a message is well formed; these say it is this engine's to
        send: an insider must not release another reader's pins or forge a source.
        """
        role = eng.reg.role
        if isinstance(msg, (wire.HandoffReady, wire.TransferReady, wire.ReadDone, wire.SendKV, wire.Finished,
                            wire.Failed)):
            req = self.requests.get(msg.request_id)
            if req is None:
                return None  # a late message about a request already gone: harmless, ignored by the handlers
            if isinstance(msg, wire.HandoffReady):
                if role != "prefill" or req.prefill != eng.zmq_id:
                    return f"request {msg.request_id} was not sent to this engine for prefill"
                d = msg.descriptor
                if d.request_id != msg.request_id or d.source != eng.identity:
                    return (f"descriptor names request {d.request_id} from {d.source!r}; expected request "
                            f"{msg.request_id} from {eng.identity!r}")
                if d.meta_index >= len(eng.reg.transfer_meta):
                    return f"descriptor meta_index {d.meta_index} but {len(eng.reg.transfer_meta)} metas registered"
                tpb = policy.tokens_per_block(eng.reg.transfer_meta)
                if tpb and (len(d.block_ids) != -(-len(d.prompt) // tpb) or len(d.block_hashes) != len(d.prompt) // tpb):
                    return (f"descriptor has {len(d.block_ids)} blocks and {len(d.block_hashes)} hashes for a "
                            f"{len(d.prompt)}-token prompt at {tpb} tokens per block")
                if list(d.prompt) != req.prompt:
                    return "descriptor prompt differs from the submitted prompt"
            elif isinstance(msg, wire.Failed):
                if eng.zmq_id not in (req.prefill, req.decode):
                    return f"request {msg.request_id} is not on this engine"
            elif role != "decode" or req.decode != eng.zmq_id:
                return f"request {msg.request_id} was not routed to this engine for decode"
        elif isinstance(msg, (wire.Registered, wire.AddRequest, wire.PeerMeta, wire.StartDecode, wire.PushKV,
                              wire.Release,
                              wire.Abort, wire.Result, wire.Stats)):
            return "a coordinator-to-engine message sent to the coordinator"
        return None

    def _register(self, zmq_id: bytes, reg: wire.Register) -> None:
        existing = self.engines.get(zmq_id)
        if existing is not None and existing.alive:
            return self.send(zmq_id, wire.Registered(True))  # a retry of the same incarnation
        # A refused registration changes nothing: every check comes before any removal.
        problem = policy.fleet_refusal(member(reg), (member(e.reg) for e in self.engines.values() if e.alive))
        if problem is None:
            problem = self._identity_taken(reg)
        if problem is not None:
            log.warning("coordinator: refused the registration of %s %r (host %s, pid %d): %s", reg.role,
                        reg.identity, reg.host[:64], reg.pid, problem)
            return self.send(zmq_id, wire.Registered(False, problem))
        for other in list(self.engines.values()):   # the same identity, whose process is gone
            if other.alive and other.identity == reg.identity:
                self._remove(other, f"{other.reg.role} {other.identity!r} was replaced by a new incarnation "
                                    f"(its pid {other.reg.pid} exited)", confirmed=True)
        for dead in list(self.dead):  # a restart on another host is the only news we get of the old one
            if dead.identity == reg.identity and dead.reg.host != self.host:
                self._presume_dead(dead, "its identity registered again")
        self.engines[zmq_id] = _Engine(zmq_id, reg, time.monotonic())
        self.removed.pop(zmq_id, None)
        self.send(zmq_id, wire.Registered(True))
        self._dispatch()

    def _identity_taken(self, reg: wire.Register) -> Optional[str]:
        """Why ``reg`` may not take its identity now: a live engine holds it (``None`` if none does).

        A live engine's identity is never handed over on a newcomer's word: whoever holds the
        secret can claim any host, and taking over a live decode would release the pins of
        requests it may still be reading. A restart is let in once the old process is gone
        (its pid on this host), its connection closed, or its heartbeats stopped.
        """
        for other in self.engines.values():
            if other.alive and other.identity == reg.identity:
                if other.reg.host == self.host and process_gone(other.reg.pid):
                    continue
                return (f"{other.reg.role} {other.identity!r} is registered and alive (pid {other.reg.pid} on "
                        f"{other.reg.host}, heard {time.monotonic() - other.last_seen:.1f}s ago): stop it, or wait "
                        f"until the coordinator sees it gone (at most heartbeat_timeout_s="
                        f"{self.config.heartbeat_timeout_s}s), before registering that name again")
        return None

    def _submit(self, client: bytes, msg: wire.Submit) -> None:
        why = self._inadmissible(list(msg.prompt), msg.max_new_tokens)
        if why is not None:
            log.info("coordinator: refused request %s of %r at submit: %s", msg.client_request_id, client[:64], why)
            return self.send(client, wire.Result(msg.client_request_id, error=f"request refused at submit: {why}"))
        rid = next(self._ids)
        self.requests[rid] = _Request(rid, client, msg.client_request_id, list(msg.prompt), msg.max_new_tokens,
                                      time.monotonic())
        self.pending.append(rid)
        self._dispatch()

    def _inadmissible(self, prompt: list[int], max_new_tokens: int) -> Optional[str]:
        """Why the fleet refuses this request at submit (``policy.admission_problem``, over the live engines)."""
        return policy.admission_problem(prompt, max_new_tokens, (member(e.reg) for e in self.engines.values() if e.alive))

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

    def _send_kv(self, decode: _Engine, msg: wire.SendKV) -> None:
        """Push backends: the decode posted its receives; tell the prefill to push (Megatron's SEND_KV).

        The decode's meta must be the one it registered: an insider cannot point a push at
        another rank. A refused ask fails the request at once; the prefill was never told to
        push, so nothing reads its blocks and its pins are released too.
        """
        req = self.requests.get(msg.request_id)
        if req is None or req.stage == "done":
            return
        why = None
        if msg.decode_meta != list(decode.reg.transfer_meta):
            why = f"decode {decode.identity!r} asked for a push with a meta that is not its registered one"
        elif req.push_forwarded:
            why = f"decode {decode.identity!r} asked twice for the push of request {req.rid}"
        elif req.descriptor is None or msg.skip_blocks >= len(req.descriptor.block_ids):
            why = (f"decode {decode.identity!r} asked to skip {msg.skip_blocks} blocks of a "
                   f"{len(req.descriptor.block_ids) if req.descriptor else 0}-block request")
        prefill = self.engines.get(req.prefill) if req.prefill else None
        if why is None and (prefill is None or not prefill.alive):
            why = "its prefill is gone"
        if why is not None:
            self._refuse(decode, msg, why)
            self._fail_request(req, f"push refused: {why}")
            if not req.push_forwarded:
                self._read_done(req.rid)
            return
        req.push_forwarded = True
        assert prefill is not None
        self.send(prefill.zmq_id, wire.PushKV(req.rid, decode.identity, list(msg.decode_meta), msg.skip_blocks))

    # --- routing --------------------------------------------------------------------------
    def _alive(self, role: str) -> list[_Engine]:
        return [e for e in self.engines.values() if e.alive and e.reg.role == role]

    def _dispatch(self) -> None:
        """Route what waits: requests to prefills, prefilled requests to decodes (``policy`` decides)."""
        prefills = {e.identity: e for e in self._alive("prefill")}
        while self.pending and prefills:
            req = self.requests.get(self.pending.popleft())
            if req is None:
                continue
            target = prefills[policy.pick_prefill({name: len(e.requests) for name, e in prefills.items()})]  # type: ignore[index]
            req.stage, req.prefill = "prefill", target.zmq_id
            target.requests.add(req.rid)
            self.send(target.zmq_id, wire.AddRequest(req.rid, req.prompt, req.max_new_tokens))
        decodes = {e.identity: e for e in self._alive("decode")}
        if not (self.pending_handoff and decodes):
            return
        pulling: dict[bytes, int] = {}
        for r in self.requests.values():
            if r.stage == "handoff" and r.decode is not None:
                pulling[r.decode] = pulling.get(r.decode, 0) + 1
        while self.pending_handoff:
            req = self.requests.get(self.pending_handoff.popleft())
            if req is None or req.descriptor is None:
                continue
            prefill = self.engines.get(req.prefill) if req.prefill else None
            if prefill is None or not prefill.alive:
                continue
            candidates = [self.decode_candidate(e, req.descriptor.block_hashes, pulling.get(e.zmq_id, 0))
                          for e in decodes.values()]
            tokens = len(req.prompt) + req.max_new_tokens - 1
            choice = policy.pick_decode(candidates, tokens, prefix_aware=self.config.prefix_routing)
            if choice is None:
                self._fail_request(req, "request refused: " + (self._inadmissible(req.prompt, req.max_new_tokens)
                                                                or "no live decode pool can hold it"))
                continue
            target = decodes[choice.name]
            pulling[target.zmq_id] = pulling.get(target.zmq_id, 0) + 1
            self._send_to_decode(target, prefill, req, choice.reserves(tokens))

    @staticmethod
    def decode_candidate(eng: _Engine, block_hashes: Any, in_flight: int) -> policy.DecodeCandidate:
        """A live decode as ``policy.pick_decode`` sees it: its room (last heartbeat minus blocks routed
        there since), the prefix routed there before, its handoffs not yet pulled."""
        free = min(eng.reg.capacity_blocks,
                   (eng.hb.free_blocks if eng.hb else eng.reg.capacity_blocks) - eng.blocks_sent_since_hb)
        return policy.DecodeCandidate(eng.identity, eng.reg.capacity_blocks, policy.tokens_per_block(eng.reg.transfer_meta),
                                      free, eng.routed.expected_prefix(block_hashes), in_flight)

    def _send_to_decode(self, decode: _Engine, prefill: _Engine, req: _Request, reserves: int) -> None:
        key = (prefill.identity, prefill.reg.incarnation)
        if key not in decode.peers_sent:
            self.send(decode.zmq_id, wire.PeerMeta(prefill.identity, prefill.reg.incarnation,
                                                   prefill.reg.transfer_meta))
            decode.peers_sent.add(key)
        assert req.descriptor is not None
        req.decode = decode.zmq_id
        decode.requests.add(req.rid)
        decode.routed.add(req.descriptor.block_hashes)
        req.reserved_blocks = reserves            # what it will take from its free pool (policy's estimate)
        decode.blocks_sent_since_hb += reserves
        self.send(decode.zmq_id, wire.StartDecode(req.rid, req.descriptor, req.max_new_tokens))

    # --- endings ----------------------------------------------------------------------------
    def _finish(self, rid: int, *, tokens: Optional[list[int]] = None, error: Optional[str] = None) -> None:
        req = self.requests.get(rid)
        if req is None or req.stage == "done":
            return
        req.stage = "done"
        req.timings["total_s"] = time.monotonic() - req.submitted
        req.timings.pop("_handoff_t0", None)
        decode = self.engines.get(req.decode) if req.decode else None
        self.send(req.client, wire.Result(req.client_rid, tokens, error, dict(req.timings),
                                          req.cached_prefix_blocks, req.pulled_blocks,
                                          decode.identity if decode is not None and tokens is not None else None))
        for zmq_id in (req.prefill, req.decode):
            eng = self.engines.get(zmq_id) if zmq_id else None
            if eng is not None:
                eng.requests.discard(rid)
        if decode is not None and req.committed and tokens is not None:   # its decode freed what it held
            decode.blocks_sent_since_hb -= req.reserved_blocks
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
                if zmq_id == req.decode and req.source_pinned:
                    req.aborted_at = time.monotonic()   # a live reader must now settle and release it
        if req.source_pinned and req.decode is None:  # prefilled, never handed to a reader
            self._read_done(req.rid)
        self._finish(req.rid, error=error)

    def _remove(self, eng: _Engine, reason: str, *, confirmed: bool) -> None:
        """Take a dead engine out of routing and fail its requests; pins wait for confirmed death."""
        if not eng.alive:
            return
        eng.alive, eng.death, eng.removed_at = False, reason, time.monotonic()
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

    def _presume_dead(self, eng: _Engine, why: str = "") -> None:
        """Past the grace (or its identity registered again): free the pins a late read of which
        would fail its torn-read check.

        Requests read without generation counters keep their pins (a zombie could commit
        reused bytes); the reader stays in ``dead`` for them until death is confirmed.
        """
        freed = []
        for req in list(self.requests.values()):
            if req.decode == eng.zmq_id and req.source_pinned and req.descriptor is not None \
                    and req.descriptor.generations:
                freed.append(req.rid)
                self._read_done(req.rid)
        if freed:
            why = why or f"silent for {time.monotonic() - eng.removed_at:.1f}s past its removal " \
                         f"(pin_grace_s={self.config.pin_grace_s})"
            log.warning("coordinator: decode %r %s, presumed dead: freed the source pins of requests %s; a late read "
                        "of them fails its torn-read check", eng.identity, why, freed)

    def tick(self) -> None:
        now = time.monotonic()
        for eng in list(self.engines.values()):
            if not eng.alive:
                continue
            gone = eng.reg.host == self.host and process_gone(eng.reg.pid)
            if gone:
                self._remove(eng, f"{eng.reg.role} {eng.identity!r} (pid {eng.reg.pid}) exited", confirmed=True)
            elif now - eng.last_seen > self.config.heartbeat_timeout_s:
                self._remove(eng, f"{eng.reg.role} {eng.identity!r} sent no heartbeat for "
                                  f"{now - eng.last_seen:.1f}s (limit {self.config.heartbeat_timeout_s}s)",
                             confirmed=False)
        grace = self.config.pin_grace_s
        for eng in list(self.dead):
            if eng.reg.host == self.host and process_gone(eng.reg.pid):
                self._confirm_death(eng, "its process exited")
            elif grace is not None and now - eng.removed_at > grace:
                self._presume_dead(eng)
        for req in list(self.requests.values()):
            if req.stage != "done" and now - req.submitted > self.config.request_timeout_s:
                self._fail_request(req, f"request timed out after {self.config.request_timeout_s}s "
                                        f"(stage: {req.stage})")
        stuck_grace = self.config.stuck_reader_grace_s
        if stuck_grace is not None:
            for req in list(self.requests.values()):
                if req.source_pinned and req.aborted_at and not req.stuck and now - req.aborted_at > stuck_grace:
                    self._stuck_reader(req, now - req.aborted_at)

    def _stuck_reader(self, req: _Request, waited_s: float) -> None:
        """A live decode told to drop a request has not released its source: bound what that costs.

        Its pins are freed when its reads are torn-read checked (a read that lands later fails
        its check and is never committed, as for a reader presumed dead); otherwise they stay
        until the reader reports or dies, counted in ``Stats.stuck_requests``.
        """
        req.stuck = True
        eng = self.engines.get(req.decode) if req.decode else None
        who = f"decode {eng.identity!r}" if eng is not None else "its decode"
        if req.descriptor is not None and req.descriptor.generations:
            log.warning("coordinator: %s has not released request %s %.1fs after it was aborted (stuck reader): "
                        "its source pins are freed; a late read of them fails its torn-read check", who, req.rid,
                        waited_s)
            self._read_done(req.rid)
        else:
            log.error("coordinator: %s has not released request %s %.1fs after it was aborted (stuck reader); it "
                      "is read without generation counters, so its source pins stay until %s reports or dies",
                      who, req.rid, waited_s, who)

    def stats(self) -> wire.Stats:
        engines: dict[str, dict[str, Any]] = {}
        for eng in self.engines.values():
            if eng.identity in engines and not eng.alive:
                continue  # the live incarnation wins
            engines[eng.identity] = {
                "role": eng.reg.role, "alive": eng.alive, "pid": eng.reg.pid, "incarnation": eng.reg.incarnation,
                "death": eng.death, "requests": len(eng.requests),
                **({k: getattr(eng.hb, k) for k in eng.hb.__struct_fields__ if k != "evicted"} if eng.hb else {}),
            }
        live = sum(1 for r in self.requests.values() if r.stage != "done")
        stuck = sum(1 for r in self.requests.values() if r.stuck and r.source_pinned)
        return wire.Stats(engines, live, self.channel.dropped_total, dict(self.channel.dropped),
                          self.channel.connections, self.channel.tcp_connections, stuck, self.channel.sessions)


# --- running it as a process ------------------------------------------------------------
def start_coordinator_process(config: CoordinatorConfig = CoordinatorConfig(), *,
                              start_timeout_s: float = 30.0) -> tuple[Any, str]:
    """Start a coordinator process; returns ``(process, address)`` once it is bound."""
    from engine_integration import procs

    # the same check the child makes, here, so a missing secret is a clear error and not a dead child
    resolve_secret(config.secret, secret_file=config.secret_file, insecure=config.insecure, who="the coordinator")
    proc, ready = procs.spawn("engine_integration.control_plane.zmq.coordinator", asdict(config), start_timeout_s=start_timeout_s)
    return proc, ready["address"]


def stop_coordinator_process(proc: Any, timeout_s: float = 10.0) -> None:
    from engine_integration import procs

    procs.stop(proc, timeout_s, terminate_first=True)  # SIGTERM is its orderly stop


def main(argv: Optional[list[str]] = None) -> None:
    import sys

    from engine_integration import procs

    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = CoordinatorConfig(**procs.read_payload(int(args[0])))
    coord = Coordinator(config)
    procs.report({"address": coord.address, "pid": os.getpid()}, int(args[1]))
    coord.serve()


if __name__ == "__main__":
    main()
