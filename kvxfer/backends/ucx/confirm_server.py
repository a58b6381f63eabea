"""The answering side of ucx meta confirmation (``confirm.py``), run as a small child of the exporter.

Why a process: the answer used to come from a daemon thread of the exporter, which runs only when
that process's main thread lets go of the GIL; vLLM's engine holds it through long C calls, and a
prefill worker left a decode unanswered for 120 s (issue 40). A child has its own GIL.

Why the kernel still vouches for the exporter: the exporter itself binds and ``listen()``s the
abstract socket, then hands the listening fd to this child, which only accepts and answers. On
Linux a connecting client's ``SO_PEERCRED`` holds the credentials of the process that called
``listen()``, so the reader's pid and start-time check still names the exporter.

Why it ends with its exporter: the child exits on EOF of its stdin (the exporter exited, closed, or
was killed) or when its parent changes (a fork of the exporter that kept the pipe open does not keep
it alive). The exporter keeps its copy of the listening fd, so that a child that dies while the
exporter lives is replaced on the same socket (``confirm.ConfirmServer._watch``); the socket goes
with the exporter. And while its exporter is stopped (SIGSTOP, state T)
it answers no one, as the exporter's thread could not: a frozen source cannot serve the read
either, and a reader that gave up on it remembers that and fails the next pulls fast.

The exporter sends ``+<digest>`` / ``-<digest>`` lines on the child's stdin at export (before the
meta is published) and at close; the child reads whatever is pending there before every answer,
so a question can never overtake the export it asks about.

Why run by path (``python -I <this file>``), not ``-m``: ``-m`` would import ``kvxfer.backends``,
which imports torch (seconds of CPU, per exporting process). Run so, this imports only the
standard library; the exporter's fallback thread (where the child cannot start) imports the same
``Serving`` loop as a module.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

REQUEST = b"KVXFER-CONFIRM-1 "
DIGEST_CHARS = 64
REQUEST_BYTES = len(REQUEST) + DIGEST_CHARS + 1
MAX_CONNECTIONS = 256   # connections open at once; the oldest is dropped beyond it
CONNECTION_S = 1.0      # a connection that has not asked within this is dropped
READY = b"ready\n"      # the child's one line on stdout: it holds the listener and serves
_ROUND_S = 0.25


class Exports:
    """Digests exported and not yet withdrawn, each with how many open registrations exported it."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._lock = threading.Lock()

    def offer(self, digest: str) -> None:
        with self._lock:
            self._count[digest] = self._count.get(digest, 0) + 1

    def withdraw(self, digest: str) -> None:
        with self._lock:
            left = self._count.get(digest, 0) - 1
            if left > 0:
                self._count[digest] = left
            else:
                self._count.pop(digest, None)

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return digest in self._count

    def lines(self) -> bytes:
        """Every export as the exporter tells it to a child (``+<digest>`` once per registration): what a child
        started again is told before it answers anyone."""
        with self._lock:
            return b"".join(b"+" + digest.encode("ascii") + b"\n" for digest, n in self._count.items() for _ in range(n))


class Serving:
    """Answers every connection to ``listener`` that asks in time; nothing a connection sends can stall the others.

    ``exported(digest)`` says whether to answer yes. Bounds: ``MAX_CONNECTIONS`` open at once, each
    dropped unless it asked within ``CONNECTION_S``, each read at most ``REQUEST_BYTES``.
    """

    def __init__(self, listener: socket.socket, exported: Callable[[str], bool]) -> None:
        self.listener, self.exported = listener, exported
        listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        self.open_since: dict[socket.socket, tuple[float, bytes]] = {}

    def forever(self, go_on: Callable[[], bool] = lambda: True) -> None:
        """Serve while ``go_on()``. Once serving stops, no reader of this host can read from the exporter,
        so an unexpected error is logged and serving goes on."""
        while go_on():
            try:
                self.once()
            except Exception:
                logger.exception("ucx confirmation server: unexpected error (serving goes on)")
                time.sleep(0.01)

    def once(self) -> None:
        """One round: accept, read, answer; drop connections that did not ask within ``CONNECTION_S``.
        A registered fd whose ``data`` is a callable (the child's stdin) gets it called."""
        for key, _ in self.selector.select(timeout=_ROUND_S):
            if callable(key.data):
                key.data()
            elif key.fileobj is self.listener:
                self._accept()
            elif key.fileobj in self.open_since:  # else dropped (oldest, at the cap) earlier in this round
                self._read(key.fileobj)
        now = time.monotonic()
        for conn in [c for c, (since, _) in self.open_since.items() if now - since > CONNECTION_S]:
            self._drop(conn)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        conn.setblocking(False)
        if len(self.open_since) >= MAX_CONNECTIONS:
            self._drop(min(self.open_since, key=lambda c: self.open_since[c][0]))
        self.open_since[conn] = (time.monotonic(), b"")
        self.selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        since, asked = self.open_since[conn]
        try:
            chunk = conn.recv(REQUEST_BYTES - len(asked))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        asked += chunk
        if chunk and len(asked) < REQUEST_BYTES:
            self.open_since[conn] = (since, asked)
            return
        if len(asked) == REQUEST_BYTES:
            ok = asked.startswith(REQUEST) and asked.endswith(b"\n") and \
                self.exported(asked[len(REQUEST):-1].decode("ascii", errors="replace"))
            try:
                conn.send(b"yes\n" if ok else b"no\n")
            except OSError:
                pass
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        self.open_since.pop(conn, None)
        conn.close()


class _Pipe:
    """The child's stdin: ``+digest`` / ``-digest`` lines from the exporter, read without blocking."""

    def __init__(self, fd: int, exports: Exports) -> None:
        self.fd, self.exports, self.open, self._partial = fd, exports, True, b""
        os.set_blocking(fd, False)

    def drain(self) -> None:
        while self.open:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            if not chunk:
                self.open = False  # the exporter is gone: nothing it exported may be confirmed
                return
            *lines, self._partial = (self._partial + chunk).split(b"\n")
            for line in lines:
                digest = line[1:].decode("ascii", errors="replace")
                (self.exports.offer if line[:1] == b"+" else self.exports.withdraw)(digest)


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] in ("T", "t")


def main(listener_fd: int, exporter: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the exporter's to handle
    exports = Exports()
    pipe = _Pipe(sys.stdin.fileno(), exports)

    def exported(digest: str) -> bool:
        pipe.drain()  # the export was written before the meta was published, so before this question
        return pipe.open and digest in exports

    serving = Serving(socket.socket(fileno=listener_fd), exported)
    serving.selector.register(pipe.fd, selectors.EVENT_READ, pipe.drain)
    os.write(sys.stdout.fileno(), READY)

    def go_on() -> bool:
        while pipe.open and os.getppid() == exporter and _stopped(exporter):
            time.sleep(0.05)  # as the exporter's own thread would: no answer while it is frozen
        return pipe.open and os.getppid() == exporter

    serving.forever(go_on)


def spawn(listener: socket.socket, start_s: float, told: bytes = b"") -> Optional[subprocess.Popen]:
    """Start the child on ``listener`` (bound and listening in this process); None, logged, where it
    did not say it serves within ``start_s``. The caller then still holds ``listener``. ``told``: export
    lines written to the child's stdin before it serves (a child started again), so that no question is
    answered before them (they must fit the pipe, 64 KiB: a thousand exports)."""
    try:
        child = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(listener.fileno()),
                                  str(os.getpid())], pass_fds=[listener.fileno()], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, close_fds=True,
                                 start_new_session=True)  # a scheduling group of its own: backends/helper_cpus.py
    except OSError as exc:
        logger.warning("ucx confirmation: cannot start the answering process (%s)", exc)
        return None
    assert child.stdin is not None and child.stdout is not None
    if told:
        try:
            child.stdin.write(told)
            child.stdin.flush()
        except OSError:
            pass  # it died at once: READY never comes, handled below
    with selectors.DefaultSelector() as ready:
        ready.register(child.stdout, selectors.EVENT_READ)
        said = child.stdout.readline() if ready.select(timeout=start_s) else b""
    if said != READY:
        child.kill()
        child.wait()
        logger.warning("ucx confirmation: the answering process did not start in %gs (exit %s)", start_s,
                       child.returncode)
        return None
    child.stdout.close()
    return child


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
