"""One two-process harness: a spawned child process and a pipe to it.

Loopback, soak and the bench all need the same thing: run one role (the prefill
side, a bench worker) in a real second OS process, talk to it with
``(kind, payload)`` messages, and never hang or lose the reason when it fails.
This module is that one thing:

* the child's body runs inside :func:`_child_main`, which turns any exception the
  body raises into an ``("error", ChildFailure)`` message before the process
  ends, so the parent reports the *child's* error (``prefill: BackendUnavailableError:
  ...``), not its own ``EOFError`` on a pipe that closed;
* :meth:`Child.recv` raises :class:`ChildError` for such a message, and
  :class:`ChildExited` (with the exit code) when the child died without a word
  (a segfault in a transport's C code, ``os.abort``);
* the ``kvxfer`` logger's level and handler travel with the child, so ``-v``
  means the same on both sides.

Spawned (not forked) children, because the parent may already hold transport
state (UCX workers, NIXL agents, CUDA contexts) that must not be duplicated. (The engine
layer's long-lived service processes, which report ready once and then serve on their own
sockets, are started by ``engine_integration.procs``.)

(A push backend's two processes also meet in one ``torch.distributed`` process group:
``kvxfer.backends.process_group``.)
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Optional

from kvxfer.errors import KVXferError

logger = logging.getLogger(__name__)

#: Message kind the child uses to report a failure; :meth:`Child.recv` raises on it.
ERROR = "error"


@dataclass(frozen=True)
class ChildFailure:
    """What a child reports when it fails: enough to print its own error and, with ``--debug``, its traceback."""

    role: str
    type_name: str
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        return f"{self.role}: {self.type_name}: {self.message}"

    @classmethod
    def from_exception(cls, role: str, exc: BaseException) -> "ChildFailure":
        return cls(role, type(exc).__name__, str(exc),
                   "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


class ChildError(KVXferError, RuntimeError):
    """The child process reported a failure; ``str()`` is the child's own error message."""

    def __init__(self, failure: ChildFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure

    @property
    def child_traceback(self) -> str:
        return self.failure.traceback


class ChildExited(ChildError):
    """The child process ended without reporting why (killed, crashed in native code, closed its pipe)."""

    def __init__(self, role: str, exitcode: Optional[int]) -> None:
        how = "is still running but closed its pipe" if exitcode is None else (
            f"was killed by signal {-exitcode}" if exitcode < 0 else f"exited with code {exitcode}")
        super().__init__(ChildFailure(role, "ChildExited", f"the {role} process {how} without reporting an error"))
        self.exitcode = exitcode


class ChildTimeout(ChildError, TimeoutError):
    """The child did not answer within the allowed time."""

    def __init__(self, role: str, waiting_for: str, timeout_s: float) -> None:
        super().__init__(ChildFailure(role, "TimeoutError",
                                      f"no {waiting_for} from the {role} process within {timeout_s:.0f}s"))


class Pipe:
    """The child's end of the pipe: ``send``/``recv``/``poll`` of ``(kind, payload)`` messages."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def send(self, kind: str, payload: Any = None) -> None:
        self._conn.send((kind, payload))

    def poll(self, timeout_s: float = 0.0) -> bool:
        return bool(self._conn.poll(timeout_s))

    def recv(self) -> tuple[str, Any]:
        kind, payload = self._conn.recv()
        return kind, payload


def _configure_child_logging(level: int, fmt: Optional[str]) -> None:
    """The parent's ``kvxfer`` logging, re-created in the fresh interpreter of a spawned child."""
    root = logging.getLogger("kvxfer")
    root.setLevel(level)
    if fmt is not None and not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(fmt))
        root.addHandler(handler)
        root.propagate = False


def _child_main(conn: Any, role: str, body: Callable[..., Any], args: tuple, log_level: int,
                log_format: Optional[str]) -> None:
    """The child process: run ``body(pipe, *args)``; any exception becomes an ``error`` message."""
    _configure_child_logging(log_level, log_format)
    pipe = Pipe(conn)
    try:
        body(pipe, *args)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent as the child's own message
        try:
            pipe.send(ERROR, ChildFailure.from_exception(role, exc))
        except (OSError, EOFError):
            pass  # the parent is gone: nobody to tell
    finally:
        conn.close()


def _parent_log_setup() -> tuple[int, Optional[str]]:
    root = logging.getLogger("kvxfer")
    fmt = None
    for handler in root.handlers:
        if handler.formatter is not None and handler.formatter._fmt:  # noqa: SLF001 - logging has no public getter
            fmt = handler.formatter._fmt  # noqa: SLF001
            break
    return root.getEffectiveLevel(), fmt


class Child:
    """A spawned child process running ``body(pipe, *args)``, and the parent's end of the pipe.

    Use as a context manager; leaving it joins the child (killing it after ``join_timeout_s``).
    """

    def __init__(self, role: str, body: Callable[..., Any], *args: Any, daemon: bool = True,
                 join_timeout_s: float = 30.0) -> None:
        self.role = role
        self.join_timeout_s = join_timeout_s
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        level, fmt = _parent_log_setup()
        self._proc = ctx.Process(target=_child_main, args=(child_conn, role, body, args, level, fmt),
                                 name=f"kvxfer-{role}", daemon=daemon)
        self._proc.start()
        child_conn.close()
        self.pid = self._proc.pid
        self._closed = False

    def __enter__(self) -> "Child":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @property
    def exitcode(self) -> Optional[int]:
        return self._proc.exitcode

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def send(self, kind: str, payload: Any = None) -> None:
        """Send a message; if the child is gone, raise the error it left behind (or how it ended)."""
        try:
            self._conn.send((kind, payload))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._raise_departure()

    def poll(self, timeout_s: float = 0.0) -> bool:
        """True when a message (or the child's end of the pipe) is ready."""
        try:
            return bool(self._conn.poll(timeout_s))
        except (EOFError, OSError):
            return True  # recv() will say what happened

    def recv(self, timeout_s: Optional[float] = None, expected: Optional[str] = None) -> tuple[str, Any]:
        """The next message. Raises :class:`ChildError` (the child's own failure), :class:`ChildExited`
        or :class:`ChildTimeout`; with ``expected``, any other kind is an error too."""
        waiting_for = repr(expected) if expected else "message"
        if timeout_s is not None and not self.poll(timeout_s):
            raise ChildTimeout(self.role, waiting_for, timeout_s)
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._raise_departure()
        if kind == ERROR:
            raise ChildError(payload if isinstance(payload, ChildFailure)
                             else ChildFailure(self.role, "Error", str(payload)))
        if expected is not None and kind != expected:
            raise ChildError(ChildFailure(self.role, "ProtocolError", f"expected {expected!r}, got {kind!r}"))
        return kind, payload

    def _raise_departure(self) -> NoReturn:
        """The pipe is closed: drain a last ``error`` message if the child left one, else report the exit."""
        try:
            while self._conn.poll(0):
                kind, payload = self._conn.recv()
                if kind == ERROR and isinstance(payload, ChildFailure):
                    raise ChildError(payload)
        except (EOFError, OSError):
            pass
        self._proc.join(timeout=5)
        raise ChildExited(self.role, self._proc.exitcode)

    def close(self, timeout_s: Optional[float] = None) -> None:
        """Join the child; kill it if it does not end within ``timeout_s`` (default ``join_timeout_s``)."""
        if self._closed:
            return
        self._closed = True
        self._proc.join(timeout=self.join_timeout_s if timeout_s is None else timeout_s)
        if self._proc.is_alive():
            logger.warning("the %s process (pid %s) did not exit; killing it", self.role, self.pid)
            self._proc.kill()
            self._proc.join(timeout=5)
        self._conn.close()


__all__ = ["Child", "ChildError", "ChildExited", "ChildFailure", "ChildTimeout", "Pipe"]
