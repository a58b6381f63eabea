"""Knowing that a source shares our host, and seeing it die at once (the ucx and nixl backends).

UCX's peer error handling (``UCP_ERR_HANDLING_MODE_PEER``) rules out its shared-memory
transports, so on one host it pushed gets onto tcp emulation (0.75-1.0 GB/s where CMA
gets 5-9 GB/s). A source on our host needs no such mode: its meta carries the host
identity (boot id + network namespace, ``kvxfer.meta.seal.host_identity``), its
pid and that pid's start time, and we watch it through a pidfd, which becomes readable
the moment the process exits. A dead source then fails its pulls at once instead of by
timeout, without UCX's peer failure mode.

Beside the backend packages, like ``ucx_tls.py``, because both UCX-based backends use it and a
backend package never imports another.
"""

from __future__ import annotations

import os
import select
import threading
from typing import Any, Mapping, Optional

from kvxfer.backends.ucx_tls import SHARED_MEMORY_TRANSPORTS, parse_ucx_tls
from kvxfer.meta.seal import HOST_FIELD, host_identity

PID_FIELD, START_FIELD = "ucx_pid", "ucx_pid_start"
#: The longest a reader waits past its own limit on a same-host source that provably lives and runs
#: (same pid and start time, not stopped; ucx's meta confirmation): a slow source costs latency, not the
#: read. The vLLM decode gives a handshake whose confirmation is under way this much more time.
LIVE_SOURCE_WAIT_S = 120.0


def process_start_time(pid: int) -> Optional[int]:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot): tells a pid from its reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the command name may contain spaces and parentheses
    return int(fields[19])


def shared_memory_permitted() -> bool:
    """Whether ``UCX_TLS`` lets UCX move bytes between processes of this host without the network stack."""
    tls = parse_ucx_tls(os.environ.get("UCX_TLS"))
    return any(tls.permits(t) for t in SHARED_MEMORY_TRANSPORTS)


def own_identity() -> dict[str, int]:
    """The fields a source exports so that a reader on its host can watch it."""
    pid = os.getpid()
    return {PID_FIELD: pid, START_FIELD: process_start_time(pid) or 0}


class SourceWatch:
    """A pidfd on a source process of this host; ``exited()`` is a non-blocking check."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid, self._fd = pid, fd
        # poll, not select: select() refuses fds past 1024, and a busy process (an engine, or a
        # process under a connect flood) holds that many. Made once: every read's progress asks.
        # A poll object refuses two threads at once ("concurrent poll() invocation"), hence the lock.
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._lock = threading.Lock()

    @classmethod
    def for_meta(cls, meta: Mapping[str, Any], pid_field: str = PID_FIELD,
                 start_field: str = START_FIELD) -> Optional["SourceWatch"]:
        """A watch when the meta's source runs on this host (and is the process it names), else None."""
        pid, start = meta.get(pid_field), meta.get(start_field)
        if meta.get(HOST_FIELD) != host_identity() or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return None
        if not hasattr(os, "pidfd_open"):
            return None
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already, or another pid namespace: treat as remote
            return None
        if process_start_time(pid) != start:  # the pid was reused by another process
            os.close(fd)
            return None
        return cls(pid, fd)

    def exited(self) -> bool:
        with self._lock:
            if self._fd < 0:
                return True
            return bool(self._poller.poll(0))

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                self._poller.unregister(self._fd)
                os.close(self._fd)
                self._fd = -1
