"""TCP ports for servers that another process binds later (etcd, an SGLang bootstrap server, vLLM's HTTP server).

Why not ``bind(0)`` and close: the kernel hands that port out of the ephemeral range, the same range it
takes every outgoing connection's source port and every other ``bind(0)`` from. Between our close and
the server's bind, any process of the host can be given it: a clean-clone suite run had an SGLang
bootstrap port answer ``/health`` with resets for 120 s, another process's listener holding it. A port
below the ephemeral range (``ip_local_port_range``) is never handed out by the kernel, so only another
explicit pick can collide, and picks are random over thousands of ports and checked free.

Two picks of one process never return the same port: a port stays free until its server binds it, so a
check that it is free cannot tell a port picked a moment ago from an unused one (back-to-back picks
repeated about once in 7,500 pairs, and ``EtcdServer`` then failed "bind: address already in use"). This
process remembers the ports it handed out (the most recent ``_REMEMBERED``, at most half the range) and
skips them; ``free_ports(n)`` also keeps each of its picks bound until all ``n`` are chosen.
"""

from __future__ import annotations

import random
import socket
import threading
from collections import OrderedDict

#: The lowest port picked: above the well-known and most registered service ports.
LOWEST = 20000
_FALLBACK_EPHEMERAL_LOW = 32768
#: Ports this process handed out and will not hand out again (the oldest forgotten first).
_REMEMBERED = 4096

_lock = threading.Lock()
_handed: "OrderedDict[int, None]" = OrderedDict()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def _remember(port: int, span: int) -> None:
    """Called with ``_lock`` held."""
    _handed.pop(port, None)
    _handed[port] = None
    while len(_handed) > min(_REMEMBERED, max(span // 2, 1)):
        _handed.popitem(last=False)


def _bound_socket(host: str, tries: int) -> socket.socket:
    """A socket bound to a port no other pick of this process returned lately, and free now."""
    high = _ephemeral_low()
    span = high - LOWEST
    with _lock:
        if span >= 1000:
            for _ in range(tries):
                port = random.randrange(LOWEST, high)
                if port in _handed:
                    continue
                s = socket.socket()
                try:
                    s.bind((host, port))
                except OSError:
                    s.close()
                    continue
                _remember(port, span)
                return s
        for _ in range(tries):
            s = socket.socket()
            s.bind((host, 0))
            port = int(s.getsockname()[1])
            if port not in _handed:
                _remember(port, 1 << 15)
                return s
            s.close()
    raise OSError(f"no free TCP port on {host} after {tries} tries")


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port on ``host`` that nothing holds now and this process has not handed out lately, below the
    kernel's ephemeral range where that range leaves room (else a free port the kernel gives)."""
    with _bound_socket(host, tries) as s:
        return int(s.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1", tries: int = 200) -> list[int]:
    """``count`` distinct ports, as ``free_port``; each pick stays bound until all are chosen."""
    held = []
    try:
        for _ in range(count):
            held.append(_bound_socket(host, tries))
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()
