"""The zmq PUSH sockets a kvxfer manager sends on, one per peer endpoint, bounded and closed when idle.

SGLang 0.5.23's ``CommonKVManager._connect`` keeps a PUSH socket and a monitor socket for every endpoint it ever
sent to, and never closes them: a prefill that answered a stranger's registrations (each naming a new endpoint)
went from 192 to 5,585 open files, and at the fd limit its bootstrap server accepted nothing (issue 49). kvxfer's
own frames go through this table instead: the same socket options and the same reconnection rule as SGLang's
(a socket whose connection dropped is replaced at the next send, found through its monitor), but

* an endpoint is *held* while one of its rooms is in flight (``hold``): its socket is never closed then, so a
  room's chunks go out in order on one connection;
* a socket not held and unused for ``idle_s`` is closed (``sweep``, on the prefill's service loop), so after
  a flood the fds come back within seconds;
* at most ``max_sockets`` are open: opening one more closes the least recently used socket that is not held;
  when every one is held the send fails (the caller fails its room, as for any frame zmq will not take).

Thread-safe: one lock around the table and each send (sends never block: ``zmq.NOBLOCK``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import zmq

logger = logging.getLogger(__name__)

#: Endpoint sockets open at once (each costs about four file descriptors: its own, its TCP connection and the
#: monitor pair).
MAX_SOCKETS = 512
#: Seconds a socket no room holds stays open after its last send.
IDLE_S = 3.0


@dataclass
class _Entry:
    sock: Any
    monitor: Any
    used: float
    holds: int = 0


class EndpointSockets:
    """``send(tcp_endpoint, frames, ipv6)`` on a bounded table of PUSH sockets made in ``context``."""

    def __init__(self, context: Any, *, max_sockets: int = MAX_SOCKETS, idle_s: float = IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ctx, self._max, self._idle_s, self._clock = context, max_sockets, idle_s, clock
        self._lock = threading.Lock()
        self._entries: "OrderedDict[str, _Entry]" = OrderedDict()  # least recently used first
        self._holds: dict[str, int] = {}  # endpoint -> rooms in flight (kept when its socket is not open)
        self.counters = {"opened": 0, "closed_idle": 0, "evicted": 0, "replaced": 0, "full": 0}

    def send(self, endpoint: str, frames: list[bytes], *, ipv6: bool = False) -> None:
        """Hand ``frames`` to zmq for ``endpoint`` (``tcp://ip:port``); raises ``zmq.Again`` when zmq will not take
        them (no connection, its queue full) or when the table is full of held sockets."""
        with self._lock:
            entry = self._socket_locked(endpoint, ipv6)
            entry.sock.send_multipart(frames, flags=zmq.NOBLOCK)

    def hold(self, endpoint: str, held: bool) -> None:
        """``endpoint`` has its first room in flight (``held``), or its last one ended."""
        with self._lock:
            count = self._holds.get(endpoint, 0) + (1 if held else -1)
            if count > 0:
                self._holds[endpoint] = count
            else:
                self._holds.pop(endpoint, None)
            entry = self._entries.get(endpoint)
            if entry is not None:
                entry.holds = max(0, count)
                entry.used = self._clock()  # an idle socket goes ``idle_s`` after its last room, not before
                self._entries.move_to_end(endpoint)

    def sweep(self) -> None:
        """Close the sockets no room holds that were unused for ``idle_s``."""
        now = self._clock()
        with self._lock:
            for endpoint in list(self._entries):
                entry = self._entries[endpoint]
                if now - entry.used < self._idle_s:
                    break  # least recently used first: the rest are newer
                if entry.holds == 0:
                    self._close_locked(endpoint)
                    self.counters["closed_idle"] += 1

    def close(self) -> None:
        with self._lock:
            for endpoint in list(self._entries):
                self._close_locked(endpoint)

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {"sockets": len(self._entries), "held": sum(1 for e in self._entries.values() if e.holds)}

    def _socket_locked(self, endpoint: str, ipv6: bool) -> _Entry:
        entry = self._entries.get(endpoint)
        if entry is not None and _disconnected(entry.monitor):  # SGLang's rule: a dropped connection is replaced
            self._close_locked(endpoint)
            self.counters["replaced"] += 1
            entry = None
        if entry is not None:
            entry.used = self._clock()
            self._entries.move_to_end(endpoint)
            return entry
        while len(self._entries) >= self._max:
            victim = next((key for key, old in self._entries.items() if old.holds == 0), None)
            if victim is None:
                self.counters["full"] += 1
                raise zmq.Again(f"all {self._max} endpoint sockets are held by rooms in flight")
            self._close_locked(victim)
            self.counters["evicted"] += 1
        sock = self._ctx.socket(zmq.PUSH)
        try:  # SGLang 0.5.23's options (CommonKVManager._connect)
            if ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, -1)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
            sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)
            sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
            sock.connect(endpoint)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except Exception:
            sock.close(linger=0)
            raise
        entry = self._entries[endpoint] = _Entry(sock, monitor, self._clock(), self._holds.get(endpoint, 0))
        self.counters["opened"] += 1
        return entry

    def _close_locked(self, endpoint: str) -> None:
        entry = self._entries.pop(endpoint)
        try:
            entry.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        entry.monitor.close(linger=0)
        entry.sock.close(linger=0)


def _disconnected(monitor: Optional[Any]) -> bool:
    if monitor is None:
        return False
    try:
        monitor.recv_multipart(zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False
    except zmq.ZMQError:
        return True
