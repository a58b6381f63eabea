"""kvxfer's endpoint sockets (``kvxfer.integrations.sglang.sockets``) with real zmq sockets and real file
descriptors, no SGLang: bounded, a held one never closed, idle ones closed, a dropped connection replaced, and every
fd back after a flood of endpoints (issue 49: SGLang's ``_connect`` kept two sockets per endpoint for good)."""

from __future__ import annotations

import os
import time

import pytest

zmq = pytest.importorskip("zmq")

from kvxfer.integrations.sglang.sockets import EndpointSockets  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)  # closes what a failed test left open (term would wait for it)


def settle(check, timeout_s: float = 10.0) -> bool:
    """``check()`` within ``timeout_s``: zmq closes a socket's fds on its own threads, soon after ``close``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def closed_ports(n: int) -> list[str]:
    return [f"tcp://127.0.0.1:{20_000 + i}" for i in range(n)]  # nothing listens there: frames only queue


def test_the_table_is_bounded_a_held_socket_stays_and_idle_ones_close_with_their_fds(context):
    clock = Clock()
    table = EndpointSockets(context, max_sockets=16, idle_s=3.0, clock=clock)
    table.send("tcp://127.0.0.1:19999", [b"warm"])  # zmq's own threads and fds, made once per context
    clock.now += 10
    table.sweep()
    base = fds()
    held = "tcp://127.0.0.1:19998"
    table.hold(held, True)
    table.send(held, [b"chunk"])
    for endpoint in closed_ports(200):  # a flood of endpoints
        table.send(endpoint, [b"hello"])
    assert table.sizes() == {"sockets": 16, "held": 1}, table.sizes()
    assert table.counters["evicted"] == 200 + 1 - 16, table.counters  # the held one never
    assert settle(lambda: fds() <= base + 16 * 4), (base, fds())  # bounded (zmq's reaper closes evicted ones)
    clock.now += 2.9
    table.sweep()
    assert table.sizes()["sockets"] == 16  # not idle for long enough yet
    clock.now += 0.2
    table.sweep()
    assert table.sizes() == {"sockets": 1, "held": 1}  # the held one stays
    table.hold(held, False)
    clock.now += 3.0
    table.sweep()
    assert table.sizes() == {"sockets": 0, "held": 0}
    assert settle(lambda: fds() <= base), (base, fds())


def test_a_table_of_held_sockets_refuses_one_more_and_a_dropped_connection_is_replaced(context):
    table = EndpointSockets(context, max_sockets=2, idle_s=3.0)
    first, second, third = closed_ports(3)
    for endpoint in (first, second):
        table.hold(endpoint, True)
        table.send(endpoint, [b"x"])
    with pytest.raises(zmq.Again):
        table.send(third, [b"x"])  # every socket held by a room in flight: the caller fails that frame
    assert table.counters["full"] == 1
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    peer = f"tcp://127.0.0.1:{port}"
    table.hold(first, False)
    table.send(peer, [b"one"])
    assert pull.poll(5000) and pull.recv_multipart() == [b"one"]
    pull.close(linger=0)  # the peer restarts on the same port
    time.sleep(0.3)
    pull = context.socket(zmq.PULL)
    pull.bind(peer)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # SGLang's rule: a socket whose connection dropped is replaced
        try:
            table.send(peer, [b"two"])
        except zmq.Again:
            time.sleep(0.05)
            continue
        if pull.poll(500):
            break
    assert pull.recv_multipart() == [b"two"] and table.counters["replaced"] >= 1, table.counters
    pull.close(linger=0)
    table.close()
    assert table.sizes() == {"sockets": 0, "held": 0}
