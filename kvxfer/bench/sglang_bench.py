"""``kvxfer bench-sglang``: the same rooms through SGLang's PD queues with kvxfer's backends (``kvxfer_ucx``,
``kvxfer_nixl``) and SGLang's own ``nixl``, in one run, on this machine.

The harness is the SGLang tests' (``kvxfer.drive.sglang_build`` / ``sglang_rank``): one prefill rank and one
decode rank, two processes in the SGLang environment, each holding one manager per target, every manager made
by SGLang's own ``PrefillBootstrapQueue`` / ``DecodePreallocQueue`` (staging off), each target with its own
bootstrap server, port and pool bytes. Per target: one warm-up batch (handshakes, first registrations), then
``batches`` batches of ``rooms`` rooms at once, each room ``pages`` pages sent in ``chunks`` chunks, moved by
SGLang's own queue code (prefill: ``add``, ``pop_bootstrapped``, chunked ``send``, polls; decode: ``add``,
``pop_preallocated``, ``pop_transferred`` committing the first token after SGLang's bootstrap-room check).

Measured on the decode: a room's hand-off, from SGLang's prealloc queue taking the request (``add``) to its
transfer queue committing it (``pop_transferred``: bootstrap, metadata, the prefill's chunks, every read, the aux
row); rooms per second, each batch's rooms over its time from the first ``add`` to the last commit; descriptors
per room: kvxfer's, the decode's reads after kvxfer merged them (aux row and lease reads included); SGLang's
``nixl``, the descriptors its prefill hands NIXL (it writes; NIXL may merge them further). Every room of every
batch is checked byte-exact: every page of every layer and the aux row, by digest.
"""

from __future__ import annotations

import argparse
import logging
import time
from contextlib import ExitStack
from typing import Any, Callable, Optional

from kvxfer.bench.results import percentile
from kvxfer.drive.sglang_control import (SglangRank, SglangRankError, byte_faults, free_port, rank_env, rooms_plan,
                                         sglang_python)

logger = logging.getLogger(__name__)

#: target -> (SGLang's ``--disaggregation-transfer-backend``, what it is)
TARGETS = {
    "kvxfer_ucx": "kvxfer's backend on kvxfer's UCX binding (the decode reads)",
    "kvxfer_nixl": "kvxfer's backend on NIXL (the decode reads)",
    "nixl": "SGLang's own NIXL backend (the prefill writes; KV declared host memory, the control's one change)",
}


def check_args(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Problems with the arguments, as ``(what, how to fix)``; empty when fine."""
    problems = []
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets or len(set(targets)) != len(targets):
        problems.append((f"--targets {args.targets!r} names unknown or repeated targets {unknown}",
                         f"choose from {', '.join(TARGETS)}, each once"))
    if not 1 <= args.rooms <= 8:
        problems.append((f"--rooms {args.rooms} is out of range",
                         "give 1..8 (the ranks' pools hold 8 rooms in flight)"))
    if not 1 <= args.chunks <= args.pages <= 7:
        problems.append((f"--chunks {args.chunks} / --pages {args.pages} are out of range",
                         "1 <= chunks <= pages <= 7 (the ranks' pools: 64 pages, 16 aux rows)"))
    if sglang_python() is None:
        problems.append(("no SGLang environment", "run `bash tools/bootstrap.sh` (it builds .venv-sglang) or set "
                                                  "KVXFER_SGLANG_PYTHON"))
    return problems


def _chunks(pages: int, chunks: int) -> tuple[int, ...]:
    """``pages`` split into ``chunks`` chunks as evenly as can be (the first ones one larger)."""
    return tuple(pages // chunks + (1 if i < pages % chunks else 0) for i in range(chunks))


def _batch(prefill: SglangRank, decode: SglangRank, which: dict, port: int, first_room: int,
           args: argparse.Namespace) -> dict[str, Any]:
    """One batch of rooms through SGLang's queues; its figures and byte check. Source and destination pages are
    in other processes' pools: the plan places both from the pools' start (at most 8 x 7 of their 64 pages)."""
    serve, receive = rooms_plan(first_room, args.rooms, pages_per_room=args.pages,
                                chunks=_chunks(args.pages, args.chunks), src_base=1, dst_base=2)
    prefill.send(op="serve_queued", rooms=serve, timeout=args.timeout, **which)
    received = decode.ask(timeout_s=args.timeout + 30, op="receive_queued", bootstrap=f"127.0.0.1:{port}",
                          rooms=receive, timeout=args.timeout, **which)
    served = prefill.read(timeout_s=args.timeout + 30)
    faults = byte_faults(serve, served, received)
    committed = {r["room"]: received["rooms"][str(r["room"])]["output_ids"] for r in serve}
    faults += [f"room {room}: SGLang committed {ids}, not the aux row's first token"
               for room, ids in committed.items() if ids != [1000 + room]]
    if any(served["left"].values()) or any(received["left"].values()):
        faults.append(f"SGLang's queues left: prefill {served['left']}, decode {received['left']}")
    descriptors = received["descriptors"] if received["descriptors"] is not None else served.get("descriptors")
    rooms = [received["rooms"][str(r["room"])] for r in serve]
    return {"handoffs_s": [r["handoff_s"] for r in rooms if r["handoff_s"] is not None],
            "published_s": [r["published_s"] for r in rooms if r["handoff_s"] is not None and r["published_s"]],
            "elapsed_s": received["elapsed_s"], "descriptors": descriptors, "faults": faults,
            "exact": sum(1 for r in serve if not [f for f in faults if f.startswith(f"room {r['room']}")])}


def run_target(name: str, prefill: SglangRank, decode: SglangRank, port: int, main: bool,
               args: argparse.Namespace) -> dict[str, Any]:
    which = {} if main else {"manager": name}
    if not main:  # SGLang's queue makes the manager now (and, on the prefill, its bootstrap server)
        prefill.ask(op="build", **which)
        decode.ask(op="build", **which)
    warm = _batch(prefill, decode, which, port, 100, args)
    batches = [_batch(prefill, decode, which, port, 200 + 10 * i, args) for i in range(args.batches)]
    handoffs = [h for b in batches for h in b["handoffs_s"]]
    published = [h for b in batches for h in b["published_s"]]
    rooms = args.rooms * args.batches
    elapsed = sum(b["elapsed_s"] for b in batches)
    counted = [b["descriptors"] for b in batches if b["descriptors"] is not None]
    result: dict[str, Any] = {
        "target": name, "what": TARGETS[name], "rooms": rooms,
        "rooms_per_s": rooms / elapsed if elapsed > 0 else None,
        "handoff_p50_ms": 1000 * percentile(handoffs, 50) if handoffs else None,
        "handoff_p99_ms": 1000 * percentile(handoffs, 99) if handoffs else None,
        # the hand-off's first part: until SGLang's prealloc queue published the room's pages to the prefill
        "published_p50_ms": 1000 * percentile(published, 50) if published else None,
        "descriptors_per_room": sum(counted) / (args.rooms * len(counted)) if counted else None,
        "rooms_byte_exact": sum(b["exact"] for b in batches), "warmup_byte_exact": warm["exact"] == args.rooms,
        "faults": [f for b in [warm, *batches] for f in b["faults"]][:20],
    }
    if name.startswith("kvxfer_"):  # kvxfer's own tables are empty once every room is concluded
        sizes = {rank.role: rank.ask(op="sizes", settle_s=0.3 if rank.role == "prefill" else 0.0, **which)["sizes"]
                 for rank in (prefill, decode)}
        if any(v for s in sizes.values() for v in s.values()):
            result["faults"].append(f"kvxfer's tables not empty: {sizes}")
    return result


def run_sglang_bench(args: argparse.Namespace, progress: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """Every target of ``args.targets`` in one pair of SGLang ranks; the report (``render`` prints it)."""
    from kvxfer.bench.machine import describe, load_average

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    ports = {t: free_port() for t in targets}
    further = {t: {"backend": t, "bootstrap_port": ports[t], "seed": 11 + i} for i, t in enumerate(targets[1:])}
    env = rank_env(KVXFER_TRANSFER_TIMEOUT_S=str(max(5, int(args.timeout // 2))))
    report: dict[str, Any] = {"command": "kvxfer bench-sglang", "rooms_per_batch": args.rooms,
                              "batches": args.batches, "pages_per_room": args.pages, "chunks_per_room": args.chunks,
                              "chunk_pages": list(_chunks(args.pages, args.chunks)), "machine": describe(),
                              "results": []}
    progress(f"bench-sglang: starting a prefill and a decode rank ({', '.join(targets)}) ...")
    with ExitStack() as stack:
        ranks = []
        for role in ("prefill", "decode"):
            rank = SglangRank(role, targets[0], ports[targets[0]], env=env, **further)
            stack.callback(rank.close)
            ranks.append(rank)
        started = time.monotonic()
        for rank in ranks:
            rank.ready()
        report["startup_s"] = time.monotonic() - started
        prefill, decode = ranks
        report["sglang"] = prefill.info.get("sglang")
        for i, name in enumerate(targets):
            progress(f"bench-sglang: {name} ({i + 1}/{len(targets)}) ...")
            try:
                report["results"].append(run_target(name, prefill, decode, ports[name], i == 0, args))
            except SglangRankError as exc:
                report["results"].append({"target": name, "what": TARGETS[name], "error": str(exc)[-3000:]})
                break  # a rank that failed a command may hold rooms the next target's would collide with
    report["machine"]["load_average_end"] = load_average()
    return report


def failed_targets(report: dict[str, Any]) -> list[str]:
    """The targets that failed, or whose rooms were not all byte-exact."""
    return [r["target"] for r in report["results"]
            if "error" in r or r["faults"] or r["rooms_byte_exact"] != r["rooms"] or not r["warmup_byte_exact"]]


def render(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"SGLang PD hand-offs through SGLang's queues: {report['batches']} batches of "
                        f"{report['rooms_per_batch']} rooms at once, {report['pages_per_room']} pages in "
                        f"{report['chunks_per_room']} chunks each")
    for column in ("target", "rooms/s", "p50", "p99", "pub p50", "descr", "exact"):
        table.add_column(column, justify="left" if column == "target" else "right", no_wrap=column == "target")

    def fmt(value: Optional[float], spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in report["results"]:
        if "error" in r:
            table.add_row(r["target"], "failed: " + r["error"].splitlines()[0][:70], "", "", "", "", "")
            continue
        table.add_row(r["target"], fmt(r["rooms_per_s"], ".1f"), fmt(r["handoff_p50_ms"], ".1f"),
                      fmt(r["handoff_p99_ms"], ".1f"), fmt(r.get("published_p50_ms"), ".1f"),
                      fmt(r["descriptors_per_room"], ".1f"),
                      f"{r['rooms_byte_exact']}/{r['rooms']}")
    console.print(table)
    console.print("p50, p99: the hand-off in ms on the decode, from SGLang's queue taking the request to committing "
                  "it; pub p50: to its pages published to the prefill; descr: descriptors per room (kvxfer's decode "
                  "reads after merging, SGLang nixl's prefill writes as handed to NIXL); exact: rooms byte-exact",
                  highlight=False)
