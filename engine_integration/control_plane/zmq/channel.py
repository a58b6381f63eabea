"""Control connections over ZeroMQ: encrypted, replay-proof, bounded.

Three layers, each against a finding of the security review:

- **CURVE** (when libzmq has it): the coordinator's key pair is derived from the
  cluster secret, so only secret holders can complete a handshake, and every byte on
  the wire (rkeys, buffer addresses in ``PeerMeta``) is encrypted with per-connection
  ephemeral keys. Raw bytes captured on the wire are useless on a fresh connection.
- **Sessions** (``kvxfer.security.auth``): a handshake per connection derives a session
  key; every frame carries a direction and a counter under its tag. A replayed,
  reordered or reflected frame is dropped and counted by reason. This holds with or
  without CURVE, so the protocol does not rest on one mechanism.
- **Limits**: ``ZMQ_MAXMSGSIZE`` makes libzmq drop a connection announcing a frame
  larger than ``max_frame_bytes`` before buffering or hashing any of it; a ZAP handler
  (served from the coordinator's own loop, no thread) refuses a handshake once
  ``max_connections`` *authenticated* connections are open (through our session
  handshake, or admitted within the last ``handshake_timeout_s``), with a log line; a
  connection that has not finished its handshake within ``handshake_timeout_s`` is
  closed by libzmq. Idle unauthenticated TCP connections count against nothing but their
  file descriptor, for ``handshake_timeout_s`` at most: 600 of them used to fill the cap
  (then counted over every TCP connection) and lock real clients out (issue 21, A8).
- **Sessions go with their connection**: a session is bound to the TCP connection its
  peer last spoke on (``ZMQ_SRCFD``). When that connection closes, the session is kept
  ``session_grace_s`` for a reconnect (a DEALER reconnects under the same routing id) and
  then freed; the table never holds more than ``max_sessions`` (the oldest orphan goes
  first, else the session heard from least recently). Without this every client identity ever seen kept its session for good (issue 26).

Without a secret nothing runs unless ``insecure=True`` is asked for by name, and that
is logged at WARNING on every socket it builds.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Optional, Union

import zmq

from engine_integration.control_plane.zmq import wire
from kvxfer.errors import AuthenticationError, KVXferError
from kvxfer.security.auth import (FrameDropped, SessionChannel, SessionClient, SessionServer, curve_server_keys,
                                  load_secret)

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 16 << 20
MAX_CONNECTIONS = 512
HANDSHAKE_TIMEOUT_S = 5.0
SESSION_GRACE_S = 10.0  #: a session whose connection closed waits this long for its peer to reconnect
LISTEN_BACKLOG = 4096  #: pending TCP connections the kernel may queue for us (a flood must not delay clients)
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_DOMAIN = b"kvxfer"


class InsecureNotRequested(KVXferError):
    """No control-plane secret was configured and ``insecure=True`` was not asked for."""


def resolve_secret(secret: Union[str, bytes, None] = None, *, secret_file: Optional[str] = None,
                   insecure: bool = False, who: str = "this control endpoint") -> Optional[bytes]:
    """The cluster secret (value, file, or ``$KVXFER_SECRET_FILE``), or ``None`` only when insecure by name."""
    if secret is not None or secret_file is not None or os.environ.get("KVXFER_SECRET_FILE"):
        return load_secret(secret, secret_file=secret_file)
    if insecure:
        log.warning("%s runs WITHOUT authentication or encryption (insecure=True): anyone who can reach "
                    "it can submit, read peer memory keys and shut it down", who)
        return None
    raise InsecureNotRequested(
        f"{who}: no control-plane secret. Pass secret= or secret_file=, or point $KVXFER_SECRET_FILE at a "
        "0600 file; to run unauthenticated anyway, ask for insecure=True by name")


def curve_available() -> bool:
    return bool(zmq.has("curve"))


def _count(counter: dict[str, int], reason: str) -> None:
    counter[reason] = counter.get(reason, 0) + 1


class ServerChannel:
    """The coordinator's ROUTER socket: one session per connected peer, every refusal counted.

    ``events()`` reports the peers whose connection closed (each bound to the connection it
    last spoke on), so the owner never has to map file descriptors itself: a descriptor number
    is reused by the next connection, and only this class sees the order of the two.
    """

    def __init__(self, ctx: zmq.Context, host: str, port: int, secret: Optional[bytes], *,
                 max_frame_bytes: int = MAX_FRAME_BYTES, max_connections: int = MAX_CONNECTIONS,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, curve: bool = True,
                 session_grace_s: float = SESSION_GRACE_S, max_sessions: Optional[int] = None) -> None:
        self.max_connections = max_connections
        self.max_sessions = max_sessions if max_sessions is not None else 2 * max_connections
        self.session_grace_s = session_grace_s
        self.dropped: dict[str, int] = {}
        self._sessions: dict[bytes, SessionChannel] = {}
        self._peer_fd: dict[bytes, int] = {}      # peer -> the connection (fd) it last spoke on
        self._fd_peer: dict[int, bytes] = {}
        self._orphaned: dict[bytes, float] = {}   # sessions whose connection closed -> when (oldest first)
        self._closed_peers: list[bytes] = []      # for the next events()
        self._at_session_cap_logged = 0.0
        self._server = SessionServer(secret) if secret is not None else None
        self._open: set[int] = set()           # fds of the TCP connections open now
        self._session_fds: set[int] = set()    # of those, the ones through our session handshake (the cap counts them)
        self._admitted: deque[float] = deque()  # ZAP admissions not yet through the session handshake
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(_ZAP_ENDPOINT)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(handshake_timeout_s * 1000))
        sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
        # libzmq's default listen backlog is 100: under a connection flood the kernel's accept
        # queue fills, a client's final ACK is dropped and the connection only arrives after
        # SYN-ACK retries (seconds). The kernel caps this at net.core.somaxconn.
        sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
        self.encrypted = secret is not None and curve and curve_available()
        if self.encrypted:
            public, secret_key = curve_server_keys(secret)
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = public, secret_key
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        self.port = port
        self.sock = sock
        self.handshake_timeout_s = handshake_timeout_s
        self.monitor = sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self._at_cap_logged = 0.0

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def connections(self) -> int:
        """Authenticated control connections open now (through the session handshake; what the cap counts)."""
        return len(self._session_fds)

    @property
    def sessions(self) -> int:
        """Sessions held now: one per connected peer, plus those waiting ``session_grace_s`` for a reconnect."""
        return len(self._sessions)

    @property
    def tcp_connections(self) -> int:
        """Every TCP connection open now, handshakes in progress included."""
        return len(self._open)

    def sockets(self) -> list[zmq.Socket]:
        """What the owner's poller must watch (the ROUTER, the monitor, the ZAP handler)."""
        return [self.sock, self.monitor, self._zap]

    # --- receiving ----------------------------------------------------------------------
    def receive(self) -> Optional[tuple[bytes, wire.Msg, zmq.Frame]]:
        """One ready frame: ``(peer, message, raw frame)``, or ``None`` if it was a handshake or dropped."""
        frames = self.sock.recv_multipart(copy=False)
        if len(frames) != 2:
            _count(self.dropped, "malformed")
            return None
        peer, frame = frames[0].bytes, frames[1]
        payload = frame.bytes
        if self._server is not None:
            if SessionServer.is_hello(payload):
                try:
                    welcome, session = self._server.accept(peer, payload)
                except FrameDropped as exc:
                    _count(self.dropped, exc.reason)
                    return None
                self._sessions.pop(peer, None)  # a new hello from a peer replaces its old session
                self._sessions[peer] = session
                fd = self._bind(peer, frame)
                if fd is not None:
                    self._session_fds.add(fd)
                    if self._admitted:
                        self._admitted.popleft()
                # else no fd information: the connection is counted among the admitted for a while
                self._cap_sessions(keep=peer)
                self._send_raw(peer, welcome)
                return None
            session = self._sessions.get(peer)
            if session is None:
                _count(self.dropped, "no session")
                return None
            try:
                payload = session.open(payload)
            except FrameDropped as exc:
                _count(self.dropped, exc.reason)
                return None
            self._sessions[peer] = self._sessions.pop(peer)  # most recently heard last: the cap drops the oldest
        self._bind(peer, frame)  # authentic (or insecure): this is the peer's connection now
        try:
            msg = wire.decode(payload)
        except wire.WireError as exc:
            _count(self.dropped, "invalid")
            log.warning("refused a control message from %r: %s", peer[:64], exc)
            return None
        return peer, msg, frame

    def count(self, reason: str) -> None:
        """Count a refusal decided above this layer (e.g. a message inconsistent with the peer's state)."""
        _count(self.dropped, reason)

    # --- sending ------------------------------------------------------------------------
    def send(self, peer: bytes, msg: wire.Msg) -> None:
        payload = wire.encode(msg)
        if self._server is not None:
            session = self._sessions.get(peer)
            if session is None:
                return  # nobody we can talk to: an unauthenticated peer gets no answer at all
            payload = session.seal(payload)
        self._send_raw(peer, payload)

    def _send_raw(self, peer: bytes, payload: bytes) -> None:
        try:
            self.sock.send_multipart([peer, payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # a peer that is gone; heartbeats and pid checks will remove it

    def forget(self, peer: bytes) -> None:
        """Drop ``peer``'s session now (it must handshake again to be heard)."""
        self._sessions.pop(peer, None)
        self._orphaned.pop(peer, None)

    # --- which connection a peer speaks on --------------------------------------------------
    def _bind(self, peer: bytes, frame: zmq.Frame) -> Optional[int]:
        """Note the connection ``frame`` came on as ``peer``'s; its fd, or ``None`` without fd information.

        On a change, connection events are read first: the fd may be a reused number whose
        previous connection's close is still queued on the monitor, and reading it later would
        count the close against this peer.
        """
        try:
            fd = int(frame.get(zmq.SRCFD))
        except (zmq.ZMQError, AttributeError, TypeError, ValueError):
            return None
        if self._peer_fd.get(peer) == fd:
            return fd
        self._read_monitor()
        before = self._peer_fd.get(peer)
        if before is not None and self._fd_peer.get(before) == peer:
            del self._fd_peer[before]
        earlier = self._fd_peer.get(fd)
        if earlier is not None and earlier != peer:  # its close was never reported: it is gone all the same
            self._connection_closed(earlier)
        self._peer_fd[peer], self._fd_peer[fd] = fd, peer
        self._orphaned.pop(peer, None)  # reconnected in time: the session lives on
        return fd

    def _connection_closed(self, peer: bytes) -> None:
        self._peer_fd.pop(peer, None)
        self._closed_peers.append(peer)
        if peer in self._sessions:
            self._orphaned.pop(peer, None)
            self._orphaned[peer] = time.monotonic()

    def _expire_sessions(self, now: float) -> None:
        """Free the sessions whose connection closed more than ``session_grace_s`` ago."""
        while self._orphaned:
            peer, since = next(iter(self._orphaned.items()))
            if now - since <= self.session_grace_s:
                break
            del self._orphaned[peer]
            self._sessions.pop(peer, None)

    def _cap_sessions(self, keep: bytes) -> None:
        """At most ``max_sessions``: the oldest orphaned session goes first, else the one heard from least recently."""
        while len(self._sessions) > self.max_sessions:
            if self._orphaned:
                victim = next(iter(self._orphaned))
                del self._orphaned[victim]
            else:
                victim = next(p for p in self._sessions if p != keep)
                now = time.monotonic()
                if now - self._at_session_cap_logged > 5.0:
                    self._at_session_cap_logged = now
                    log.warning("control session table full (max_sessions=%d, all connected): the session heard from "
                                "least recently (%r) is dropped; its peer must handshake again", self.max_sessions,
                                victim[:64])
            self._sessions.pop(victim, None)
            fd = self._peer_fd.pop(victim, None)
            if fd is not None and self._fd_peer.get(fd) == victim:
                del self._fd_peer[fd]

    # --- connection events and the cap -----------------------------------------------------
    def events(self) -> list[bytes]:
        """Handle monitor and ZAP traffic, free expired sessions; returns the peers whose connection closed."""
        self._read_monitor()
        self._serve_zap()  # after the accepts above, so the count includes the connection asking
        self._expire_sessions(time.monotonic())
        closed, self._closed_peers = self._closed_peers, []
        return closed

    def _read_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._open.add(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._open.discard(fd)
                self._session_fds.discard(fd)
                peer = self._fd_peer.pop(fd, None)
                if peer is not None and self._peer_fd.get(peer) == fd:
                    self._connection_closed(peer)
            else:
                _count(self.dropped, "handshake failed")

    def _serve_zap(self) -> None:
        """Admit a connection at its handshake unless ``max_connections`` authenticated ones are open.

        ZAP is asked once per connection, during its handshake (with CURVE: after the peer
        proved it holds the cluster key); the count is of connections through our session
        handshake (known by their fd, ``ZMQ_SRCFD``) plus those admitted in the last
        ``handshake_timeout_s`` that have not got there yet, so a flood of idle TCP
        connections, which never get that far, cannot lock real clients out. Such a connection holds one file descriptor for
        ``handshake_timeout_s`` at most (libzmq closes it); the soft descriptor limit is
        raised to the hard one (``coordinator._raise_fd_limit``).
        """
        while self._zap.poll(0):
            request = self._zap.recv_multipart()
            if len(request) < 6:
                continue
            version, request_id = request[0], request[1]
            now = time.monotonic()
            while self._admitted and now - self._admitted[0] > self.handshake_timeout_s:
                self._admitted.popleft()
            if len(self._session_fds) + len(self._admitted) >= self.max_connections:
                _count(self.dropped, "connection cap")
                if now - self._at_cap_logged > 5.0:
                    self._at_cap_logged = now
                    log.error("control connection cap reached (%d authenticated connections open, "
                              "max_connections=%d): refusing new connections from %s until some close",
                              len(self._session_fds) + len(self._admitted), self.max_connections,
                              request[3].decode(errors="replace"))
                self._zap.send_multipart([version, request_id, b"400", b"connection cap reached", b"", b""])
            else:
                self._admitted.append(now)
                self._zap.send_multipart([version, request_id, b"200", b"OK", b"", b""])

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self._zap.close(linger=0)
        self.sock.close(linger=100)


class ClientChannel:
    """A DEALER connected to the coordinator, with its session; used by engines and clients."""

    def __init__(self, address: str, secret: Optional[bytes], *, identity: Optional[bytes] = None,
                 handshake_timeout_s: float = 10.0, max_frame_bytes: int = MAX_FRAME_BYTES,
                 curve: bool = True, context: Optional[zmq.Context] = None) -> None:
        self.address = address
        self.identity = identity or b"client/" + os.urandom(8).hex().encode()
        self.dropped: dict[str, int] = {}
        self.session: Optional[SessionChannel] = None
        sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        sock.setsockopt(zmq.IDENTITY, self.identity)  # fixed: zmq reconnects keep the session
        if secret is not None and curve and curve_available():
            sock.curve_serverkey = curve_server_keys(secret)[0]
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.connect(address)
        self.sock = sock
        if secret is not None:
            try:
                self._handshake(SessionClient(secret, self.identity), handshake_timeout_s)
            except BaseException:
                sock.close(linger=0)
                raise

    def _handshake(self, client: SessionClient, timeout_s: float) -> None:
        self.sock.send(client.hello())
        if not self.sock.poll(int(timeout_s * 1000)):
            raise AuthenticationError(
                f"no handshake answer from the coordinator at {self.address} within {timeout_s}s "
                "(not running, at its connection cap, or holding a different cluster secret: a CURVE "
                "handshake with the wrong key never completes)")
        self.session = client.finish(self.sock.recv())

    def send(self, msg: wire.Msg) -> None:
        payload = wire.encode(msg)
        self.sock.send(self.session.seal(payload) if self.session is not None else payload)

    def send_frame(self, frame: bytes) -> None:
        """Send raw bytes (tests replay captured frames with this)."""
        self.sock.send(frame)

    def receive(self) -> Optional[wire.Msg]:
        """The next message (a frame must be ready), or ``None`` if it was refused (and counted)."""
        payload = self.sock.recv()
        if self.session is not None:
            try:
                payload = self.session.open(payload)
            except FrameDropped as exc:
                _count(self.dropped, exc.reason)
                return None
        try:
            return wire.decode(payload)
        except wire.WireError as exc:
            _count(self.dropped, "invalid")
            log.warning("refused a control message from the coordinator: %s", exc)
            return None

    def recv(self, timeout_s: float) -> Optional[wire.Msg]:
        """The next valid message within ``timeout_s``, else ``None``."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if not self.sock.poll(max(0, int(left * 1000))):
                return None
            msg = self.receive()
            if msg is not None:
                return msg
            if time.monotonic() >= deadline:
                return None

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger=linger_ms)
