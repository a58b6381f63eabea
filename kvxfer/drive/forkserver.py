"""A fork server ("zygote"): one process that has imported the heavy modules once (torch, SGLang's
disaggregation code: ~10 s of CPU each time a Python imports them) and forks a real OS process per request, so
every SGLang rank (``kvxfer.drive.sglang_control.SglangRank``) starts without importing them again.

Server: ``python -m kvxfer.drive.forkserver SOCKET_PATH PRELOAD_JSON`` in the environment whose Python the
children are. It imports ``PRELOAD_JSON`` (a list of module names: only modules whose import starts nothing a
child must own; not kvxfer's backends, UCX or NIXL, which read the environment and load native libraries that must
initialise in the process that uses them), prints ``READY``, then serves one request per connection on the
Unix socket: a JSON ``{"argv", "env", "cwd"}`` plus the child's stdin, stdout and stderr descriptors. It forks;
the child becomes ``python ARGV...`` (``-m MODULE ARGS`` or ``SCRIPT ARGS``) with that environment, directory and
stdio; the server answers the child's pid, then its exit status once it ends, as ``subprocess.Popen`` reports
it (the exit code, or minus the signal). The server ends when its stdin reaches EOF (its controller closed it or
died); the children it forked live on, as ``Popen``'s would.

Client: ``ForkServer(python, preload)`` starts a server, ``.popen(argv, env=, cwd=)`` returns a
``ForkedProcess``, which answers what callers use of a ``subprocess.Popen`` with text pipes.

What a forked child shares with the server, unlike a fresh process: whatever the preloaded modules did at
import. Settings read only when an interpreter or a native library starts (``PYTHON*`` variables such as
``PYTHONWARNINGS``, ``OMP_NUM_THREADS`` as OpenMP loads) are the server's, so a caller starts one server per
such settings (``startup_key``); the child then sets torch's thread count from its own ``OMP_NUM_THREADS``.
The child ends with ``os._exit``, never the interpreter's teardown: objects the preloaded modules made in the
server (SGLang's ``CommonKVReceiver`` builds a zmq context at import) must not be torn down by every child.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

READY = "kvxfer-forkserver-ready"
#: The largest request (argv and environment as JSON) a server takes in one message.
MAX_REQUEST = 1 << 20
#: Environment variables read when an interpreter or a native library starts, not later: a child gets the
#: server's, whatever its own environment says (``startup_key``).
STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_")


class ForkServerError(RuntimeError):
    """The fork server did not start, refused a request, or went away."""


def startup_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a forked child cannot change for itself (``STARTUP_PREFIXES``): children whose keys
    differ need servers of their own."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_PREFIXES)))


# --- server side: runs in the children's Python, stdlib only before the preload


def _exit_code(code: Any) -> int:
    """What ``sys.exit(code)`` makes a Python process exit with."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _become(request: dict, stdio: list[int], inherited: list[int]) -> None:
    """In the forked child: drop the server's descriptors and handlers, take the request's stdio, environment
    and directory, run its program as ``python ARGV`` would, and exit with its status (never returns)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the only handler the server changed
        for fd in inherited:
            os.close(fd)
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()  # through os.environ, so unsetenv/putenv reach C code reading getenv
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if "torch" in sys.modules and threads.isdigit() and 0 < len(threads) <= 4 and int(threads) > 0:
            sys.modules["torch"].set_num_threads(int(threads))  # as torch reads it at import: 1..9999
        if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS; forks share it
            sys.modules["numpy"].random.seed()
        argv = request["argv"]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - as an uncaught exception in a fresh interpreter: traceback, status 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: nothing left to say
                pass
        os._exit(code)


def _spawn(conn: socket.socket, inherited: list[int]) -> Optional[int]:
    """Take one request from ``conn`` and fork its child; None (with an error sent) if it is malformed."""
    data, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
    try:
        request = json.loads(data)
        argv = request["argv"]
        if len(fds) != 3 or flags & socket.MSG_TRUNC or not argv or (argv[0].startswith("-") and
                                                                         (argv[0] != "-m" or len(argv) < 2)):
            raise ValueError("need argv as -m MODULE ARGS or SCRIPT ARGS, and three descriptors")
    except (ValueError, KeyError, TypeError) as exc:
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"error": str(exc)}).encode())
        return None
    pid = os.fork()
    if pid == 0:
        _become(request, fds, inherited)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode())
    return pid


def serve(path: str, preload: Sequence[str]) -> None:
    """The server's loop: import ``preload``, then fork a child per connection until stdin reaches EOF."""
    for name in preload:
        importlib.import_module(name)
    if len(os.listdir("/proc/self/task")) > 1:  # a thread a fork does not copy may hold a lock the child needs
        print("kvxfer.drive.forkserver: the preload started threads; forked children may hang", file=sys.stderr)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)  # a SIGCHLD wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    print(READY, flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nobody reads our stdout after READY: a stray print must never block the server
    os.close(devnull)
    children: dict[int, socket.socket] = {}
    while True:
        ready = select.select([0, listener, wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:  # the client is gone
                    pass
                conn.close()
        if 0 in ready and not os.read(0, 4096):
            break
        if listener in ready:
            conn = listener.accept()[0]
            inherited = [listener.fileno(), wake_r, wake_w, conn.fileno(), *(c.fileno() for c in children.values())]
            pid = _spawn(conn, inherited)
            if pid is None:
                conn.close()
            else:
                children[pid] = conn
    listener.close()
    os.unlink(path)
    try:  # our private folder too: a controller killed, or one that left by ``os._exit``, cannot
        os.rmdir(os.path.dirname(path))
    except OSError:
        pass


# --- client side: the controller's


class ForkedProcess:
    """A child of a fork server, answering as a ``subprocess.Popen(..., stdin=stdout=stderr=PIPE, text=True)``
    does: ``pid``, ``stdin``/``stdout``/``stderr``, ``poll``, ``wait``, ``send_signal``, ``terminate``,
    ``kill``, ``returncode``. Its exit status comes on its connection to the server."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int, stdin: IO[str], stdout: IO[str],
                 stderr: IO[str]) -> None:
        self.args, self.pid, self.stdin, self.stdout, self.stderr = args, pid, stdin, stdout, stderr
        self.returncode: Optional[int] = None
        self._conn: Optional[socket.socket] = conn
        self._lock = threading.Lock()

    def _alive(self) -> bool:
        """Whether the pid still runs (only asked once the server is gone and cannot tell its status)."""
        try:
            with open(f"/proc/{self.pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    def _wait(self, timeout: Optional[float]) -> Optional[int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self.returncode is None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self._conn is not None:
                    if not select.select([self._conn], [], [], left)[0]:
                        return None
                    data = self._conn.recv(MAX_REQUEST)
                    self._conn.close()
                    self._conn = None
                    if data:
                        self.returncode = json.loads(data)["returncode"]
                    else:
                        logger.warning("fork server gone before child %d ended: its exit status is lost", self.pid)
                elif not self._alive():
                    self.returncode = 255  # unknown: the server that could have reaped it is gone
                elif left == 0.0:
                    return None
                else:
                    time.sleep(min(0.1, left if left is not None else 0.1))
            return self.returncode

    def poll(self) -> Optional[int]:
        if not self._lock.acquire(blocking=False):  # another thread waits on it: as Popen, no news yet
            return self.returncode
        self._lock.release()
        return self._wait(0.0)

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """A running fork server for ``python`` with ``preload`` imported, started (with ``env``, in ``cwd``) when
    made; ``timeout_s`` bounds its start (the imports). ``close`` (or its controller's death) ends it."""

    def __init__(self, python: str, preload: Sequence[str] = (), *, env: Optional[Mapping[str, str]] = None,
                 cwd: Optional[str] = None, timeout_s: float = 300.0) -> None:
        self.python = python
        self._dir = tempfile.mkdtemp(prefix="kvxfer-forkserver-")  # 0700: only this user may ask for a fork
        self.path = os.path.join(self._dir, "socket")
        repo = str(Path(__file__).resolve().parents[2])  # ``-m kvxfer.drive.forkserver`` imports from here
        self.proc = subprocess.Popen([python, "-m", "kvxfer.drive.forkserver", self.path, json.dumps(list(preload))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=None if env is None else dict(env), cwd=cwd or repo)
        try:
            self._await_ready(timeout_s)
        except BaseException:
            self.close()
            raise

    def _await_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise ForkServerError(f"fork server ({self.python}) not ready within {timeout_s}s")
            line = self.proc.stdout.readline()
            if not line:
                raise ForkServerError(f"fork server ({self.python}) exited ({self.proc.wait()}) before it was ready")
            if line.strip() == READY:
                return

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str) -> ForkedProcess:
        """Start ``argv`` (``[python, "-m", MODULE, ...]`` or ``[python, SCRIPT, ...]``, ``python`` this
        server's) as a forked child with ``env`` (all of it) in ``cwd``; its stdio are pipes to us."""
        if argv[0] != self.python:
            raise ValueError(f"this fork server runs {self.python}, not {argv[0]}")
        pipes = [os.pipe() for _ in range(3)]
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1]]
        ours = [pipes[0][1], pipes[1][0], pipes[2][0]]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.settimeout(60)
            conn.connect(self.path)
            socket.send_fds(conn, [json.dumps({"argv": list(argv[1:]), "env": dict(env), "cwd": cwd}).encode()],
                            theirs)
            reply = json.loads(conn.recv(MAX_REQUEST) or b'{"error": "the fork server closed the connection"}')
            conn.settimeout(None)
        except BaseException:
            conn.close()
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        if "error" in reply:
            conn.close()
            for fd in ours:
                os.close(fd)
            raise ForkServerError(f"fork server refused {list(argv)}: {reply['error']}")
        return ForkedProcess(list(argv), conn, reply["pid"], open(ours[0], "w"), open(ours[1]), open(ours[2]))

    def close(self) -> None:
        """End the server (EOF on its stdin); its children live on."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                logger.warning("fork server %d did not exit on EOF: killed", self.proc.pid)
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)


# --- one server per (Python, preload, startup settings) in a controller process, started on first use

_SHARED: dict[tuple, Optional[ForkServer]] = {}
_SHARED_LOCK = threading.Lock()


def shared_fork_server(python: str, preload: Sequence[str], env: Mapping[str, str], cwd: str) -> Optional[ForkServer]:
    """This process's fork server for children of ``python`` with ``preload`` imported and ``env``'s startup
    settings (``startup_key``), started on first use (with ``env``: what an interpreter reads at start is the
    server's) and ended at exit; None where one could not start (then once: it is not tried again)."""
    key = (python, tuple(preload), startup_key(env))
    with _SHARED_LOCK:
        if key not in _SHARED:
            try:
                server = ForkServer(python, preload, env=env, cwd=cwd)
            except (ForkServerError, OSError) as exc:
                logger.warning("no fork server for %s (%s): each child imports %s itself", python, exc, list(preload))
                _SHARED[key] = None
            else:
                atexit.register(server.close)
                _SHARED[key] = server
        return _SHARED[key]


def popen_python(argv: Sequence[str], *, env: Mapping[str, str], cwd: str, preload: Sequence[str],
                 fork: bool = True) -> "ForkedProcess | subprocess.Popen[str]":
    """``argv`` (a Python, then ``-m MODULE ...`` or ``SCRIPT ...``) as a process with text pipes on its stdin,
    stdout and stderr: forked from ``shared_fork_server`` when ``fork`` and one runs, else a fresh process (also
    where the server cannot start it)."""
    server = shared_fork_server(argv[0], preload, env, cwd) if fork else None
    if server is not None:
        try:
            return server.popen(argv, env=env, cwd=cwd)
        except (ForkServerError, OSError) as exc:  # a server that died, or a command it cannot run
            logger.warning("fork server could not start %s (%s): a fresh process instead", list(argv[:3]), exc)
    return subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(env), cwd=cwd)


if __name__ == "__main__":
    serve(sys.argv[1], json.loads(sys.argv[2]))
