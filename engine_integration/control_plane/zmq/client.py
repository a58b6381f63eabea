"""A client of the coordinator: submit prompts, collect results in input order."""

from __future__ import annotations

import itertools
import time
from typing import Optional, Sequence

from engine_integration.control_plane.base import GenerationClient, GenerationResult
from engine_integration.control_plane.zmq import wire
from engine_integration.control_plane.zmq.channel import ClientChannel, resolve_secret

__all__ = ["CoordinatorClient", "GenerationResult"]


class CoordinatorClient(GenerationClient):
    """Results are matched by id, so ``stats()`` may be called while requests are in flight.

    The connection is encrypted and replay-proof (``channel``); with no
    ``secret``/``secret_file``/``$KVXFER_SECRET_FILE`` it refuses to start unless
    ``insecure=True`` is asked for.
    """

    def __init__(self, address: str, *, secret: Optional[str] = None, secret_file: Optional[str] = None,
                 insecure: bool = False, handshake_timeout_s: float = 10.0) -> None:
        key = resolve_secret(secret, secret_file=secret_file, insecure=insecure, who="coordinator client")
        self.channel = ClientChannel(address, key, handshake_timeout_s=handshake_timeout_s)
        self.sock = self.channel.sock
        self._ids = itertools.count(1)
        self._results: dict[int, GenerationResult] = {}  # arrived, not yet collected

    def _receive(self, timeout_ms: int) -> Optional[wire.Msg]:
        """One message (a ``Result`` is filed under its id and returned too), or None."""
        if not self.sock.poll(timeout_ms):
            return None
        msg = self.channel.receive()
        if isinstance(msg, wire.Result):
            self._results[msg.client_request_id] = GenerationResult(
                tuple(msg.tokens) if msg.tokens is not None else None, msg.error, dict(msg.timings),
                msg.cached_prefix_blocks, msg.pulled_blocks, msg.decode)
        return msg

    def submit(self, prompt: Sequence[int], max_new_tokens: int) -> int:
        cid = next(self._ids)
        self.channel.send(wire.Submit(cid, list(prompt), max_new_tokens))
        return cid

    def collect(self, ids: Sequence[int], timeout_s: float) -> list[GenerationResult]:
        """Results for ``ids`` in that order; one not back within ``timeout_s`` is an error."""
        deadline = time.monotonic() + timeout_s
        while not all(i in self._results for i in ids):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._receive(int(min(left, 1.0) * 1000) + 1)
        missing = GenerationResult(None, f"no result from the coordinator within {timeout_s}s")
        return [self._results.pop(i, missing) for i in ids]

    def stats(self, timeout_s: float = 10.0) -> wire.Stats:
        self.channel.send(wire.StatsRequest())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self._receive(100)
            if isinstance(msg, wire.Stats):
                return msg
        raise TimeoutError(f"no stats from the coordinator within {timeout_s}s")

    def shutdown(self, reason: str = "client asked") -> None:
        self.channel.send(wire.Shutdown(reason))

    def close(self) -> None:
        self.channel.close()
