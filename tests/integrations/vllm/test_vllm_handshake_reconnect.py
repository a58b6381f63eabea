"""A decode whose handshake connection the producer closed before answering asks again (issue 40, item 0).

The producer's listener closes a connection ``CONNECTION_S`` after accepting it, answered or not (its bound on
peers that never ask). A decode worker starved between its connect and its request (vLLM's engine holds the
GIL its fetcher thread needs) sends the request after that: the real TP 2 -> 1 check failed so, "closed the
connection before its handshake was complete", with the producer alive and answering. The fetcher now makes a
new connection, at most ``MAX_RECONNECTS`` times and within its own deadline.

The producer here is a stand-in listener on a real socket, doing only what the real one does to such a
connection (closing it before answering: the first ``closes`` of them, then answering with a real frame),
because when a starved decode sends its request cannot be arranged from outside its process.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from kvxfer.errors import PeerMetadataError
from kvxfer.integrations.vllm.side_channel import MAX_RECONNECTS, REQUEST, fetch_handshake

DOCUMENT = {"engine_id": "prefill-e", "instance": "i1"}


class ClosingListener:
    """Closes the first ``closes`` connections as soon as it accepts them, answers the rest."""

    def __init__(self, closes: int) -> None:
        self.closes, self.accepted = closes, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                if self.accepted <= self.closes:
                    continue
                asked = b""
                while len(asked) < len(REQUEST):
                    chunk = conn.recv(len(REQUEST) - len(asked))
                    if not chunk:
                        break
                    asked += chunk
                body = json.dumps(DOCUMENT).encode()
                conn.sendall(len(body).to_bytes(8, "big") + body)

    def close(self) -> None:
        self.sock.close()


def test_a_connection_closed_before_the_answer_is_asked_again_and_the_handshake_arrives() -> None:
    listener = ClosingListener(closes=2)
    try:
        began = time.monotonic()
        assert fetch_handshake("127.0.0.1", listener.port, 5.0) == DOCUMENT
        assert listener.accepted == 3
        assert time.monotonic() - began < 2.0
    finally:
        listener.close()


def test_a_producer_that_always_closes_first_fails_after_the_bounded_reconnects() -> None:
    listener = ClosingListener(closes=10 ** 6)
    try:
        began = time.monotonic()
        # whether our request met the closed connection (a reset) or its end (EOF), the same reason
        with pytest.raises(PeerMetadataError, match=rf"closed the connection before its handshake was complete "
                                                    rf"\(.*asked {1 + MAX_RECONNECTS} times\)"):
            fetch_handshake("127.0.0.1", listener.port, 5.0)
        assert listener.accepted == 1 + MAX_RECONNECTS
        assert time.monotonic() - began < 2.0  # refused by the bound on reconnects, not at the deadline
    finally:
        listener.close()
