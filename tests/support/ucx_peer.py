"""The prefill (source) side of the UCX tests, run in its own OS process.

A separate process is the point: one-sided reads must cross a process
boundary, and killing the source must be a real SIGKILL. The parent talks to it
over a multiprocessing Pipe; every command gets one reply.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch


def make_pool(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The deterministic pool contents both sides can compute."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).contiguous()


def source_main(conn: Any, shape: tuple[int, ...], dtype_names: list[str], num_blocks: int, seed: int,
                env: dict[str, str]) -> None:
    """Register one pool per dtype (pool i uses seed + i), report metas, then serve commands. ``env``: set
    each variable, or unset it where the value is "" (a forkserver child inherits the environment the
    server started with, not the test's current one: a ``UCX_TLS=tcp`` of an earlier test would stay)."""
    for name, value in env.items():
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
    from kvxfer.backends.ucx import binding as _ucp
    from kvxfer.backends.ucx.backend import UcxBackend

    backends = [UcxBackend(f"prefill-{os.getpid()}-{name}", make_pool(shape, getattr(torch, name), seed + i), num_blocks)
                for i, name in enumerate(dtype_names)]
    done: list[Any] = []
    failed: list[tuple[Any, str]] = []

    def collect() -> None:
        for backend in backends:
            done.extend(backend.drain_read_done())
            failed.extend((f.request_id, f.reason) for f in backend.drain_read_failed())

    conn.send(("ready", [b.export_meta() for b in backends], os.getpid()))
    while True:
        if not conn.poll(0.005):
            collect()
            continue
        command = conn.recv()
        if command == "drain":
            deadline = time.monotonic() + 0.05
            while time.monotonic() < deadline:  # let notices already on the wire arrive
                collect()
                time.sleep(0.002)
            conn.send((done, failed))
            done, failed = [], []
        elif command == "live":
            conn.send(_ucp.live_objects())
        elif command == "exit":
            for backend in backends:
                backend.close()
            conn.send(_ucp.live_objects())
            return
