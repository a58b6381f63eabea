"""``kvxfer.runtime.ports.free_port``: a port the kernel never hands out by itself (below its ephemeral range),
free when picked, and different picks spread (a clean-clone run lost an SGLang bootstrap port to another
process while ``bind(0)`` picked them); two picks of one process never the same port (issue 49 item 6:
back-to-back picks repeated about once in 7,500 pairs, and ``EtcdServer`` failed "address already in use")."""

from __future__ import annotations

import socket

from kvxfer.runtime import ports
from kvxfer.runtime.ports import LOWEST, _ephemeral_low, free_port, free_ports


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


def test_back_to_back_picks_never_repeat():
    """3,000 picks over the ~12,000 ports below the ephemeral range: random picks would repeat one almost
    surely (birthday bound: about 300 repeats expected); remembered picks are skipped, so none does."""
    picks = [free_port() for _ in range(3000)]
    assert len(set(picks)) == len(picks)


def test_picks_never_repeat_in_a_narrow_window(monkeypatch):
    """A 1,000-port window (where random picks repeated once in 700-1,250 pairs): 500 picks, all different,
    and the memory stays bounded by half the window, so picks never run out."""
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: LOWEST + 1000)
    monkeypatch.setattr(ports, "_handed", type(ports._handed)())
    picks = [free_port() for _ in range(500)]
    assert len(set(picks)) == 500 and all(LOWEST <= p < LOWEST + 1000 for p in picks)
    more = [free_port() for _ in range(2000)]
    assert len(ports._handed) <= 500
    assert all(a != b for a, b in zip(more, more[1:]))


def test_free_ports_are_distinct_and_free():
    picked = free_ports(8)
    assert len(set(picked)) == 8
    for port in picked:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
