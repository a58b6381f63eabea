"""Compare kvxfer's UCX pull with ``ucx_perftest -t ucp_get`` at the same message size.

Both run back to back on 127.0.0.1, per transport setting, so the numbers say how
much of UCX's own get bandwidth kvxfer keeps (and where the rest goes: Python per
request, the read-done AM, peer error handling).

    python tools/ucx_compare.py --size 1048576 --iters 1000

Settings compared (each side the same):
  shm/cma     UCX_TLS default, no peer error handling  (perftest default; kvxfer peer_error_handling=False)
  default -e  UCX_TLS default, peer error handling     (perftest -e;      kvxfer default)
  tcp -e      UCX_TLS=tcp, peer error handling         (perftest -e;      kvxfer default)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

SETTINGS = [("shm/cma", None, False), ("default -e", None, True), ("tcp -e", "tcp", True)]
POOL_BLOCKS = 64  # source and destination pools hold 64 messages each (reads cycle through them)


def libucx_dir() -> Path:
    import libucx

    return Path(libucx.__file__).resolve().parent


def perftest(size: int, iters: int, tls: Optional[str], error_handling: bool, port: int) -> dict[str, float]:
    """Run ucx_perftest server + client; return the client's Final line."""
    root = libucx_dir()
    env = dict(os.environ, LD_LIBRARY_PATH=str(root / "lib"))
    env.pop("UCX_TLS", None)
    if tls:
        env["UCX_TLS"] = tls
    exe = str(root / "bin" / "ucx_perftest")
    server = subprocess.Popen([exe, "-p", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        args = [exe, "127.0.0.1", "-p", str(port), "-t", "ucp_get", "-s", str(size), "-n", str(iters), "-w", "20", "-f"]
        if error_handling:
            args.append("-e")
        out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300).stdout
    finally:
        server.wait(timeout=30)
    rows = [line.split() for line in out.splitlines()]
    final = [row for row in rows if len(row) == 8 and all(_is_number(x) for x in row)]  # the -f result row
    if not final:
        raise RuntimeError(f"ucx_perftest printed no result row:\n{out}")
    f = final[-1]
    return {"lat50_us": float(f[1]), "lat_avg_us": float(f[2]), "bw_MBps": float(f[5])}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _source(conn: Any, size: int, tls: Optional[str]) -> None:
    if tls:
        os.environ["UCX_TLS"] = tls
    import torch

    from kvxfer.backends.ucx.backend import UcxBackend

    pool = torch.randn(POOL_BLOCKS, size // 4)
    with UcxBackend("bench-src", pool, POOL_BLOCKS) as backend:
        conn.send(backend.export_meta())
        while not conn.poll(0.01):
            backend.drain_read_done()


def kvxfer_pull(size: int, iters: int, tls: Optional[str], error_handling: bool, batch: int) -> dict[str, float]:
    """``iters`` reads of ``size`` bytes, ``batch`` non-adjacent blocks per request (no coalescing)."""
    import torch

    from kvxfer.backends.ucx.backend import UcxBackend

    os.environ.pop("UCX_TLS", None)
    if tls:
        os.environ["UCX_TLS"] = tls
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_source, args=(child, size, tls), daemon=True)
    proc.start()
    meta = parent.recv()
    try:
        pool = torch.zeros(POOL_BLOCKS, size // 4)
        with UcxBackend("bench-dst", pool, POOL_BLOCKS, peer_error_handling=error_handling) as dst:
            ids = list(range(0, POOL_BLOCKS, 2))[:batch]
            dst.begin_pull_blocks(meta, ids, ids).wait()  # connect and warm up
            requests = max(1, iters // batch)
            start = time.perf_counter()
            for _ in range(requests):
                dst.begin_pull_blocks(meta, ids, ids).wait()
            elapsed = time.perf_counter() - start
        moved = requests * len(ids) * size
        return {"bw_MBps": moved / elapsed / 1e6, "per_request_us": elapsed / requests * 1e6}
    finally:
        parent.send("stop")
        proc.join(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--port", type=int, default=13437)
    args = parser.parse_args()
    print(f"message size {args.size} B, {args.iters} gets per run, 127.0.0.1")
    print(f"{'setting':12} {'perftest MB/s':>14} {'lat50 us':>9} {'kvxfer 1/req MB/s':>18} {'us/req':>8} "
          f"{'kvxfer 32/req MB/s':>19}")
    for i, (label, tls, eh) in enumerate(SETTINGS):
        pt = perftest(args.size, args.iters, tls, eh, args.port + i)
        one = kvxfer_pull(args.size, args.iters, tls, eh, batch=1)
        many = kvxfer_pull(args.size, args.iters, tls, eh, batch=32)
        print(f"{label:12} {pt['bw_MBps']:14.0f} {pt['lat50_us']:9.1f} {one['bw_MBps']:18.0f} "
              f"{one['per_request_us']:8.0f} {many['bw_MBps']:19.0f}", flush=True)


if __name__ == "__main__":
    main()
