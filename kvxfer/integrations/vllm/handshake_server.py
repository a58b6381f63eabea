"""The producer's handshake, served by a small process of its own so that a busy engine cannot starve it.

A thread of vLLM's engine-core process runs Python only while it holds that process's GIL, and
vLLM's engine thread holds it through long C calls (custom ops) and spins between steps: on a
loaded host (issue 40, real vLLM TP 1 -> 2 on 2 cores) the listener thread accepted a decode's
connection at 0.02 s and answered at 60.21 s, after the decode ranks had given up. A process has a
GIL of its own, so the scheduler binds the port itself (``kv_port`` 0 still yields the port at
once, a taken port still fails the same way) and hands the socket to ``python -m
kvxfer.integrations.vllm.handshake_server``, which serves it with ``side_channel.HandshakeListener``
and all of its bounds. The child imports only ``side_channel`` (no torch, no vLLM: it starts in
tens of milliseconds).

Between the two, the child's stdin and stdout:

- stdin, parent -> child: each sealed document, as an 8-byte big-endian length then the bytes; the
  child serves the latest (a sleep-mode re-registration sends a new one). EOF, which the kernel
  delivers however the parent ends, even SIGKILLed, ends the child. ``PR_SET_PDEATHSIG`` is not used:
  it fires when the parent *thread* that started the child exits, not the process.
- stdout, child -> parent: a JSON line of the listener's counters (``HandshakeListener.counters``)
  whenever they changed, at most every ``REPORT_S``, written without blocking (a parent that does
  not read loses intermediate lines, never the child's time); ``HandshakeServer.counters()`` reads
  the newest without blocking.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
from typing import Optional

from kvxfer.integrations.vllm.side_channel import (CONNECTION_S, MAX_CONNECTIONS, MAX_HANDSHAKE_BYTES,
                                                   HandshakeListener, bind_listener)

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct(">Q")
#: The child reports changed counters at most this often, and checks this often that its parent lives.
REPORT_S = 0.5
#: How long ``close`` waits for the child to exit before it kills it.
_EXIT_S = 2.0
#: A child that dies is started again, up to this many times within ``RestartBudget.WINDOW_S`` (then the parent
#: gives up): ``kvxfer.backends.helper_cpus.RestartBudget``, the ucx confirmation child's budget too.
MAX_RESTARTS = 5
_MODULE = "kvxfer.integrations.vllm.handshake_server"
_COUNTERS = ("served", "refused", "junk", "dropped", "open")


class HandshakeServer:
    """The parent's end: binds ``host:port``, starts the serving process, sends it each new document, and starts
    another on the same socket if it dies while this process lives.

    ``port`` is known when the constructor returns; the first document is sent before it returns, so
    a decode that connects at once waits in the socket's backlog until the child answers it.

    Why a restart: a child killed while the engine lives (the OOM killer, a stray ``kill``) used to leave
    the producer unable to answer any new decode until the engine restarted (issue 49). The parent keeps
    its copy of the listening socket, so the port is never released, and a thread waits on the child
    (``waitpid`` outside the GIL: it costs the engine nothing until the child dies); a new child gets the
    same socket and the newest document, and decodes that connected meanwhile wait in the backlog. More
    than ``MAX_RESTARTS`` deaths within a minute (``helper_cpus.RestartBudget``) is not a mishap: the parent logs an error
    saying so, closes the socket (decodes are refused at once, not left waiting) and starts no more."""

    def __init__(self, host: str, port: int, document: bytes, *, local_peers_only: bool,
                 max_connections: int = MAX_CONNECTIONS, connection_s: float = CONNECTION_S) -> None:
        self._sock: Optional[socket.socket] = bind_listener(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._args = ["1" if local_peers_only else "0", str(max_connections), repr(float(connection_s))]
        self._owner = os.getpid()
        self._lock = threading.Lock()  # the child, its pipes and counters: the watcher swaps them
        self._closing = False
        from kvxfer.backends.helper_cpus import RestartBudget  # here: the child imports no kvxfer.backends

        self._deaths = RestartBudget(MAX_RESTARTS)
        self.restarts = 0
        self._document = document
        self._unread = b""
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._carried = dict.fromkeys(_COUNTERS, 0)  # what children that died had counted
        try:
            self._proc = self._start()
        except BaseException:
            self._close_socket()
            raise
        self.update(document)
        threading.Thread(target=self._watch, name="kvxfer-vllm-handshake-watch", daemon=True).start()
        logger.debug("kvxfer vllm: handshake served by process %d on %s:%d", self._proc.pid, host, self.port)

    def _start(self) -> subprocess.Popen:
        assert self._sock is not None
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        fd = self._sock.fileno()
        proc = subprocess.Popen([sys.executable, "-m", _MODULE, str(fd), *self._args],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,), env=env,
                                start_new_session=True)  # its own scheduling group (kvxfer/backends/helper_cpus.py)
        from kvxfer.backends.helper_cpus import unpin  # here: the child imports no kvxfer.backends

        unpin(proc.pid)  # not held to the core an engine pinned this thread to (helper_cpus.py)
        assert proc.stdin is not None and proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        return proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    def update(self, document: bytes) -> None:
        """Serve ``document`` from now on (the child swaps it between two answers; a restarted child starts with it)."""
        with self._lock:
            self._document = document
            self._send(self._proc, document)

    def _send(self, proc: subprocess.Popen, document: bytes) -> None:
        if proc.poll() is not None:
            logger.error("kvxfer vllm: the handshake process %d exited (status %s): decodes cannot fetch this "
                         "producer's handshake until it is started again", proc.pid, proc.returncode)
            return
        assert proc.stdin is not None
        try:
            proc.stdin.write(_LENGTH.pack(len(document)) + document)
            proc.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            logger.error("kvxfer vllm: cannot send the handshake to its serving process %d: %s", proc.pid, exc)

    def _watch(self) -> None:
        """On its own thread: wait for the child; when it died unasked, start another (see the class)."""
        while True:
            proc = self._proc
            status = proc.wait()
            with self._lock:
                if self._closing or os.getpid() != self._owner:
                    return
                if not self._deaths.died():
                    logger.error("kvxfer vllm: the handshake process of %s:%d died %d times within %gs (last: status "
                                 "%s); not starting it again: this producer answers no new decode until the engine "
                                 "restarts", self.host, self.port, self._deaths.recent, self._deaths.window_s, status)
                    self._close_socket()
                    return
                self._read_counters(proc)
                for name in _COUNTERS:
                    if name != "open":
                        self._carried[name] += self._counters[name]
                self._counters, self._unread = dict.fromkeys(_COUNTERS, 0), b""
                self._close_pipes(proc)
                try:
                    self._proc = self._start()
                except OSError as exc:
                    logger.error("kvxfer vllm: the handshake process of %s:%d died (status %s) and cannot be started "
                                 "again (%s): this producer answers no new decode until the engine restarts",
                                 self.host, self.port, status, exc)
                    self._close_socket()
                    return
                self.restarts += 1
                self._send(self._proc, self._document)
                logger.error("kvxfer vllm: the handshake process of %s:%d died (status %s) while the engine lives; "
                             "started it again as process %d (restart %d)", self.host, self.port, status,
                             self._proc.pid, self.restarts)

    def counters(self) -> dict[str, int]:
        """The newest counters (served, refused, junk, dropped, open) of the child and of those that died before
        it; never blocks."""
        with self._lock:
            self._read_counters(self._proc)
            return {name: self._counters[name] + (self._carried[name] if name != "open" else 0)
                    for name in _COUNTERS}

    def _read_counters(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        try:
            while True:
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                self._unread += chunk
        except (BlockingIOError, InterruptedError, OSError, ValueError):
            pass
        *lines, self._unread = self._unread.split(b"\n")
        for line in lines[-1:]:
            try:
                self._counters.update({k: int(v) for k, v in json.loads(line).items() if k in _COUNTERS})
            except (ValueError, AttributeError, TypeError):
                logger.warning("kvxfer vllm: the handshake process wrote %r, not its counters", line[:80])

    @staticmethod
    def _close_pipes(proc: subprocess.Popen) -> None:
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None and not pipe.closed:
                try:
                    pipe.close()
                except OSError:
                    pass

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """End the child (stdin EOF), killed if it does not exit within ``_EXIT_S``; logs its counters."""
        with self._lock:
            self._closing = True
            proc = self._proc
            self._close_socket()
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        try:
            proc.wait(_EXIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        counters = self.counters()
        if proc.stdout is not None:
            proc.stdout.close()
        logger.info("kvxfer vllm: handshake on %s:%d closed: %s", self.host, self.port,
                    ", ".join(f"{k} {v}" for k, v in counters.items() if k != "open"))


# --- the child ------------------------------------------------------------------------------------
def _read_documents(buffer: bytearray) -> Optional[bytes]:
    """The newest complete document in ``buffer`` (consumed), None if none is complete yet."""
    newest = None
    while len(buffer) >= _LENGTH.size:
        (length,) = _LENGTH.unpack_from(buffer)
        if length > MAX_HANDSHAKE_BYTES:
            raise ValueError(f"a {length}-byte handshake (limit {MAX_HANDSHAKE_BYTES})")
        if len(buffer) < _LENGTH.size + length:
            break
        newest = bytes(buffer[_LENGTH.size:_LENGTH.size + length])
        del buffer[:_LENGTH.size + length]
    return newest


def _report(counters: dict[str, int]) -> bool:
    """One line to the parent, unless the pipe is full (then False: it goes with the next report)."""
    try:
        os.write(1, json.dumps(counters).encode() + b"\n")  # < PIPE_BUF: written whole or not at all
    except BlockingIOError:
        return False
    except OSError:  # the parent is gone: stdin says so next
        return False
    return True


def serve(fd: int, local_peers_only: bool, max_connections: int, connection_s: float) -> int:
    """The child's main loop: read documents from stdin, report counters to stdout, until stdin ends."""
    parent = os.getppid()
    buffer = bytearray()
    document: Optional[bytes] = None
    while document is None:  # the first document before the first answer (decodes wait in the backlog)
        chunk = os.read(0, 1 << 20)
        if not chunk:
            return 0
        buffer += chunk
        document = _read_documents(buffer)
    current = [document]
    listener = HandshakeListener("", 0, lambda: current[0], local_peers_only=local_peers_only,
                                 max_connections=max_connections, connection_s=connection_s,
                                 sock=socket.socket(fileno=fd))
    os.set_blocking(1, False)
    told: dict[str, int] = {}
    try:
        while os.getppid() == parent:  # reparented: the parent died without its stdin closing (a forked holder)
            readable, _, _ = select.select([0], [], [], REPORT_S)
            if readable:
                chunk = os.read(0, 1 << 20)
                if not chunk:
                    break
                buffer += chunk
                newest = _read_documents(buffer)
                if newest is not None:
                    current[0] = newest
            counters = listener.counters()
            if counters != told and _report(counters):
                told = counters
    finally:
        listener.close()
        _report(listener.counters())
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    fd, local_only, max_connections, connection_s = int(argv[0]), argv[1] == "1", int(argv[2]), float(argv[3])
    try:
        return serve(fd, local_only, max_connections, connection_s)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
