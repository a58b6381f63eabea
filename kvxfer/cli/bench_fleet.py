"""``kvxfer bench-prefix-routing`` and ``kvxfer bench-fleet-scale``: the command-line faces of the fleet
benches in ``engine_integration.bench`` (arguments in, usage errors as exit 2, failed runs as exit 1)."""

from __future__ import annotations

import argparse
from typing import Any

from kvxfer.cli.args import MAX_SEED, seconds, whole_number, writable_file
from kvxfer.cli.bench_report import refuse, run_report_bench
from kvxfer.cli.errors import RunFailed
from kvxfer.defaults import ETCD_POLL_S, ETCD_TTL_S, bounded_int


def add_prefix_routing_arguments(parser: argparse.ArgumentParser) -> None:
    from engine_integration.bench.fleet_prefix import PLANES

    parser.add_argument("--planes", default=",".join(PLANES), help=f"comma-separated, from {','.join(PLANES)}")
    parser.add_argument("--backend", default="ucx", help="a cross-process transport (ucx, nixl)")
    parser.add_argument("--families", type=whole_number(1, 1000), default=4, help="prompt families (shared prefixes)")
    parser.add_argument("--requests", type=whole_number(1, 10_000), default=8, help="requests per family")
    parser.add_argument("--prefix-tokens", type=whole_number(1, 65536), default=64,
                        help="tokens of a family's shared prefix")
    parser.add_argument("--suffix-tokens", type=whole_number(1, 65536), default=12,
                        help="tokens of each request's own suffix")
    parser.add_argument("--new-tokens", type=whole_number(1, 65536), default=8, help="tokens generated per request")
    parser.add_argument("--decode-blocks", type=whole_number(1, 1 << 24), default=64,
                        help="KV blocks of each decode's pool")
    parser.add_argument("--seed", type=whole_number(0, MAX_SEED), default=0,
                        help="seed of the prompts and of the rounds' order")
    parser.add_argument("--json", type=writable_file, default="bench-results/fleet-prefix.json", metavar="PATH",
                        help="where to write the report")


def run_prefix_routing(args: argparse.Namespace, console: Any) -> int:
    """Run, print the table, write the JSON; a failed run exits 1."""
    from engine_integration.bench.fleet_prefix import check_args, render, run_bench

    return run_report_bench(
        "bench-prefix-routing", args, console, check=check_args, run=run_bench, render=render,
        failed=lambda report: [f"{r['plane']} {r['mode']}" for r in report["results"]
                               if "error" in r or r["failed"] or r["tokens_equal"] != r["requests"]],
        failure="failed or gave tokens unlike co-located generation")


#: The most prefills (and the most decodes) one simulated fleet of ``bench-fleet-scale`` has: each is a
#: process's worth of engine on this machine.
MAX_FLEET_SIDE = 256


def _fleet_sizes(text: str) -> str:
    """A type: ``PxD,...`` as ``fleet_scale.parse_sizes`` reads it, each side 1..``MAX_FLEET_SIDE``."""
    from engine_integration.bench.fleet_scale import parse_sizes

    try:
        for prefills, decodes in parse_sizes(text):
            bounded_int("P", prefills, 1, MAX_FLEET_SIDE, unit="a number of prefills")
            bounded_int("D", decodes, 1, MAX_FLEET_SIDE, unit="a number of decodes")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_fleet_scale_arguments(parser: argparse.ArgumentParser) -> None:
    from engine_integration.bench.fleet_scale import DEFAULT_SIZES

    parser.add_argument("--sizes", type=_fleet_sizes, default=",".join(f"{p}x{d}" for p, d in DEFAULT_SIZES),
                        help=f"fleets, PxD,... (P and D each 1..{MAX_FLEET_SIDE})")
    parser.add_argument("--planes", default="etcd,zmq", help="etcd, zmq or both")
    parser.add_argument("--handoffs", type=whole_number(0, 1_000_000), default=0,
                        help="handoffs per fleet (default 10 x P, 40..160)")
    parser.add_argument("--idle-s", type=seconds(high=3600.0), default=3.0, help="idle window per fleet")
    parser.add_argument("--ttl", type=whole_number(*ETCD_TTL_S), default=5, help="etcd lease TTL (s)")
    parser.add_argument("--poll", type=seconds(*ETCD_POLL_S), default=0.25, help="etcd poll interval (s)")
    parser.add_argument("--hosts", type=whole_number(0, 1024), default=0,
                        help="engine host processes (0: one per 8 instances, >= 2)")
    parser.add_argument("--meta-pad", type=whole_number(0, 1 << 20), default=0,
                        help="extra bytes per instance's transfer meta")
    parser.add_argument("--no-ops", action="store_true", help="skip the per-operation etcd latencies")
    parser.add_argument("--out", type=writable_file, default="fleet_scale.json", metavar="PATH", help="JSON output")


def run_fleet_scale(args: argparse.Namespace, console: Any = None) -> int:
    """Usage errors exit 2 in one line (before anything starts); a fleet with a failed handoff exits 1."""
    from engine_integration.bench.fleet_scale import check_args, run_fleet_scale as run

    refuse(check_args(args))
    failed = run(args)
    if failed:
        raise RunFailed(f"bench-fleet-scale: handoffs failed in {', '.join(failed)}", f"see {args.out}")
    return 0
