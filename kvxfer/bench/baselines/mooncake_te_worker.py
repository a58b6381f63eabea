"""One side of the Mooncake baseline, as a standalone script (stdlib + mooncake only).

It runs under whichever interpreter has ``mooncake`` installed (which need not have
torch or kvxfer), and takes JSON commands, one per line, on stdin; each answer is one
JSON line on stdout. Roles: ``source`` owns a random pool and computes digests of
blocks; ``reader`` owns a destination pool and runs ``batch_transfer_sync_read``.
Both use the TCP transport with the peer-to-peer handshake (no metadata server).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent

SENTINEL = 0xA5


class Pool:
    def __init__(self, engine: Any, num_bytes: int, seed: Optional[int]) -> None:
        self.buf = ctypes.create_string_buffer(num_bytes)
        self.addr = ctypes.addressof(self.buf)
        self.size = num_bytes
        if seed is None:
            ctypes.memset(self.addr, SENTINEL, num_bytes)
        else:
            data = random.Random(seed).randbytes(num_bytes)
            ctypes.memmove(self.addr, data, num_bytes)
        if engine.register_memory(self.addr, num_bytes) != 0:
            raise RuntimeError("mooncake register_memory failed")

    def digest(self, ids: list[int], num_outer: int, num_blocks: int, slice_bytes: int) -> str:
        """SHA-256 of the blocks' slices, outer-major then id order (as kvxfer.harness.loopback.blocks_digest)."""
        view = memoryview(self.buf).cast("B")
        h = hashlib.sha256()
        for outer in range(num_outer):
            base = outer * num_blocks * slice_bytes
            for block in ids:
                start = base + block * slice_bytes
                h.update(view[start:start + slice_bytes])
        return h.hexdigest()


def main() -> None:
    role = sys.argv[1]
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # our own modules are not mooncake
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake TransferEngine.initialize failed")
    pool: Optional[Pool] = None
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "setup":
                if pool is not None:
                    engine.unregister_memory(pool.addr)
                pool = Pool(engine, cmd["pool_bytes"], cmd.get("seed") if role == "source" else None)
                out: dict[str, Any] = {"addr": pool.addr, "session": f"127.0.0.1:{engine.get_rpc_port()}"}
            elif cmd["cmd"] == "digest":
                assert pool is not None
                out = {"digest": pool.digest(cmd["ids"], cmd["num_outer"], cmd["num_blocks"], cmd["slice"])}
            elif cmd["cmd"] == "read":
                assert pool is not None
                verify = cmd.get("verify")
                if verify:
                    ctypes.memset(pool.addr, SENTINEL, pool.size)
                t0 = time.perf_counter()
                local = [pool.addr + off for off in cmd["dst_off"]]
                remote = [cmd["remote"] + off for off in cmd["src_off"]]
                t1 = time.perf_counter()
                rc = engine.batch_transfer_sync_read(cmd["session"], local, remote, cmd["len"])
                t2 = time.perf_counter()
                out = {"rc": rc, "build_ms": (t1 - t0) * 1e3, "transfer_ms": (t2 - t0) * 1e3}
                if verify:
                    out["digest"] = pool.digest(verify["ids"], verify["num_outer"], verify["num_blocks"], verify["slice"])
            elif cmd["cmd"] == "close":
                print(json.dumps({"ok": True}), flush=True)
                break
            else:
                raise ValueError(f"unknown command {cmd['cmd']!r}")
        except Exception as exc:  # answered, so the driver records it on the point
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
    if pool is not None:
        engine.unregister_memory(pool.addr)


if __name__ == "__main__":
    main()
