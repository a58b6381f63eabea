"""A TCP port for a server that another process will bind later (etcd, an SGLang bootstrap server, vLLM's HTTP server).

Why not ``bind(0)`` and close: the kernel hands that port out of the ephemeral range, the same range it
takes every outgoing connection's source port and every other ``bind(0)`` from. Between our close and
the server's bind, any process of the host can be given it: a clean-clone suite run had an SGLang
bootstrap port answer ``/health`` with resets for 120 s, another process's listener holding it. A port
below the ephemeral range (``ip_local_port_range``) is never handed out by the kernel, so only another
explicit pick can collide, and picks are random over thousands of ports and checked free.
"""

from __future__ import annotations

import random
import socket

#: The lowest port picked: above the well-known and most registered service ports.
LOWEST = 20000
_FALLBACK_EPHEMERAL_LOW = 32768


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port on ``host`` that nothing holds now, below the kernel's ephemeral range where that range leaves
    room (else any free port the kernel gives)."""
    high = _ephemeral_low()
    if high - LOWEST >= 1000:
        for _ in range(tries):
            port = random.randrange(LOWEST, high)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
