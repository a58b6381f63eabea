"""A flood of registrations naming new endpoints, against real SGLang ranks, keyless (kvxfer's default): issue 49.

Before: the prefill answered strangers' REGs within an overall budget, a waiting REG queued at the front, so every
newer stranger's REG went before a genuine decode's (0 of 3 genuine REGs answered during a 14 s flood of 500 REG/s);
and SGLang's ``_connect`` kept a PUSH and a monitor socket for every endpoint answered, never closed (the prefill's
fds went 192 -> 5,585 under 300 REG/s, then "Too many open files" and a dead bootstrap server). Now a REG is
answered only once its endpoint has a room in flight, and kvxfer's sockets are bounded and closed when idle.

The ranks are real processes (``sglang_peer.py``: SGLang's own queues make the managers); the flood is real zmq
frames from this process, 500 REG/s each naming a new endpoint; the prefill's fds are counted in
``/proc/<pid>/fd``.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

zmq = pytest.importorskip("zmq")

from sglang_support import Peer, free_port, peer_env  # noqa: E402

from kvxfer.integrations.sglang import wire  # noqa: E402

BACKEND = "kvxfer_ucx"
SUCCESS = 4
RATE = 500  # REG/s
FLOOD_S = 4.0  # the flood lasts at least this long, and until the rooms run during it are done (at most 20 s)


def fds(peer: Peer) -> int:
    return len(os.listdir(f"/proc/{peer.proc.pid}/fd"))


def room(number: int, pages: list[int], aux: int) -> dict:
    return {"room": number, "pages": pages, "aux_index": aux, "chunks": [3, 4]}


def run_room(prefill: Peer, decode: Peer, bootstrap: str, number: int, dst: int, aux: int) -> None:
    """One genuine room, byte for byte: its pages equal on both sides, Success on both."""
    decode.send(op="receive", bootstrap=bootstrap, rooms=[room(number, list(range(dst, dst + 7)), aux)], timeout=60)
    served = prefill.ask(op="serve", rooms=[room(number, list(range(1, 8)), aux)], timeout=60, timeout_s=90)
    received = decode.read(timeout_s=90)
    key = str(number)
    assert served["rooms"][key]["status"] == SUCCESS, (served["rooms"], prefill.log(), decode.log())
    assert received["rooms"][key]["status"] == SUCCESS, (received["rooms"], prefill.log(), decode.log())
    assert served["digests"][key]["pages"] == received["digests"][key]["pages"], f"room {number}: pages differ"


class Flood(threading.Thread):
    """REGs at ``RATE`` per second to the prefill, each naming a new endpoint (closed ports on this host), until
    stopped."""

    def __init__(self, prefill: Peer, layout: dict) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.layout = prefill.info["endpoint"], layout
        self.stop, self.sent, self.began, self.ended = threading.Event(), 0, 0.0, 0.0

    def run(self) -> None:
        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self.began = time.monotonic()
        try:
            while not self.stop.is_set():
                due = int((time.monotonic() - self.began) * RATE) - self.sent
                for _ in range(due):
                    port = 20_000 + self.sent % 40_000
                    host = f"127.{1 + self.sent // 40_000 % 200}.0.1"  # a new endpoint every time
                    sock.send_multipart(wire.encode(wire.REG, {"endpoint": f"{host}:{port}", "layout": self.layout}))
                    self.sent += 1
                time.sleep(0.005)
        finally:
            self.ended = time.monotonic()
            sock.close(linger=0)
            context.term()


@pytest.fixture
def ranks():
    port = free_port()
    peers = [Peer("prefill", BACKEND, port, env=peer_env()), Peer("decode", BACKEND, port, env=peer_env()),
             Peer("decode", BACKEND, port, env=peer_env())]
    try:
        for peer in peers:
            peer.ready()
        yield (f"127.0.0.1:{port}", *peers)
    finally:
        for peer in peers:
            peer.close()


def test_a_flood_of_registrations_from_new_endpoints_starves_no_decode_and_leaks_no_fd(ranks):
    """A decode that registered before the flood and one whose first registration comes in the middle of it both
    complete rooms during the flood and after it, byte for byte; the prefill's fds do not grow with the flood and
    are back to their level within 10 s after it; no HELLO went to a stranger's endpoint."""
    bootstrap, prefill, early, late = ranks
    run_room(prefill, early, bootstrap, 100, 20, 1)  # registered before the flood
    time.sleep(4.0)  # its socket closes once idle: what remains is the prefill's own level
    before = fds(prefill)
    flood = Flood(prefill, early.info["layout"])
    flood.start()
    peak = before
    try:
        time.sleep(1.0)  # a backlog of strangers' REGs first
        peak, sent = max(peak, fds(prefill)), flood.sent
        run_room(prefill, early, bootstrap, 101, 30, 2)
        peak = max(peak, fds(prefill))
        run_room(prefill, late, bootstrap, 200, 20, 3)  # its first registration: in the middle of the flood
        peak = max(peak, fds(prefill))
        assert flood.is_alive() and flood.sent > sent, "the rooms did not run during the flood"
        while time.monotonic() - flood.began < FLOOD_S:
            time.sleep(0.1)
            peak = max(peak, fds(prefill))
        during = time.monotonic() - flood.began
    finally:
        flood.stop.set()
        flood.join(timeout=10)
    sent = flood.sent
    assert sent >= 0.6 * RATE * FLOOD_S, f"the flood sent {sent} REGs in {during:.1f}s"  # a loaded host: margin
    run_room(prefill, early, bootstrap, 102, 40, 4)  # after the flood
    run_room(prefill, late, bootstrap, 201, 30, 5)
    deadline, after = flood.ended + 10.0, fds(prefill)
    while after > before + 4 and time.monotonic() < deadline:
        time.sleep(0.2)
        after = fds(prefill)
    sizes = prefill.ask(op="sizes")
    text = f"fds {before} -> peak {peak} -> {after}; {sent} REGs in {during:.1f}s; {sizes}"
    print(text)
    assert after <= before + 4, f"the prefill's fds did not come back within 10 s after the flood: {text}"
    assert peak <= before + 40, f"the prefill's fds grew with the flood: {text}"
    hellos = sizes["hellos"]
    assert hellos["hellos"] <= 4, f"HELLOs went to strangers: {text}"  # one per genuine decode and room start at most
    assert hellos["hello_endpoints"] <= 4096 and hellos["hello_bytes"] <= 32 << 20, text
    assert sizes["sockets"]["sockets"] <= 2, text
