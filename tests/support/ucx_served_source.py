"""The processes of ``tests/backends/test_ucx_served_bounds.py``: a ucx source whose reads are served over tcp, and
a reader that asks for reads and then stops (SIGSTOP), never draining what it asked for.

``python tests/support/ucx_served_source.py POOL_MIB OVERRIDES_JSON``: the source. ``OVERRIDES_JSON`` sets
constants of ``kvxfer.backends.ucx.served`` before the backend exists (smaller bounds, so a test can reach
them with a small pool). Prints one JSON line with the meta, then answers each command line on stdin with
one JSON line: ``stats`` (RSS and the source's served-read counters), ``drain`` (read-done ids), ``exit``.

``python tests/support/ucx_served_source.py stall READS ROWS_JSON``: the reader. Reads the source's meta (one JSON
line on stdin), sends READS READ messages of rows ``ROWS_JSON`` with its token, progresses until UCX sent
them, prints ``{"sent": READS}`` and stops itself.
"""

from __future__ import annotations

import json
import os
import sys


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def stall(reads: int, rows_json: str) -> None:
    import base64
    import signal
    import struct
    import time

    import numpy as np

    from kvxfer.backends.ucx import binding as _ucp
    from kvxfer.backends.ucx import served

    meta = json.loads(sys.stdin.readline())
    token, address = base64.b64decode(meta["ucx_read_token"]), base64.b64decode(meta["ucx_worker_address"])
    context = _ucp.Context()
    worker = _ucp.Worker(context, 0x4B5E)
    endpoint = _ucp.Endpoint(worker, address, lambda ep, status: None, True)
    worker.set_am_handler(served.DATA_AM_ID, lambda *args: None)
    rows = np.ascontiguousarray(json.loads(rows_json), dtype=np.uint64)
    requests = [_ucp.send_request(endpoint, served.READ_AM_ID, struct.pack("<16sQQ", token, batch, 0), data=rows,
                                  reply=True) for batch in range(1, reads + 1)]
    deadline = time.monotonic() + 30
    while any(r is not None for r in requests) and time.monotonic() < deadline:
        worker.progress()
        requests = [r if r is not None and _ucp.in_progress(_ucp.request_status(worker, r)) else None
                    for r in requests]
    print(json.dumps({"sent": reads}), flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # a reader that asked and never drains (until SIGCONT or SIGKILL)
    time.sleep(3600)


def main() -> None:
    if sys.argv[1] == "stall":
        return stall(int(sys.argv[2]), sys.argv[3])
    pool_mib, overrides = int(sys.argv[1]), json.loads(sys.argv[2])
    import torch

    from kvxfer.backends.ucx import served
    from kvxfer.backends.ucx.backend import UcxBackend

    for name, value in overrides.items():
        setattr(served, name, value)
    blocks = 64
    # [2, L, B, T, H, d] float32: pool_mib MiB, deterministic bytes the reader can recompute
    shape = (2, 4, blocks, 16, pool_mib, 32)  # 2 x 4 x 64 x 16 x 32 x 4 B = 1 MiB per unit of the heads axis
    pool = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64).to(torch.float32).reshape(shape)
    backend = UcxBackend(f"served-src-{os.getpid()}", pool, blocks)
    stats = getattr(served, "server_stats", lambda: [])
    print(json.dumps({"meta": backend.export_meta(), "pid": os.getpid(), "shape": shape,
                      "rss_mib": rss_mib()}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "stats":
            print(json.dumps({"rss_mib": rss_mib(), "served": stats()}), flush=True)
        elif command == "drain":
            print(json.dumps({"done": [str(r) for r in backend.drain_read_done()]}), flush=True)
        elif command == "exit":
            break
    backend.close()
    print(json.dumps({"closed": True}), flush=True)


if __name__ == "__main__":
    main()
