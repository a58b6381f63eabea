"""A producer's handshake listener on ``kv_ip:kv_port``, and the decode's fetches from it.

The decode needs each prefill rank's ``export_meta()`` (its registered KV pool and lease
table, with transport keys) once per producer instance, not per request: a meta is a few KB
and would bloat every ``kv_transfer_params`` that a proxy carries. So, like NixlConnector's
side channel, the producer's scheduler serves one sealed handshake document and decodes
cache it (``handshake_cache``). The scheduler binds the port and runs the listener in a process
of its own (``handshake_server``), where vLLM's engine holding its GIL cannot delay an answer.

The wire is plain TCP, one question per connection: the decode sends ``REQUEST``, the
producer answers with an 8-byte big-endian length and the JSON document (or
``{"error": ...}``) and closes. Plain sockets, not ZeroMQ, because the listener is reachable
by whoever can reach the port and must stay bounded against them, which needs what ZeroMQ
hides: which connections are open (capped at ``MAX_CONNECTIONS``, the oldest dropped), how
long each may stay (``CONNECTION_S``), and what is queued for a peer that does not read (at
most one document per connection, a view of the one shared ``bytes``: nothing is copied per
peer). Bytes that are not ``REQUEST`` close the connection with one log line (and at most
one line per ``_JUNK_LOG_S`` for a flood), never a traceback.

The decode side (``HandshakeFetcher``) multiplexes every fetch on one thread with its own
deadline, so a producer that never answers (a closed port, a black-holed address, a stalled
process) delays no fetch but its own.

The document is sealed (and with a cluster secret signed) by ``kvxfer.meta.seal``;
without a secret it also carries the instance's ticket key, so the listener answers only
peers on its own host then (loopback), matching kvxfer's rule that unsigned metas are
same-host only.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from kvxfer.errors import PeerMetadataError

logger = logging.getLogger(__name__)

MAX_HANDSHAKE_BYTES = 16 << 20
REQUEST = b"KVXFER-VLLM-HANDSHAKE/2\n"
#: Connections the listener keeps open at once; beyond it the oldest is closed.
MAX_CONNECTIONS = 128
#: A connection is closed this long after it was accepted, answered or not.
CONNECTION_S = 5.0
#: Fetches a decode runs at once (one per producer address, see ``handshake_cache``).
MAX_FETCHES = 32
#: New connections one fetch may make after the listener closed one before answering (within its deadline).
MAX_RECONNECTS = 3
_LENGTH = struct.Struct(">Q")
_JUNK_LOG_S = 10.0


def _frame(document: bytes) -> bytes:
    return _LENGTH.pack(len(document)) + document


@dataclass
class _Conn:
    sock: socket.socket
    peer: str
    since: float
    asked: bytes = b""
    reply: Optional[memoryview] = None


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: a free one), or ``OSError`` saying what to change.
    Bound by whoever needs the port at once (the scheduler, for its tickets), served by a ``HandshakeListener``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"KvxferConnector cannot listen on {host}:{port} ({exc}); another vLLM instance on this host may "
            "use it: give each producer its own kv_port (KVTransferConfig.kv_port, or 0 for a free port) "
            "or kv_connector_extra_config 'kv_ip'"
        ) from None
    sock.listen(128)
    return sock


class HandshakeListener:
    """TCP listener on a background thread, answering ``REQUEST`` with ``document()`` (bounded, see the module).

    The connector runs it in a process of its own (``handshake_server``), never in vLLM's: a thread there
    answers only when vLLM's engine lets go of the GIL. ``sock``: a socket ``bind_listener`` made (the
    serving process gets the scheduler's); without it, ``host:port`` is bound here."""

    def __init__(self, host: str, port: int, document: Callable[[], bytes], *, local_peers_only: bool,
                 max_connections: int = MAX_CONNECTIONS, connection_s: float = CONNECTION_S,
                 sock: Optional[socket.socket] = None) -> None:
        self._document = document
        self._framed: tuple[Optional[bytes], bytes] = (None, b"")  # (document, its frame): framed once
        self._local_only = local_peers_only
        self._max_connections = max_connections
        self._connection_s = connection_s
        self._sock = sock if sock is not None else bind_listener(host, port)
        self._sock.setblocking(False)
        self.host, self.port = self._sock.getsockname()[:2]
        self.served = 0
        self.refused = 0
        self.junk = 0
        self.dropped = 0  # connections closed because too many were open
        self._junk_logged_at = -_JUNK_LOG_S
        self._junk_unlogged = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvxfer-vllm-handshake", daemon=True)
        self._thread.start()

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def counters(self) -> dict[str, int]:
        """What it did so far: requests ``served``, non-local peers ``refused``, ``junk`` senders, connections
        ``dropped`` at the cap, and the ``open`` ones."""
        return {"served": self.served, "refused": self.refused, "junk": self.junk, "dropped": self.dropped,
                "open": len(self._conns)}

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if self._serve_once():
                    return
            except Exception:  # a peer's surprise must not end the listener (every decode would then wait)
                logger.exception("kvxfer vllm: handshake listener: unexpected error; going on")
                time.sleep(0.01)

    def _serve_once(self) -> bool:
        """One round of select; True when woken to stop."""
        timeout = None
        if self._conns:
            oldest = min(c.since for c in self._conns.values())
            timeout = max(0.0, oldest + self._connection_s - time.monotonic())
        for key, events in self._selector.select(timeout):
            if key.fileobj is self._sock:
                self._accept()
            elif key.fileobj is self._wake_r:
                return True
            else:
                conn = self._conns.get(key.fileobj)
                if conn is not None:
                    try:
                        self._on_ready(conn, events)
                    except OSError:
                        self._close(conn)
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if now - c.since > self._connection_s]:
            self._close(conn)
        return False

    def _accept(self) -> None:
        for _ in range(64):  # a burst of peers, without starving the open connections
            try:
                sock, address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds, say: the peers wait in the backlog
                logger.warning("kvxfer vllm: handshake listener cannot accept: %s", exc)
                return
            sock.setblocking(False)
            if len(self._conns) >= self._max_connections:
                self.dropped += 1
                self._close(min(self._conns.values(), key=lambda c: c.since))
            conn = self._conns[sock] = _Conn(sock, str(address[0]), time.monotonic())
            self._selector.register(sock, selectors.EVENT_READ)
            if self._local_only and not _is_loopback(conn.peer):
                self.refused += 1
                try:
                    self._reply(conn, json.dumps({"error": f"peer {conn.peer} is not on this host: without "
                                                           "KVXFER_SECRET_FILE this producer serves its metas to "
                                                           "same-host decodes only; configure the cluster secret "
                                                           "on both sides"}).encode())
                except OSError:  # it reset the connection already
                    self._close(conn)

    def _on_ready(self, conn: _Conn, events: int) -> None:
        if conn.reply is not None:
            if events & selectors.EVENT_WRITE:
                self._send(conn)
            return
        chunk = conn.sock.recv(len(REQUEST) - len(conn.asked))
        if not chunk:
            return self._close(conn)
        conn.asked += chunk
        if not REQUEST.startswith(conn.asked):
            return self._junk(conn)
        if conn.asked == REQUEST:
            self.served += 1
            self._reply(conn, None)

    def _reply(self, conn: _Conn, error: Optional[bytes]) -> None:
        if error is not None:
            frame = _frame(error)
        else:
            document = self._document()
            if self._framed[0] is not document:
                self._framed = (document, _frame(document))
            frame = self._framed[1]
        conn.reply = memoryview(frame)  # a view: a peer that never reads costs no copy
        self._selector.modify(conn.sock, selectors.EVENT_WRITE)
        self._send(conn)

    def _send(self, conn: _Conn) -> None:
        assert conn.reply is not None
        try:
            sent = conn.sock.send(conn.reply)
        except (BlockingIOError, InterruptedError):
            return
        conn.reply = conn.reply[sent:]
        if not conn.reply:
            self._close(conn)

    def _junk(self, conn: _Conn) -> None:
        """One line, rate-limited: a scanner or an old client is the peer's problem, not a traceback."""
        self.junk += 1
        now = time.monotonic()
        if now - self._junk_logged_at >= _JUNK_LOG_S:
            more = f" (and {self._junk_unlogged} more since the last such line)" if self._junk_unlogged else ""
            logger.warning("kvxfer vllm: handshake listener: peer %s sent %r, not a KvxferConnector handshake request "
                           "(another program, or a decode of another kvxfer version); connection closed%s", conn.peer,
                           conn.asked[:16], more)
            self._junk_logged_at, self._junk_unlogged = now, 0
        else:
            self._junk_unlogged += 1
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def close(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=2.0)
        for conn in list(self._conns.values()):
            self._close(conn)
        self._selector.close()
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


def _decode(raw: bytes, where: str) -> dict[str, Any]:
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        raise PeerMetadataError(f"the prefill instance at {where} answered with a malformed handshake") from None
    if not isinstance(document, dict):
        raise PeerMetadataError(f"the prefill instance at {where} answered with a malformed handshake")
    if "error" in document:
        raise PeerMetadataError(f"the prefill instance at {where} refused the handshake: {document['error']!s:.300}")
    return document


@dataclass
class _Fetch:
    host: str
    port: int
    deadline: float
    timeout_s: float
    done: Callable[[Optional[dict], Optional[BaseException]], None]
    address: str = ""
    sock: Optional[socket.socket] = None
    sent: int = 0
    received: bytearray = field(default_factory=bytearray)
    reconnects: int = 0

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"


class HandshakeFetcher:
    """Every handshake fetch of one decode worker, multiplexed on one thread (see the module).

    ``fetch`` never blocks; ``done(document, None)`` or ``done(None, error)`` is called on the
    fetcher's thread within ``timeout_s`` (names that are not addresses are resolved on two
    helper threads first). At most ``MAX_FETCHES`` run at once; more is refused at once.
    """

    def __init__(self, max_fetches: int = MAX_FETCHES) -> None:
        self._max = max_fetches
        self._incoming: deque[_Fetch] = deque()
        self._active: dict[socket.socket, _Fetch] = {}
        self._count = 0
        self._lock = threading.Lock()
        self._resolver = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvxfer-vllm-resolve")
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvxfer-vllm-handshake-fetch", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return self._count

    def fetch(self, host: str, port: int, timeout_s: float,
              done: Callable[[Optional[dict], Optional[BaseException]], None]) -> None:
        with self._lock:
            if self._count >= self._max:
                raise PeerMetadataError(f"handshakes with {self._max} prefill addresses are already pending; "
                                        f"{host}:{port} is not asked (too many unreachable producers named at once)")
            self._count += 1
        job = _Fetch(host, port, time.monotonic() + timeout_s, timeout_s, done)
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            self._resolver.submit(self._resolve, job)
            return
        self._enqueue(job, host.strip("[]"))

    def _resolve(self, job: _Fetch) -> None:
        try:
            address = socket.getaddrinfo(job.host, job.port, type=socket.SOCK_STREAM)[0][4][0]
        except Exception as exc:  # OSError, and UnicodeError for a name like "a..b": never a fetch left pending
            return self._finish(job, None, PeerMetadataError(f"cannot resolve prefill host {job.host!r}: {exc}"))
        self._enqueue(job, address)

    def _enqueue(self, job: _Fetch, address: str) -> None:
        job.address = address
        self._incoming.append(job)
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _run(self) -> None:
        while not self._closed:
            deadlines = [job.deadline for job in self._active.values()]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            for key, events in self._selector.select(timeout):
                if key.fileobj is self._wake_r:
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                    continue
                job = self._active.get(key.fileobj)
                if job is not None:
                    self._guarded(job, self._progress, job, events)
            while self._incoming:
                job = self._incoming.popleft()
                self._guarded(job, self._start, job)
            now = time.monotonic()
            for job in [j for j in self._active.values() if now >= j.deadline]:
                self._finish(job, None, PeerMetadataError(
                    f"no handshake from the prefill instance at {job.where} within {job.timeout_s}s (dead, "
                    "unreachable, or not a KvxferConnector producer)"))

    def _guarded(self, job: _Fetch, step: Callable[..., None], *args: Any) -> None:
        """Run one fetch's step; a surprise fails that fetch only, never the thread every fetch shares."""
        try:
            step(*args)
        except Exception as exc:
            logger.exception("kvxfer vllm: handshake fetch from %s: unexpected error", job.where)
            try:
                self._finish(job, None, PeerMetadataError(f"handshake with the prefill instance at {job.where} "
                                                          f"failed: {type(exc).__name__}: {exc}"))
            except Exception:
                logger.exception("kvxfer vllm: handshake fetch from %s: could not be failed", job.where)

    def _start(self, job: _Fetch) -> None:
        address = job.address
        try:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            job.sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            job.sock.setblocking(False)
            job.sock.connect_ex((address, job.port))
            self._active[job.sock] = job
            self._selector.register(job.sock, selectors.EVENT_WRITE)
        except OSError as exc:
            self._finish(job, None, PeerMetadataError(f"handshake with the prefill instance at {job.where} "
                                                      f"failed: {exc}"))

    def _progress(self, job: _Fetch, events: int) -> None:
        assert job.sock is not None
        try:
            if job.sent < len(REQUEST):
                error = job.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    raise OSError(error, f"connect: {os.strerror(error)}")
                job.sent += job.sock.send(REQUEST[job.sent:])
                if job.sent == len(REQUEST):
                    self._selector.modify(job.sock, selectors.EVENT_READ)
                return
            chunk = job.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno in (errno.ECONNRESET, errno.EPIPE) and not job.received:  # closed before answering
                if self._may_reconnect(job):
                    return self._reconnect(job)
                return self._finish(job, None, PeerMetadataError(
                    f"the prefill instance at {job.where} closed the connection before its handshake was complete "
                    f"({exc.strerror or exc}; asked {job.reconnects + 1} times)"))
            return self._finish(job, None, PeerMetadataError(f"handshake with the prefill instance at {job.where} "
                                                             f"failed: {exc.strerror or exc}"))
        job.received += chunk
        if len(job.received) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(job.received)
            if length > MAX_HANDSHAKE_BYTES:
                return self._finish(job, None, PeerMetadataError(
                    f"the prefill instance at {job.where} announced a {length}-byte handshake (limit "
                    f"{MAX_HANDSHAKE_BYTES})"))
            if len(job.received) >= _LENGTH.size + length:
                body = bytes(job.received[_LENGTH.size:_LENGTH.size + length])
                try:
                    document = _decode(body, job.where)
                except PeerMetadataError as exc:
                    return self._finish(job, None, exc)
                return self._finish(job, document, None)
        if not chunk:
            if self._may_reconnect(job):
                return self._reconnect(job)
            self._finish(job, None, PeerMetadataError(f"the prefill instance at {job.where} closed the connection "
                                                      f"before its handshake was complete (asked {job.reconnects + 1} "
                                                      "times)"))

    @staticmethod
    def _may_reconnect(job: _Fetch) -> bool:
        """Nothing of the answer came, a new connection is left, and so is time."""
        return not job.received and job.reconnects < MAX_RECONNECTS and time.monotonic() < job.deadline

    def _reconnect(self, job: _Fetch) -> None:
        """Ask again on a new connection, within the fetch's own deadline: the listener closed this one before
        answering, as it does when our request came after its ``CONNECTION_S`` (this decode's process was
        starved between its connect and its request: vLLM's engine holds the GIL the fetcher needs)."""
        assert job.sock is not None
        self._active.pop(job.sock, None)
        self._selector.unregister(job.sock)
        job.sock.close()
        job.sock, job.sent, job.reconnects = None, 0, job.reconnects + 1
        logger.info("kvxfer vllm: the prefill instance at %s closed the handshake connection before answering; asking "
                    "again (%d of %d)", job.where, job.reconnects, MAX_RECONNECTS)
        self._start(job)

    def _finish(self, job: _Fetch, document: Optional[dict], error: Optional[BaseException]) -> None:
        if job.sock is not None:
            if self._active.pop(job.sock, None) is not None:
                self._selector.unregister(job.sock)
            job.sock.close()
            job.sock = None
        with self._lock:
            self._count -= 1
        try:
            job.done(document, error)
        except Exception:  # the callback's bug must not stop every other fetch
            logger.exception("kvxfer vllm: handshake completion failed")

    def close(self) -> None:
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=2.0)
        self._resolver.shutdown(wait=False, cancel_futures=True)
        for sock in list(self._active):
            sock.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()


def fetch_handshake(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    """One blocking fetch (tools and tests); ``PeerMetadataError`` when it cannot be had in time."""
    fetcher = HandshakeFetcher(max_fetches=1)
    result: dict[str, Any] = {}
    finished = threading.Event()

    def done(document: Optional[dict], error: Optional[BaseException]) -> None:
        result.update(document=document, error=error)
        finished.set()

    try:
        fetcher.fetch(host, port, timeout_s, done)
        finished.wait(timeout_s + 5.0)
    finally:
        fetcher.close()
    if result.get("error") is not None:
        raise result["error"]
    if result.get("document") is None:
        raise PeerMetadataError(f"no handshake from the prefill instance at {host}:{port} within {timeout_s}s")
    return result["document"]


def local_only_policy(cluster_secret: Optional[bytes]) -> bool:
    return cluster_secret is None
