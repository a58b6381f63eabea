"""``kvxfer.runtime.ports.free_port``: a port the kernel never hands out by itself (below its ephemeral range),
free when picked, and different picks spread (a clean-clone run lost an SGLang bootstrap port to another
process while ``bind(0)`` picked them)."""

from __future__ import annotations

import socket

from kvxfer.runtime.ports import LOWEST, _ephemeral_low, free_port


def test_picked_ports_are_below_the_ephemeral_range_free_and_spread():
    low = _ephemeral_low()
    picks = [free_port() for _ in range(50)]
    assert all(LOWEST <= p < low for p in picks), (picks, low)
    assert len(set(picks)) > 40, picks  # random over thousands of ports: repeats are rare
    with socket.socket() as s:
        s.bind(("127.0.0.1", picks[-1]))  # free when picked


def test_a_held_port_is_not_picked():
    """Holds 200 picks (picks, not a fixed block: another test's pick in flight is not taken from it), then
    picks 300 more: none is one held. Were a held port not skipped, about 5 of them would be."""
    assert _ephemeral_low() - LOWEST > 1000
    held = []
    try:
        for _ in range(200):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & {free_port() for _ in range(300)}
    finally:
        for s in held:
            s.close()
