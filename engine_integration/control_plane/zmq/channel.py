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

log = logging.getLogger("kvxfer.engine.channel")

MAX_FRAME_BYTES = 16 << 20
MAX_CONNECTIONS = 512
HANDSHAKE_TIMEOUT_S = 5.0
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
    """The coordinator's ROUTER socket: one session per peer, every refusal counted."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, secret: Optional[bytes], *,
                 max_frame_bytes: int = MAX_FRAME_BYTES, max_connections: int = MAX_CONNECTIONS,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, curve: bool = True) -> None:
        self.max_connections = max_connections
        self.dropped: dict[str, int] = {}
        self._sessions: dict[bytes, SessionChannel] = {}
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
                self._sessions[peer] = session  # a new hello from a peer replaces its old session
                try:
                    self._session_fds.add(int(frame.get(zmq.SRCFD)))
                except (zmq.ZMQError, AttributeError, TypeError, ValueError):
                    pass   # no fd information: the connection is counted among the admitted for a while
                else:
                    if self._admitted:
                        self._admitted.popleft()
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
        self._sessions.pop(peer, None)

    # --- connection events and the cap -----------------------------------------------------
    def events(self) -> list[int]:
        """Handle monitor and ZAP traffic; returns the fds of connections that closed."""
        from zmq.utils.monitor import recv_monitor_message

        closed = []
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._open.add(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._open.discard(fd)
                self._session_fds.discard(fd)
                closed.append(fd)
            else:
                _count(self.dropped, "handshake failed")
        self._serve_zap()  # after the accepts above, so the count includes the connection asking
        return closed

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
