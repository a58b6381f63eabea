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

Who answers. A small child process of the source (``confirm_server.py``), on a socket the source
itself listens on, so the kernel still names the source; it answers while the source's own threads
cannot run (vLLM's engine holds the GIL through long C calls: a daemon thread answered after 16-120 s
on a loaded host, issue 40). Where the child cannot start, such a thread answers, with a warning.
A child that dies while its source lives (killed, OOM) is started again on the same socket and told
every export before it answers (``ConfirmServer._watch``): the published metas name that socket, so
without it every new reader was refused until the source restarted (issue 49). The source keeps its
copy of the socket for that; readers that connect meanwhile wait in its backlog. More deaths than
``helper_cpus.RestartBudget`` allows is logged as an error and the socket closed
(readers fail at once); the next export then starts a new server.

How long a question waits. ``timeout_s``, then on while the source provably lives and can run
(``/proc/<pid>/stat``: the same start time, not stopped, not a zombie; checked every ``_LIVE_CHECK_S``),
up to ``LIVE_SOURCE_WAIT_S`` in all: a slow source (or a fallback thread starved of the GIL) costs
latency, not the read. A source that died fails the question within ``_LIVE_CHECK_S`` (its child
exits with it, so its socket resets or refuses at once in practice), and a stopped one (SIGSTOP, a
frozen job) fails at ``timeout_s`` as before: its child answers no one while it is stopped, since it
could not serve the read either. Every wait keeps a timeout.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import secrets
import socket
import struct
import subprocess
import threading
import time
from collections import OrderedDict
from typing import Any, Mapping, Optional

from kvxfer.backends.helper_cpus import RestartBudget, unpin
from kvxfer.backends.same_host import LIVE_SOURCE_WAIT_S, PID_FIELD, START_FIELD, process_start_time
from kvxfer.backends.ucx.confirm_server import DIGEST_CHARS, REQUEST, Exports, Serving, spawn
from kvxfer.errors import PeerMetadataError, TransferError

logger = logging.getLogger(__name__)

#: The sealed meta field naming the exporter's confirmation socket (abstract namespace).
CONFIRM_FIELD = "ucx_confirm_socket"
CONFIRM_TIMEOUT_S = 5.0
#: How often a waiting question checks that its source still lives.
_LIVE_CHECK_S = 0.25
_CHILD_START_S = 10.0   # for the answering process to say it serves (a loaded host), else a thread answers
_CHILD_STOP_S = 1.0
_CREDENTIALS = struct.Struct("3i")   # struct ucred: pid, uid, gid
#: connect() errors worth another try within the deadline: EAGAIN, the listener's backlog is full
#: (a local connect flood: issue 26 saw 9 of 12 first pulls fail at once on it); ECONNREFUSED, no
#: listener (yet). Retried after 5 ms, doubling up to 100 ms.
_RETRY_ERRNOS = frozenset({errno.EAGAIN, errno.ECONNREFUSED})
_RETRY_FIRST_S, _RETRY_MAX_S = 0.005, 0.1


def _abstract(name: str) -> bytes:
    return b"\0" + name.encode()


class ConfirmServer:
    """This process's answers to "did you export this meta?": a child process (``confirm_server.py``, whose
    docstring says why), or a daemon thread of this process where the child cannot start."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.name = f"kvxfer-ucx-confirm/{self.pid}/{secrets.token_hex(8)}"
        self._lock = threading.Lock()
        self._exports = Exports()  # what this process exported: the fallback thread's answers, a new child's start
        self._closing = self._given_up = False
        self._deaths = RestartBudget()  # a child that dies is started again, within this budget
        self.restarts = 0
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        listener.bind(_abstract(self.name))
        listener.listen(128)  # by this process: what SO_PEERCRED tells a reader, whoever accepts
        self._listener: Optional[socket.socket] = listener  # kept: a child that dies is replaced on it
        self._child = spawn(listener, _CHILD_START_S)
        if self._child is not None:
            unpin(self._child.pid)  # not held to the core an engine pinned this thread to (helper_cpus.py)
            threading.Thread(target=self._watch, name="kvxfer-ucx-confirm-watch", daemon=True).start()
            return
        logger.warning("ucx confirmation: answering from a thread of this process instead, which cannot answer "
                       "while another thread holds the GIL (a reader waits on, up to %gs)", LIVE_SOURCE_WAIT_S)
        serving = Serving(listener, self._exports.__contains__)
        threading.Thread(target=serving.forever, name="kvxfer-ucx-confirm", daemon=True).start()

    def offer(self, digest: str) -> None:
        """Before the meta with seal ``digest`` is published: the child reads it before answering anyone."""
        self._tell(b"+", digest)

    def withdraw(self, digest: str) -> None:
        self._tell(b"-", digest)

    def alive(self) -> bool:
        """False once the server gave up on its child (``_watch``): the next export starts another server."""
        return not self._given_up

    def _tell(self, what: bytes, digest: str) -> None:
        with self._lock:
            (self._exports.offer if what == b"+" else self._exports.withdraw)(digest)
            if self._child is None:
                return
            assert self._child.stdin is not None
            try:
                self._child.stdin.write(what + digest.encode("ascii") + b"\n")
                self._child.stdin.flush()
            except (OSError, ValueError) as exc:  # it died: ``_watch`` starts another and tells it every export
                logger.warning("ucx confirmation: the answering process (pid %d) is gone (%s)", self._child.pid, exc)

    def _watch(self) -> None:
        """On its own thread: wait for the child (``waitpid``, outside the GIL); when it died while this process
        lives and did not close it, start another on the same socket, told every export first."""
        while True:
            child = self._child
            assert child is not None
            status = child.wait()
            with self._lock:
                if self._closing or os.getpid() != self.pid:
                    return
                allowed = self._deaths.died()
                for pipe in (child.stdin, child.stdout):
                    if pipe is not None:
                        try:
                            pipe.close()
                        except OSError:
                            pass
                assert self._listener is not None
                again = spawn(self._listener, _CHILD_START_S, self._exports.lines()) \
                    if allowed else None
                if again is None:
                    logger.error("ucx confirmation: the answering process (pid %d) died (status %s), %d time(s) within "
                                 "%gs; not started again: readers of this host cannot confirm this process's metas "
                                 "until it exports new ones", child.pid, status, self._deaths.recent, self._deaths.window_s)
                    self._given_up = True
                    self._listener.close()
                    self._listener = None
                    return
                unpin(again.pid)
                self._child = again
                self.restarts += 1
                logger.error("ucx confirmation: the answering process (pid %d) died (status %s) while this process "
                             "lives; started again as pid %d (restart %d)", child.pid, status, again.pid, self.restarts)

    def close(self) -> None:
        """Stop the child (EOF on its stdin); in a forked process, leave the exporter's child alone."""
        if self._child is None or self.pid != os.getpid():
            return
        with self._lock:
            self._closing = True
            child = self._child
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            try:
                child.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
        try:
            child.wait(_CHILD_STOP_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


_server: Optional[ConfirmServer] = None
_server_lock = threading.Lock()


def confirm_server() -> ConfirmServer:
    """This process's server, started on first use, again in a forked child (it is the fork's own meta
    to vouch for), and again where its child died; stopped at exit."""
    global _server
    with _server_lock:
        if _server is None or _server.pid != os.getpid() or not _server.alive():
            _server = ConfirmServer()
            atexit.register(_server.close)
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
    if not isinstance(digest, str) or len(digest) != DIGEST_CHARS:
        raise _refuse("its seal digest is malformed")
    patience = _Patience(pid, start, timeout_s, live_s)
    try:
        with _connect(name, patience) as sock:
            peer_pid, _, _ = _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                 _CREDENTIALS.size))
            if peer_pid != pid or process_start_time(pid) != start:
                raise _refuse(f"its confirmation socket is held by pid {peer_pid}, not by the source it names "
                              f"(pid {pid})")
            sock.sendall(REQUEST + digest.encode("ascii") + b"\n")
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
