"""Junk on the coordinator's port is counted and logged in one line, never a traceback (issue 26, row 11).

Random bytes, a ZeroMQ peer of the old protocol (ZMTP/1.0 frames), a ZeroMQ peer without
the cluster key, a port scanner's HTTP probe, and a key holder's connection carrying frames
that are not sealed messages: the coordinator (a real process; its log reaches our stderr,
captured here) refuses each, logs no traceback, and goes on serving a genuine client.
"""

from __future__ import annotations

import random
import socket
import time

import zmq

from engine_integration.control_plane.zmq.channel import ClientChannel
from engine_integration.control_plane.zmq.client import CoordinatorClient
from engine_integration.control_plane.zmq.coordinator import (CoordinatorConfig, start_coordinator_process,
                                                              stop_coordinator_process)

SECRET = "junk-test-secret-0123456789abcdef"


def _zmtp10(body: bytes, more: bool = False) -> bytes:
    """One ZMTP/1.0 frame: a length byte (the flags byte included), the flags, the body."""
    return bytes([len(body) + 1, 1 if more else 0]) + body


def _send_raw(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        try:
            s.sendall(data)
            time.sleep(0.2)
        except OSError:
            pass  # closed on the first bytes: the rest is refused


def test_junk_on_the_coordinator_port_logs_no_traceback_and_a_genuine_client_is_served(capfd):
    proc, address = start_coordinator_process(CoordinatorConfig(secret=SECRET))
    port = int(address.rsplit(":", 1)[1])
    try:
        _send_raw(port, random.Random(7).randbytes(1 << 20))
        _send_raw(port, _zmtp10(b"") + _zmtp10(b"junk"))                                  # ZMTP/1.0, anonymous
        _send_raw(port, _zmtp10(b"peer-1") + _zmtp10(b"a", more=True) + _zmtp10(b"{}"))  # ZMTP/1.0, named
        _send_raw(port, b"GET / HTTP/1.0\r\n\r\n")
        plain = zmq.Context.instance().socket(zmq.DEALER)    # ZMTP/3 without the key (no CURVE)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(address)
        plain.send(b"KVXH" + b"\x00" * 48)
        # a key holder's connection: raw frames that are no session's, and a session frame of junk
        insider = ClientChannel(address, SECRET.encode())
        for frame in (b"", b"\xff" * 64, b"KVX2" + b"\x00" * 80, random.Random(8).randbytes(4096)):
            insider.send_frame(frame)
        insider.sock.send(insider.session.seal(b"not json at all"))
        time.sleep(1.0)
        plain.close()
        insider.close()

        client = CoordinatorClient(address, secret=SECRET)
        try:
            stats = client.stats()
        finally:
            client.close()
        assert stats.dropped.get("forged", 0) + stats.dropped.get("no session", 0) >= 4, stats.dropped
        assert stats.dropped.get("invalid", 0) == 1, stats.dropped
    finally:
        stop_coordinator_process(proc)
    out, err = capfd.readouterr()
    text = out + err
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
    junk_lines = [line for line in text.splitlines() if "engine_integration." in line]  # the loggers are named by module
    assert len(junk_lines) <= 1, junk_lines          # the one junk message that passed its seal: one line
