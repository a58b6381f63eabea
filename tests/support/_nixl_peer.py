"""The prefill side of the NIXL tests, run in its own OS process.

``serve`` registers one pool per spec (the first as the main backend, the rest as
siblings sharing its agent), sends every ``export_meta()`` to the test over a
``multiprocessing`` pipe, then answers commands until told to stop. Pool
contents are random bytes from a seed, so the decode side can rebuild the
expected pool (``make_pool``) and check every byte without shipping it.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class PoolSpec:
    shape: tuple[int, ...]
    dtype: str  # torch dtype name
    seed: int
    kv_dims: bool = True  # pass tokens_per_block / heads_per_partition / head_dim

    @property
    def num_blocks(self) -> int:
        return self.shape[2]

    def kwargs(self) -> dict[str, Any]:
        if not self.kv_dims:
            return {}
        return {"tokens_per_block": self.shape[3], "heads_per_partition": self.shape[4], "head_dim": self.shape[5]}


def make_pool(spec: PoolSpec) -> torch.Tensor:
    """Random *bytes* (every bit pattern of every dtype), reproducible from the seed."""
    pool = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
    flat = pool.view(torch.uint8).view(-1)
    gen = torch.Generator().manual_seed(spec.seed)
    flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=gen))
    return pool


def serve(conn: Any, agent_name: str, specs: list[PoolSpec], timeout_s: float = 30.0) -> None:
    from kvxfer.backends import construct_kv_transfer_backend_class

    cls = construct_kv_transfer_backend_class("nixl")
    pools = [make_pool(s) for s in specs]
    main = cls(agent_name, pools[0], specs[0].num_blocks, timeout_s=timeout_s, **specs[0].kwargs())
    backends = [main] + [
        main.new_registered_buffer(memory_buffer=p, expected_num_blocks=s.num_blocks, **s.kwargs())
        for p, s in zip(pools[1:], specs[1:])
    ]
    conn.send(("ready", [b.export_meta() for b in backends]))
    while True:
        if not conn.poll(120):
            break  # the test died: do not linger
        cmd, arg = conn.recv()
        if cmd == "drain":
            b = backends[arg]
            conn.send((b.drain_read_done(), [(f.request_id, f.reason) for f in b.drain_read_failed()],
                       b.garbage_notifications))
        elif cmd == "stop":
            for b in reversed(backends):
                b.close()
            conn.send(("stopped", None))
            break


class Peer:
    """Handle on a spawned source process."""

    def __init__(self, agent_name: str, specs: list[PoolSpec], timeout_s: float = 30.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.specs = specs
        self.process = ctx.Process(target=serve, args=(child, agent_name, specs, timeout_s), daemon=True)
        self.process.start()
        child.close()
        self._metas: Optional[list[dict[str, Any]]] = None

    @property
    def metas(self) -> list[dict[str, Any]]:
        """The peer's ``export_meta()``s; waits for it to start (peers start in parallel)."""
        if self._metas is None:
            reply = self.call(None, timeout=90)
            assert reply[0] == "ready", reply
            self._metas = reply[1]
        return self._metas

    def call(self, cmd: Optional[tuple[str, Any]], timeout: float = 20) -> Any:
        if cmd is not None:
            # the peer's first message is its "ready": a command sent before it was read would be
            # answered by it (a test selected alone, whose first call is a command, read "ready" as a reply)
            _ = self.metas
            self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd!r} within {timeout}s")
        return self.conn.recv()

    def drain(self, index: int = 0) -> tuple[list, list, int]:
        return self.call(("drain", index))

    def request_stop(self) -> None:
        """Ask the peer to close and exit (without waiting: peers stop in parallel)."""
        if self.process.is_alive():
            try:
                self.conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass

    def stop(self) -> None:
        self.request_stop()
        if self.process.is_alive():
            try:
                self.call(None, timeout=20)
            except (TimeoutError, EOFError, BrokenPipeError, OSError):
                pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
