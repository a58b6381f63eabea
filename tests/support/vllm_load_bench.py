"""The connector-level load benchmark of docs/vllm.md ("What the second round changed"): run by path.

``taskset -c 1 .venv/bin/python -m tests.support.vllm_load_bench [--loads N] [--sleep-ms MS] [--split] [--json FILE]``

A decode ``Receiver`` in this process (``tests.support.vllm_support.Decode``) loads 19 blocks (1.2 MiB over
4 layers) from a real source process (``Producer``) over ucx, one load at a time, each submitted and
collected as an engine step does. With ``--sleep-ms`` (default 5) the process sleeps between loads,
so caches and branch predictors are cold as they are between vLLM's steps: that is what reproduces
the handoff times measured inside vLLM (``kvxfer bench-vllm``); ``--sleep-ms 0`` gives the hot loop.
Prints a table of p50/p90 per phase (``Receiver.recent``'s marks) and writes them as JSON.

``--split`` (ucx) also divides the chained post (``UcxBackend.begin_chained_pull``) into its Python and
UCX's progress inside it (on one host UCX's ``cma`` copies there), and on every other load first copies
the same rows with one ``process_vm_readv`` from the source process, timed alone: the kernel's floor for
those bytes, cold as UCX's copy is on the loads between. The wrappers it installs are measurement only.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import time
from contextlib import ExitStack
from typing import Any, Callable

from kvxfer.integrations.vllm.specs import LoadSpec
from tests.support.cma_floor_bench import Iovec
from tests.support.vllm_support import Decode, Producer

BLOCKS = list(range(19))
LOCAL = list(range(20, 39))


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3


def _split_post(stack: ExitStack) -> dict[str, list[float]]:
    """Time each chained post, the UCX progress inside it and (every other load) one ``process_vm_readv`` of
    its rows, by wrapping ``Worker.progress`` and ``UcxBackend.begin_chained_pull`` until ``stack`` closes."""
    from kvxfer.backends.ucx import backend as ucx_backend
    from kvxfer.backends.ucx import binding

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    times: dict[str, list[float]] = {"post": [], "progress": [], "readv": []}
    inside: list[float] = []
    progress, post = binding.Worker.progress, ucx_backend.UcxBackend.begin_chained_pull

    def timed_progress(worker: Any) -> None:
        began = time.perf_counter()
        progress(worker)
        inside.append(time.perf_counter() - began)

    def timed_post(backend: Any, peer_meta: Any, src: list[int], dst: list[int], guard: Any, **kw: Any) -> Any:
        if len(times["post"]) % 2:  # the kernel's floor: the same rows, one call, before UCX copies them
            src_off, dst_off, lengths = backend._copier_for(peer_meta).rows(src, dst)
            pid = backend._peers[peer_meta.peer.transport.address].watch.pid
            remote, local = peer_meta.peer.geometry.buf_ptr, backend.geometry.buf_ptr
            n = len(lengths)
            local_iov = (Iovec * n)(*[Iovec(local + o, k) for o, k in zip(dst_off, lengths)])
            remote_iov = (Iovec * n)(*[Iovec(remote + o, k) for o, k in zip(src_off, lengths)])
            began = time.perf_counter()
            copied = libc.process_vm_readv(pid, local_iov, n, remote_iov, n, 0)
            times["readv"].append(time.perf_counter() - began)
            assert copied == sum(lengths), (copied, ctypes.get_errno())
            times["post"].append(float("nan"))  # this load's UCX copy reads warm bytes: not counted
            times["progress"].append(float("nan"))
            return post(backend, peer_meta, src, dst, guard, **kw)
        del inside[:]
        began = time.perf_counter()
        handle = post(backend, peer_meta, src, dst, guard, **kw)
        times["post"].append(time.perf_counter() - began)
        times["progress"].append(sum(inside))
        return handle

    def restore(cls: Any, name: str, value: Callable[..., Any]) -> None:
        stack.callback(setattr, cls, name, value)

    binding.Worker.progress = timed_progress  # type: ignore[method-assign]
    ucx_backend.UcxBackend.begin_chained_pull = timed_post  # type: ignore[method-assign]
    restore(binding.Worker, "progress", progress)
    restore(ucx_backend.UcxBackend, "begin_chained_pull", post)
    return times


def run(loads: int, sleep_s: float, backend: str = "ucx", split: bool = False) -> dict:
    with ExitStack() as stack:
        split_times = _split_post(stack) if split else None
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
    if split_times is not None:  # load i's post is the (i + 1)th: the even loads copied twice, left out
        total = total[1::2]
        records = [r for r in records if int(r["request_id"].split("-")[1]) % 2]
    phases = {"checked": "checked_s", "data_posted": "data_posted_s", "done": "handoff_s"}
    out = {"backend": backend, "loads": loads, "sleep_ms": sleep_s * 1e3, "bytes": records[0]["bytes"],
           "load_p50_ms": _pct(total, 0.5), "load_p90_ms": _pct(total, 0.9)}
    for name, key in phases.items():
        out[f"{name}_p50_ms"] = _pct([r[key] for r in records], 0.5)
    if split_times is not None:  # the warm-up's post is the first; nan: a load copied by readv first
        posts = [(p, q) for p, q in zip(split_times["post"][1:], split_times["progress"][1:]) if p == p]
        out["post_p50_ms"] = _pct([p for p, _ in posts], 0.5)
        out["post_ucx_progress_p50_ms"] = _pct([q for _, q in posts], 0.5)
        out["post_python_p50_ms"] = _pct([p - q for p, q in posts], 0.5)
        out["readv_floor_p50_ms"] = _pct(split_times["readv"], 0.5)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=int, default=200)
    parser.add_argument("--sleep-ms", type=float, default=5.0)
    parser.add_argument("--backend", default="ucx")
    parser.add_argument("--split", action="store_true", help="ucx: the chained post's Python, UCX's progress "
                        "inside it and one process_vm_readv of the same rows")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.split and args.backend != "ucx":
        parser.error("--split measures the ucx backend's chained post: use --backend ucx")
    result = run(args.loads, args.sleep_ms / 1e3, args.backend, args.split)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.loads} loads of {result['bytes'] / 2**20:.2f} MiB on {args.backend}, "
                        f"{args.sleep_ms:g} ms between loads")
    for column in ("load p50 ms", "p90", "checked p50", "data posted p50", "done p50"):
        table.add_column(column, justify="right")
    table.add_row(*(f"{result[k]:.3f}" for k in ("load_p50_ms", "load_p90_ms", "checked_p50_ms",
                                                   "data_posted_p50_ms", "done_p50_ms")))
    Console().print(table)
    if args.split:
        split = Table(title="the chained post, split (p50 ms)")
        for column in ("post", "its Python", "UCX progress (copy)", "one process_vm_readv of its rows"):
            split.add_column(column, justify="right")
        split.add_row(*(f"{result[k]:.3f}" for k in ("post_p50_ms", "post_python_p50_ms",
                                                      "post_ucx_progress_p50_ms", "readv_floor_p50_ms")))
        Console().print(split)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
