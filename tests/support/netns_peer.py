"""One side of the cross-namespace tests, run inside its own network namespace.

Started as ``ip netns exec NS python -m tests.support.netns_peer ROLE SOCKET BACKEND``;
the test drives it over a Unix socket (filesystem sockets cross namespaces,
TCP between them goes over the veth link under test). Every command gets a reply.
"""

from __future__ import annotations

import sys
import time
from multiprocessing.connection import Listener
from typing import Any

import numpy as np
import torch

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.errors import KVXferError

SHAPE = (2, 8, 512, 16, 8, 64)  # float32: 256 MiB per pool, enough to cut a transfer mid-way
NUM_BLOCKS = SHAPE[2]
AUTHKEY = b"kvxfer-netns-test"


def source_pool() -> torch.Tensor:
    """Deterministic contents both sides can compute: no data has to cross the control channel."""
    return (torch.arange(int(np.prod(SHAPE)), dtype=torch.int64) % 16777213).to(torch.float32).view(SHAPE)


def serve(role: str, socket_path: str, backend_name: str) -> None:
    cls = construct_kv_transfer_backend_class(backend_name)
    pool = source_pool() if role == "prefill" else torch.full(SHAPE, -1.0)
    backend = cls(f"netns-{role}", pool, NUM_BLOCKS, timeout_s=5.0)
    expected = source_pool() if role == "decode" else None
    handles: dict[Any, Any] = {}
    failed: dict[Any, Any] = {}
    with Listener(socket_path, family="AF_UNIX", authkey=AUTHKEY) as listener, listener.accept() as conn:
        conn.send(("ready", backend.export_meta() if role == "prefill" else None))
        while True:
            if not conn.poll(120):
                return
            command, *args = conn.recv()
            if command == "quit":
                backend.close()
                conn.send(("bye",))
                return
            if command == "drain":
                conn.send((backend.drain_read_done(), [f.request_id for f in backend.drain_read_failed()]))
            elif command == "pull":
                meta, src, dst, rid = args
                try:
                    handles[rid] = (backend.begin_pull_blocks(meta, src, dst, request_id=rid), src, dst)
                    conn.send(("posted",))
                except KVXferError as exc:
                    conn.send(("error", type(exc).__name__, str(exc)))
            elif command == "wait":
                rid, = args
                handle, src, dst = handles.pop(rid)
                start = time.monotonic()
                try:
                    handle.wait()
                except KVXferError as exc:
                    failed[rid] = (handle, dst)
                    conn.send(("failed", type(exc).__name__, str(exc), time.monotonic() - start, handle.storage_safe,
                               isinstance(exc, TimeoutError)))
                    continue
                exact = torch.equal(pool[:, :, dst], expected[:, :, src])
                conn.send(("done", exact, handle.elapsed_s))
            elif command == "settle":
                # A failed pull: once storage_safe, no byte may land any more, and wait() must no
                # longer raise a TimeoutError (Megatron's waiter then frees the blocks).
                rid, timeout_s = args
                handle, dst = failed.pop(rid)
                start = time.monotonic()
                while not handle.storage_safe and time.monotonic() - start < timeout_s:
                    time.sleep(0.05)
                settled_after = time.monotonic() - start
                before = pool[:, :, dst].clone()
                time.sleep(1.0)
                try:
                    handle.wait()
                    frees = True
                except Exception as exc:  # noqa: BLE001 - Megatron's reading of it
                    frees = not isinstance(exc, TimeoutError)
                conn.send((handle.storage_safe, settled_after, torch.equal(before, pool[:, :, dst]), frees))


if __name__ == "__main__":
    serve(*sys.argv[1:4])
