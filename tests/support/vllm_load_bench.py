"""The connector-level load benchmark of docs/vllm.md ("What the second round changed"): run by path.

``taskset -c 1 .venv/bin/python -m tests.support.vllm_load_bench [--loads N] [--sleep-ms MS] [--json FILE]``

A decode ``Receiver`` in this process (``tests.support.vllm_support.Decode``) loads 19 blocks (1.2 MiB over
4 layers) from a real source process (``Producer``) over ucx, one load at a time, each submitted and
collected as an engine step does. With ``--sleep-ms`` (default 5) the process sleeps between loads,
so caches and branch predictors are cold as they are between vLLM's steps: that is what reproduces
the handoff times measured inside vLLM (``kvxfer bench-vllm``); ``--sleep-ms 0`` gives the hot loop.
Prints a table of p50/p90 per phase (``Receiver.recent``'s marks) and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import ExitStack

from kvxfer.integrations.vllm.specs import LoadSpec
from tests.support.vllm_support import Decode, Producer

BLOCKS = list(range(19))
LOCAL = list(range(20, 39))


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3


def run(loads: int, sleep_s: float, backend: str = "ucx") -> dict:
    with ExitStack() as stack:
        producer = Producer(stack, backend, blocks=64)
        decode = Decode(stack, backend, blocks=64)
        decode.submit("warm", producer.ticket(BLOCKS, "warm"), LOCAL)
        decode.run_until({"warm"}, 30)
        receiver = decode.receiver
        tickets = [producer.ticket(BLOCKS, f"load-{i}") for i in range(loads)]
        total = []
        for i, params in enumerate(tickets):
            time.sleep(sleep_s)
            began = time.perf_counter()
            receiver.submit(LoadSpec(f"load-{i}", params, tuple(LOCAL), 0, awaiting=True))
            finished, failed = receiver.collect()
            while f"load-{i}" not in finished:
                more, failed = receiver.collect()
                finished |= more
            total.append(time.perf_counter() - began)
            assert not failed, failed
        records = [r for r in receiver.recent if str(r.get("request_id", "")).startswith("load-")]
    phases = {"checked": "checked_s", "data_posted": "data_posted_s", "done": "handoff_s"}
    out = {"backend": backend, "loads": loads, "sleep_ms": sleep_s * 1e3, "bytes": records[0]["bytes"],
           "load_p50_ms": _pct(total, 0.5), "load_p90_ms": _pct(total, 0.9)}
    for name, key in phases.items():
        out[f"{name}_p50_ms"] = _pct([r[key] for r in records], 0.5)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=int, default=200)
    parser.add_argument("--sleep-ms", type=float, default=5.0)
    parser.add_argument("--backend", default="ucx")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = run(args.loads, args.sleep_ms / 1e3, args.backend)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.loads} loads of {result['bytes'] / 2**20:.2f} MiB on {args.backend}, "
                        f"{args.sleep_ms:g} ms between loads")
    for column in ("load p50 ms", "p90", "checked p50", "data posted p50", "done p50"):
        table.add_column(column, justify="right")
    table.add_row(*(f"{result[k]:.3f}" for k in ("load_p50_ms", "load_p90_ms", "checked_p50_ms",
                                                   "data_posted_p50_ms", "done_p50_ms")))
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
