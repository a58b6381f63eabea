"""``kvxfer bench-prefix-routing``: what prefix-aware routing saves on a shared-prefix workload.

A small real fleet per run (``engine_integration.launch.DisaggCluster``: one prefill and two
decode processes of the reference engine, on a real transport, ``ucx`` by default) on each
control plane asked for (the ZeroMQ coordinator; etcd, a private one started here). Each plane
runs twice, each time on a fresh fleet (empty caches): with prefix-aware routing
(``policy.pick_decode``'s default) and with it off (least loaded only: the coordinator's
``prefix_routing``, etcd's ``prefix_routing=0``).

The workload: ``--families`` prompt families, each a shared prefix of ``--prefix-tokens``
tokens, and ``--requests`` requests per family, each the family's prefix plus a suffix of its
own. It runs in rounds: one request of every family at once, in a shuffled order (the same
seeded order for both modes), the next round when the last one is answered; so a family's
earlier request has finished and left its prefix cached before the next one is routed.
The decode pools (``--decode-blocks``) hold the running requests and about half the families'
prefixes each: prefix-aware routing keeps each family on one decode, so each caches only its
own families; least-loaded routing spreads every family over both, and the pools evict.

Measured per run, from what the decodes report for each request (``GenerationResult``):
hit rate (requests that reused a cached prefix; the first request of each family never can),
prompt blocks reused and pulled, bytes pulled and saved (blocks x the KV bytes of one block),
p50 of the pull (decode: post -> complete) and, on the coordinator, of the handoff (prefill
done -> decode committed); and whether every token equals co-located generation. Prints a
table and writes JSON. Times on this shared machine are orders of magnitude; the counts are
exact.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any, Optional, Sequence

PLANES = ("zmq", "etcd")
#: a private, secured etcd started by the launcher (demo mode); short lease and poll, as the tests use
ETCD_URL = "etcd:///fleet-prefix?ttl=2&poll=0.1"


def check_args(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Problems with the arguments, as ``(what, how to fix)``; empty when fine."""
    from engine_integration.reference.config import ModelConfig
    from kvxfer.backends import construct_kv_transfer_backend_class
    from kvxfer.errors import BackendUnavailableError

    problems = []
    planes = [p.strip() for p in args.planes.split(",") if p.strip()]
    if not planes or any(p not in PLANES for p in planes):
        problems.append((f"--planes {args.planes!r}", f"choose from {', '.join(PLANES)}"))
    for name in ("families", "requests", "prefix_tokens", "suffix_tokens", "new_tokens", "decode_blocks"):
        if getattr(args, name) < 1:
            problems.append((f"--{name.replace('_', '-')} {getattr(args, name)}", "give a number >= 1"))
    try:  # the decodes run in processes of their own: the transport must read another process's pool
        if not construct_kv_transfer_backend_class(args.backend).reads_other_processes:
            problems.append((f"--backend {args.backend}", "the decodes run in processes of their own: choose a "
                                                          "cross-process transport (ucx, nixl)"))
    except BackendUnavailableError as exc:
        problems.append((f"--backend {args.backend}: {exc}", "choose a cross-process transport (ucx, nixl)"))
    tpb = ModelConfig().tokens_per_block
    if args.prefix_tokens % tpb:
        problems.append((f"--prefix-tokens {args.prefix_tokens}",
                         f"give a multiple of the block size ({tpb} tokens): only full blocks are cached"))
    need = -(-(args.prefix_tokens + args.suffix_tokens + args.new_tokens - 1) // tpb)
    if need > args.decode_blocks:
        problems.append((f"--decode-blocks {args.decode_blocks}", f"a request holds {need} blocks: give at least that"))
    return problems


# --- the workload ------------------------------------------------------------------------------
def workload(families: int, requests: int, prefix_tokens: int, suffix_tokens: int,
             seed: int) -> list[list[tuple[int, list[int]]]]:
    """Rounds of ``(family, prompt)``: one request of each family per round, in a seeded shuffled order."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(prefix_tokens)] for _ in range(families)]
    rounds = []
    for _ in range(requests):
        order = list(range(families))
        rng.shuffle(order)
        rounds.append([(f, prefixes[f] + [rng.randrange(256) for _ in range(suffix_tokens)]) for f in order])
    return rounds


def block_bytes() -> int:
    """KV bytes of one block of the reference model's pool (``[2, L, B, T, H, d]``, one B)."""
    import torch

    from engine_integration.reference.config import ModelConfig

    model = ModelConfig()
    shape = model.kv_pool_shape(1)
    n = 1
    for dim in shape:
        n *= dim
    return n * torch.empty((), dtype=getattr(torch, model.dtype)).element_size()


def _p50(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def run_one(plane: str, prefix_routing: bool, rounds: list[list[tuple[int, list[int]]]], args: argparse.Namespace,
            reference: dict[tuple[int, ...], tuple[int, ...]], progress=print) -> dict[str, Any]:
    """One fresh fleet, the whole workload; the figures of this (plane, mode)."""
    from engine_integration.launch import ClusterConfig, DisaggCluster

    config = ClusterConfig(backend=args.backend, decode_blocks=args.decode_blocks, prefill_blocks=1024,
                           request_timeout_s=60.0, prefix_routing=prefix_routing,
                           control_plane=ETCD_URL if plane == "etcd" else None)
    mode = "prefix-aware" if prefix_routing else "least-loaded"
    t0 = time.monotonic()
    with DisaggCluster(config) as cluster:
        cluster.start_engine(cluster.spec("decode", "decode-1"))
        cluster.wait_for_stats(lambda s: all(s.engines.get(d, {}).get("alive") and "free_blocks" in s.engines[d]
                                             for d in ("decode-0", "decode-1")), timeout_s=60)
        warm = cluster.generate([[1], [2]], 1, timeout_s=60)   # transport endpoints, not counted
        if not all(r.ok for r in warm):
            raise RuntimeError(f"warm-up failed: {[r.error for r in warm]}")
        started = time.monotonic()
        rows = []
        for round_ in rounds:
            results = cluster.generate([p for _, p in round_], args.new_tokens, timeout_s=60)
            rows += [(family, prompt, result) for (family, prompt), result in zip(round_, results)]
        elapsed = time.monotonic() - started
    failed = [r.error for _, _, r in rows if not r.ok]
    ok = [(f, p, r) for f, p, r in rows if r.ok]
    per_block = block_bytes()
    cached = sum(r.cached_prefix_blocks for _, _, r in ok)
    pulled = sum(r.pulled_blocks for _, _, r in ok)
    homes: dict[int, set] = {}
    for family, _, r in ok:
        homes.setdefault(family, set()).add(r.decode)
    out = {
        "plane": plane, "mode": mode, "requests": len(rows), "failed": len(failed), "errors": failed[:3],
        "hits": sum(1 for _, _, r in ok if r.cached_prefix_blocks > 0),
        "possible_hits": len(rows) - len(rounds[0]),     # the first request of each family cannot hit
        "cached_blocks": cached, "pulled_blocks": pulled,
        "bytes_pulled": pulled * per_block, "bytes_saved": cached * per_block, "block_bytes": per_block,
        "pull_p50_ms": _ms(_p50([r.timings["pull_s"] for _, _, r in ok if "pull_s" in r.timings])),
        "handoff_p50_ms": _ms(_p50([r.timings["handoff_s"] for _, _, r in ok if "handoff_s" in r.timings])),
        "decodes_per_family": statistics.mean(len(v) for v in homes.values()) if homes else 0.0,
        "tokens_equal": sum(1 for _, p, r in ok if reference.get(tuple(p)) == r.tokens),
        "workload_s": elapsed,
    }
    out["hit_rate"] = out["hits"] / len(rows) if rows else 0.0
    progress(f"{plane} {mode}: {out['hits']}/{len(rows)} hits, {pulled} blocks pulled, {cached} reused "
             f"({time.monotonic() - t0:.1f}s with the fleet's start)")
    return out


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1000.0


def run_bench(args: argparse.Namespace, progress=print) -> dict[str, Any]:
    from engine_integration.launch import generate_colocated

    rounds = workload(args.families, args.requests, args.prefix_tokens, args.suffix_tokens, args.seed)
    prompts = [p for round_ in rounds for _, p in round_]
    reference = {tuple(p): r.tokens for p, r in zip(prompts, generate_colocated(prompts, args.new_tokens))}
    planes = [p.strip() for p in args.planes.split(",") if p.strip()]
    results = []
    for plane in planes:
        for prefix_routing in (True, False):
            try:
                results.append(run_one(plane, prefix_routing, rounds, args, reference, progress))
            except Exception as exc:  # one plane's failure is reported, the others still run
                results.append({"plane": plane, "mode": "prefix-aware" if prefix_routing else "least-loaded",
                                "error": f"{type(exc).__name__}: {exc}"})
    for plane in planes:
        on = next((r for r in results if r["plane"] == plane and r["mode"] == "prefix-aware" and "error" not in r),
                  None)
        off = next((r for r in results if r["plane"] == plane and r["mode"] == "least-loaded" and "error" not in r),
                   None)
        if on and off and on["bytes_pulled"]:
            on["bytes_pulled_vs_least_loaded"] = on["bytes_pulled"] / off["bytes_pulled"]
    return {"bench": "fleet-prefix", "backend": args.backend, "families": args.families,
            "requests_per_family": args.requests, "prefix_tokens": args.prefix_tokens,
            "suffix_tokens": args.suffix_tokens, "new_tokens": args.new_tokens, "decode_blocks": args.decode_blocks,
            "fleet": "1 prefill, 2 decodes", "seed": args.seed, "results": results}


def render(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"prefix-aware routing: {report['families']} families x {report['requests_per_family']} "
                        f"requests, prefix {report['prefix_tokens']} + suffix {report['suffix_tokens']} tokens, "
                        f"{report['fleet']} ({report['decode_blocks']} blocks each), {report['backend']}")
    for column in ("plane", "routing", "hit rate", "hits", "blocks pulled", "reused", "KiB pulled", "KiB saved",
                   "vs least-loaded", "decodes/family", "pull p50", "handoff p50", "tokens"):
        table.add_column(column, justify="left" if column in ("plane", "routing") else "right")
    for r in report["results"]:
        if "error" in r:
            table.add_row(r["plane"], r["mode"], "failed: " + r["error"].splitlines()[0][:70], *[""] * 10)
            continue
        ratio = r.get("bytes_pulled_vs_least_loaded")
        table.add_row(r["plane"], r["mode"], f"{r['hit_rate']:.0%}", f"{r['hits']}/{r['possible_hits']}",
                      str(r["pulled_blocks"]), str(r["cached_blocks"]), f"{r['bytes_pulled'] / 1024:.0f}",
                      f"{r['bytes_saved'] / 1024:.0f}", "" if ratio is None else f"{ratio:.2f}x",
                      f"{r['decodes_per_family']:.2f}",
                      "" if r["pull_p50_ms"] is None else f"{r['pull_p50_ms']:.2f}",
                      "" if r["handoff_p50_ms"] is None else f"{r['handoff_p50_ms']:.2f}",
                      f"{r['tokens_equal']}/{r['requests']}")
    console.print(table)
    console.print("hits: requests that reused a cached prefix / requests that could (all but each family's first); "
                  "blocks: prompt blocks over all requests; times in ms (pull: decode post -> complete; handoff: "
                  "prefill done -> decode committed, coordinator only); tokens: equal to co-located generation",
                  highlight=False)
