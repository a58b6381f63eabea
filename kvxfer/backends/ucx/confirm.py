"""Asking a source of this host whether it exported a meta, with the kernel vouching for who answers.

Without a cluster key (``KVXFER_SECRET_FILE``) a meta's seal is only a checksum: any process
of this host can change a field of a real source's meta (its worker address, its rkey, its
buffer address) and seal it again, and UCX reads wherever the forgery points. nixl and local
refuse such a meta through their own registration checks; UCX has nothing we can query.

So each process that exports a UCX meta listens on an abstract Unix socket named in the meta,
and before the first read through an unauthenticated meta of this host the reader connects to
it, checks with ``SO_PEERCRED`` that the process answering is the process the meta names (pid
and start time), and asks whether that process exported exactly this meta: the seal's SHA-256
covers every sealed field. The answer is remembered per digest.

What this cannot refuse: a process of this host that names *itself* as the source, with its
own worker and memory. Only the cluster key tells a real source from such a process, and
``kvxfer info`` and the first transfer's log say so.

How long a question waits. The answer comes from a daemon thread of the source, which runs only
when that process's main thread lets go of the GIL: vLLM's engine holds it through long C calls,
and on a loaded host the answer came after 16-30 s (issue 40). Failing there fails a request whose
source is fine. So a question waits ``timeout_s``, then goes on waiting while the source provably
lives and can run (``/proc/<pid>/stat``: the same start time, not stopped, not a zombie; checked
every ``_LIVE_CHECK_S``), up to ``LIVE_SOURCE_WAIT_S`` in all: a slow source costs latency, not the
read. A source that died fails the question within ``_LIVE_CHECK_S`` (its socket resets at once in
practice), and a stopped one (SIGSTOP, a frozen job) fails at ``timeout_s`` as before: it cannot
answer until someone resumes it. Every wait keeps a timeout.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict
from typing import Any, Mapping, Optional

from kvxfer.backends.same_host import LIVE_SOURCE_WAIT_S, PID_FIELD, START_FIELD, process_start_time
from kvxfer.errors import PeerMetadataError, TransferError

logger = logging.getLogger(__name__)

#: The sealed meta field naming the exporter's confirmation socket (abstract namespace).
CONFIRM_FIELD = "ucx_confirm_socket"
CONFIRM_TIMEOUT_S = 5.0
#: How often a waiting question checks that its source still lives.
_LIVE_CHECK_S = 0.25
_REQUEST = b"KVXFER-CONFIRM-1 "
_DIGEST_CHARS = 64
_REQUEST_BYTES = len(_REQUEST) + _DIGEST_CHARS + 1
_MAX_CONNECTIONS = 256   # connections open at once; the oldest is dropped beyond it
_CONNECTION_S = 1.0      # a connection that has not asked within this is dropped
_CREDENTIALS = struct.Struct("3i")   # struct ucred: pid, uid, gid
#: connect() errors worth another try within the deadline: EAGAIN, the listener's backlog is full
#: (a local connect flood: issue 26 saw 9 of 12 first pulls fail at once on it); ECONNREFUSED, no
#: listener (yet). Retried after 5 ms, doubling up to 100 ms.
_RETRY_ERRNOS = frozenset({errno.EAGAIN, errno.ECONNREFUSED})
_RETRY_FIRST_S, _RETRY_MAX_S = 0.005, 0.1


def _abstract(name: str) -> bytes:
    return b"\0" + name.encode()


class ConfirmServer:
    """This process's answers to "did you export this meta?" (one daemon thread per process)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.name = f"kvxfer-ucx-confirm/{self.pid}/{secrets.token_hex(8)}"
        self._exported: dict[str, int] = {}   # digest -> how many open registrations exported it
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._listener.bind(_abstract(self.name))
        self._listener.listen(128)
        self._listener.setblocking(False)
        threading.Thread(target=self._serve, name="kvxfer-ucx-confirm", daemon=True).start()

    def offer(self, digest: str) -> None:
        with self._lock:
            self._exported[digest] = self._exported.get(digest, 0) + 1

    def withdraw(self, digest: str) -> None:
        with self._lock:
            left = self._exported.get(digest, 0) - 1
            if left > 0:
                self._exported[digest] = left
            else:
                self._exported.pop(digest, None)

    def exported(self, digest: str) -> bool:
        with self._lock:
            return digest in self._exported

    def _serve(self) -> None:
        """Answer every connection that asks in time; nothing a connection sends can stall the others.

        The thread must outlive anything a connection does: once it is gone, no reader of this
        host can read from us any more. So an unexpected error is logged and serving goes on.
        """
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        open_since: dict[socket.socket, tuple[float, bytes]] = {}
        while True:
            try:
                self._serve_once(selector, open_since)
            except Exception:
                logger.exception("ucx confirmation server: unexpected error (serving goes on)")
                time.sleep(0.01)

    def _serve_once(self, selector: selectors.BaseSelector, open_since: dict) -> None:
        """One round: accept, read, answer; drop connections that did not ask within ``_CONNECTION_S``."""
        for key, _ in selector.select(timeout=0.25):
            if key.fileobj is self._listener:
                try:
                    conn, _ = self._listener.accept()
                except OSError:
                    continue
                conn.setblocking(False)
                if len(open_since) >= _MAX_CONNECTIONS:
                    oldest = min(open_since, key=lambda c: open_since[c][0])
                    self._drop(selector, open_since, oldest)
                open_since[conn] = (time.monotonic(), b"")
                selector.register(conn, selectors.EVENT_READ)
                continue
            conn = key.fileobj
            if conn not in open_since:
                continue  # dropped (oldest, at the cap) earlier in this same round
            since, asked = open_since[conn]
            try:
                chunk = conn.recv(_REQUEST_BYTES - len(asked))
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                chunk = b""
            asked += chunk
            if chunk and len(asked) < _REQUEST_BYTES:
                open_since[conn] = (since, asked)
                continue
            if len(asked) == _REQUEST_BYTES:
                self._answer(conn, asked)
            self._drop(selector, open_since, conn)
        now = time.monotonic()
        for conn in [c for c, (since, _) in open_since.items() if now - since > _CONNECTION_S]:
            self._drop(selector, open_since, conn)

    def _answer(self, conn: socket.socket, asked: bytes) -> None:
        ok = asked.startswith(_REQUEST) and asked.endswith(b"\n") and \
            self.exported(asked[len(_REQUEST):-1].decode("ascii", errors="replace"))
        try:
            conn.send(b"yes\n" if ok else b"no\n")
        except OSError:
            pass

    @staticmethod
    def _drop(selector: selectors.BaseSelector, open_since: dict, conn: socket.socket) -> None:
        selector.unregister(conn)
        open_since.pop(conn, None)
        conn.close()


_server: Optional[ConfirmServer] = None
_server_lock = threading.Lock()


def confirm_server() -> ConfirmServer:
    """This process's server, started on first use (and again in a forked child: threads do not fork)."""
    global _server
    with _server_lock:
        if _server is None or _server.pid != os.getpid():
            _server = ConfirmServer()
        return _server


def _refuse(why: str) -> PeerMetadataError:
    return PeerMetadataError(
        f"peer meta refused: {why}; without KVXFER_SECRET_FILE a UCX meta of this host is accepted only when "
        "the process it names confirms it exported exactly this meta (forged or altered?)")


_confirmed: "OrderedDict[str, None]" = OrderedDict()   # digests confirmed in this process, most recent last
_CONFIRMED_KEPT = 4096
#: Digests whose source could not be asked in time (stalled or gone) -> (until, why): while one is
#: remembered, the next pulls only check with a ``_PROBE_S`` question (a source that resumed is
#: confirmed at once; one still stalled fails them fast) instead of each waiting out the whole
#: timeout again (issue 26, row 4). Kept for as long as the question was given (at least
#: ``_FAILED_MIN_S``), 1,024 at most.
_failed: "OrderedDict[str, tuple[float, str]]" = OrderedDict()
_FAILED_KEPT = 1024
_FAILED_MIN_S = 1.0
_PROBE_S = 0.2
_confirmed_lock = threading.Lock()


def confirm_exported(sealed: Mapping[str, Any], digest: str, timeout_s: float = CONFIRM_TIMEOUT_S,
                     live_s: float = LIVE_SOURCE_WAIT_S) -> bool:
    """Return when the process ``sealed`` names has confirmed it exported the meta with seal
    ``digest`` (True: asked now; False: confirmed before, in this process). ``PeerMetadataError``
    when it denies it or another process answers; ``TransferError`` when it cannot be asked in
    time: gone, stopped and silent for ``timeout_s``, or alive and silent for ``live_s`` (see the
    module); either way before anything is posted. Call only with the meta's sealed fields. A
    digest names the whole meta, so one confirmation serves every registration of this process. A
    failure to ask is remembered (``_failed``): until it expires, a call only checks for ``_PROBE_S``."""
    with _confirmed_lock:
        if digest in _confirmed:
            _confirmed.move_to_end(digest)
            return False
        failure = _failed.get(digest)
        if failure is not None and failure[0] <= time.monotonic():
            del _failed[digest]
            failure = None
    if failure is not None:
        probe = min(timeout_s, _PROBE_S)
        try:
            _ask(sealed, digest, probe, probe)
        except TransferError:
            raise TransferError(f"{failure[1]}; still unanswered ({probe:g}s check; a full "
                                f"{timeout_s:g}s wait again in {failure[0] - time.monotonic():.1f}s)") from None
        with _confirmed_lock:
            _failed.pop(digest, None)
    else:
        _ask_and_remember(sealed, digest, timeout_s, live_s)
    with _confirmed_lock:
        _confirmed[digest] = None
        while len(_confirmed) > _CONFIRMED_KEPT:
            _confirmed.popitem(last=False)
    return True


def _ask_and_remember(sealed: Mapping[str, Any], digest: str, timeout_s: float, live_s: float) -> None:
    try:
        _ask(sealed, digest, timeout_s, live_s)
    except TransferError as exc:
        with _confirmed_lock:
            _failed[digest] = (time.monotonic() + max(timeout_s, _FAILED_MIN_S), str(exc))
            while len(_failed) > _FAILED_KEPT:
                _failed.popitem(last=False)
        raise


def _not_running(pid: int, start: int) -> Optional[str]:
    """Why ``pid`` (started at ``start``) cannot answer now, None while it lives and may run."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return "exited"
    fields = stat[stat.rfind(")") + 2:].split()  # the command name may contain spaces and parentheses
    if int(fields[19]) != start:
        return "exited"   # the pid is another process's now
    if fields[0] in ("Z", "X", "x"):
        return "exited"
    if fields[0] in ("T", "t"):
        return "stopped"
    return None


class _Patience:
    """How long the question to one source may still wait (the rule is the module's)."""

    def __init__(self, pid: int, start: int, timeout_s: float, live_s: float) -> None:
        self.pid, self.start, self.timeout_s = pid, start, timeout_s
        self.began = time.monotonic()
        self.deadline = self.began + timeout_s
        self.live_deadline = self.began + max(timeout_s, live_s)
        self.extended = False

    def next_wait(self, may_extend: bool = True) -> float:
        """Seconds to wait before asking again (at most ``_LIVE_CHECK_S``), or ``OSError`` saying why not."""
        why = _not_running(self.pid, self.start)
        if why == "exited":
            raise ProcessLookupError(errno.ESRCH, "the process exited")
        now = time.monotonic()
        if now < self.deadline:
            return max(0.001, min(self.deadline - now, _LIVE_CHECK_S))
        if why is None and may_extend and now < self.live_deadline:
            if not self.extended:
                self.extended = True
                logger.warning("ucx confirmation: source pid %d lives but has not answered in %.1fs (a busy process "
                               "whose GIL is held?); waiting while it lives, up to %gs in all", self.pid,
                               now - self.began, self.live_deadline - self.began)
            return max(0.001, min(self.live_deadline - now, _LIVE_CHECK_S))
        raise TimeoutError(errno.ETIMEDOUT, "no answer in time" if why is None else f"no answer, the process is {why}")


def _connect(name: str, patience: _Patience) -> socket.socket:
    """A connected socket to ``name``. EAGAIN (the backlog is full: the source lives but does not accept
    fast enough) is tried again as long as ``patience`` allows; ECONNREFUSED (nobody listens, yet) only
    within its ``timeout_s``: a live process without the socket is not a slow source."""
    delay = _RETRY_FIRST_S
    while True:
        wait = patience.next_wait()  # raises when out of time, or at once when the source is gone
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(wait)
            sock.connect(_abstract(name))
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno == errno.ECONNREFUSED:
                patience.next_wait(may_extend=False)
            elif exc.errno not in _RETRY_ERRNOS and not isinstance(exc, socket.timeout):
                raise
        time.sleep(delay)
        delay = min(2 * delay, _RETRY_MAX_S)


def _ask(sealed: Mapping[str, Any], digest: str, timeout_s: float, live_s: float = LIVE_SOURCE_WAIT_S) -> None:
    pid, start, name = sealed.get(PID_FIELD), sealed.get(START_FIELD), sealed.get(CONFIRM_FIELD)
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not isinstance(start, int):
        raise _refuse(f"its {PID_FIELD!r}/{START_FIELD!r} fields are missing or invalid")
    if not isinstance(name, str) or not name.startswith(f"kvxfer-ucx-confirm/{pid}/") or len(name) > 100:
        raise _refuse(f"its {CONFIRM_FIELD!r} field is missing or not the named process's (a source of an older kvxfer?)")
    if not isinstance(digest, str) or len(digest) != _DIGEST_CHARS:
        raise _refuse("its seal digest is malformed")
    patience = _Patience(pid, start, timeout_s, live_s)
    try:
        with _connect(name, patience) as sock:
            peer_pid, _, _ = _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                 _CREDENTIALS.size))
            if peer_pid != pid or process_start_time(pid) != start:
                raise _refuse(f"its confirmation socket is held by pid {peer_pid}, not by the source it names "
                              f"(pid {pid})")
            sock.sendall(_REQUEST + digest.encode("ascii") + b"\n")
            answer = b""
            while not answer.endswith(b"\n") and len(answer) < 8:
                sock.settimeout(patience.next_wait())
                try:
                    chunk = sock.recv(8 - len(answer))
                except socket.timeout:
                    continue  # patience decides, with the source's state, whether to wait on
                if not chunk:
                    break
                answer += chunk
    except OSError as exc:   # gone, stalled, or no such socket: nothing was posted, so no byte can land
        allowed = f"{timeout_s:g}s allowed" + (f", {live_s:g}s while it lives" if live_s > timeout_s else "")
        raise TransferError(f"the source of this meta (pid {pid}) could not confirm it: gave up after "
                            f"{time.monotonic() - patience.began:.2f}s ({allowed}; "
                            f"{exc or type(exc).__name__}); nothing was read, no byte can land") from None
    if answer != b"yes\n":
        raise _refuse(f"the source it names (pid {pid}) did not export it")
    logger.debug("meta %s… confirmed by its source, pid %d%s", digest[:12], pid,
                 f" after {time.monotonic() - patience.began:.2f}s" if patience.extended else "")
