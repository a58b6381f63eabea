"""The ``kvxfer`` command: ``info``, ``loopback``, ``soak``, ``generate`` and ``bench`` (see ``kvxfer --help``)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any, Callable, Optional, Sequence

from rich.console import Console
from rich.table import Table

import kvxfer
from kvxfer.backends import available_backends, default_backend_name, transport_probes
from kvxfer.bench.command import add_arguments as add_bench_arguments
from kvxfer.harness.loopback import LoopbackConfig, LoopbackResult, run_loopback

console = Console()

def _info(_: argparse.Namespace) -> int:
    import torch

    table = Table(title=f"kvxfer {kvxfer.__version__}")
    table.add_column("backend")
    table.add_column("available")
    table.add_column("why not / fix")
    default = default_backend_name()
    for info in available_backends():
        name = f"{info.name} (default)" if info.name == default else info.name
        table.add_row(name, "yes" if info.available else "no", info.reason)
    console.print(table)
    console.print(f"python {platform.python_version()}  torch {torch.__version__}  "
                  f"cuda {'available: ' + str(torch.cuda.device_count()) + ' device(s)' if torch.cuda.is_available() else 'not available'}")
    for name, details in transport_probes().items():
        console.print(f"[bold]{name}[/bold]: " + "  ".join(f"{k}={v}" for k, v in details.items()))
    return 0


def print_loopback(result: LoopbackResult) -> None:
    cfg = result.config
    console.print(f"kvxfer loopback on [bold]{cfg.backend}[/bold]: {cfg.request_blocks} {cfg.pattern} blocks of a "
                  f"[2, {cfg.num_layers}, {cfg.pool_blocks}, {cfg.tokens_per_block}, {cfg.num_heads}, {cfg.head_dim}] "
                  f"{cfg.dtype} pool")
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("bytes moved", f"{result.bytes_moved:,} ({result.bytes_moved / 2**20:.1f} MiB)"),
        ("descriptors before coalescing", f"{result.raw_descriptors:,}"),
        ("descriptors after coalescing", f"{result.descriptors:,}"),
        ("descriptor build", f"{result.plan_ms:.2f} ms"),
        ("transfer time", f"{result.transfer_s * 1e3:.2f} ms"),
        ("bandwidth", f"{result.gbps:.2f} GB/s"),
        ("read-done at source after", f"{result.read_done_s * 1e3:.2f} ms"),
        ("blocks freed by prefill", f"{result.freed_blocks}"),
        ("bytes verified", "[green]exact[/green]" if result.verified else "[red]MISMATCH[/red]"),
        ("other blocks untouched", "[green]yes[/green]" if result.untouched_ok else "[red]NO[/red]"),
        ("read-done received once", "[green]yes[/green]" if result.read_done_ok else "[red]NO[/red]"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if result.error:
        console.print(f"[red]error:[/red] {result.error}")
    console.print("[green]OK[/green]" if result.ok else "[red]FAILED[/red]")


def _loopback(args: argparse.Namespace) -> int:
    cfg = LoopbackConfig(
        backend=args.backend or default_backend_name(), num_layers=args.layers, tokens_per_block=args.tokens_per_block,
        num_heads=args.heads, head_dim=args.head_dim, dtype=args.dtype, pool_blocks=args.pool_blocks,
        request_blocks=args.blocks, pattern=args.pattern, seed=args.seed, timeout_s=args.timeout,
    )
    result = run_loopback(cfg)
    print_loopback(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result.to_json(), fh, indent=2)
    return 0 if result.ok else 1


def _soak(args: argparse.Namespace) -> int:
    from kvxfer.harness.soak import SoakConfig, run_soak

    cfg = SoakConfig(backend=args.backend or default_backend_name(), handoffs=args.handoffs,
                     in_flight=args.in_flight, seed=args.seed)
    report = run_soak(cfg)
    table = Table(title=f"kvxfer soak on {cfg.backend}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in [
        ("handoffs verified", f"{report.handoffs_done} / {cfg.handoffs}"),
        ("bytes verified", f"{report.bytes_verified:,}"),
        ("bytes lost", f"{report.bytes_lost:,}"),
        ("byte mismatches", str(report.mismatches)),
        ("failed requests", str(len(report.failures))),
        ("prefill blocks still pinned", str(report.prefill_pinned_at_end)),
        ("decode handles still open", str(report.decode_open_handles_at_end)),
        ("decode blocks still reserved", str(report.decode_reserved_at_end)),
        ("peak RSS growth (MiB)", ", ".join(f"{k} {v:.1f}" for k, v in report.rss_growth_mib.items())),
        ("duration", f"{report.duration_s:.1f} s"),
    ]:
        table.add_row(name, value)
    console.print(table)
    for failure in report.failures[:10]:
        console.print(f"[red]failure:[/red] {failure}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report.to_json(), fh, indent=2, default=str)
    console.print("[green]OK[/green]" if report.ok else "[red]FAILED[/red]")
    return 0 if report.ok else 1


def _generate(args: argparse.Namespace) -> int:
    from engine_integration.launch import run_generate_command

    return run_generate_command(args.prompts, args.max_new_tokens, disagg=args.disagg,
                                backend=args.backend or default_backend_name(), timings=args.timings)


def _bench(args: argparse.Namespace) -> int:
    from kvxfer.bench.command import run_command

    return run_command(args, console)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvxfer", description="Move KV cache blocks between LLM instances.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="version, backends and whether they can run here, transports").set_defaults(func=_info)

    loop = sub.add_parser("loopback", help="a real prefill -> decode handoff on this machine, every byte verified")
    loop.add_argument("--backend", help="transport (default: the best available here)")
    loop.add_argument("--layers", type=int, default=32)
    loop.add_argument("--tokens-per-block", type=int, default=16)
    loop.add_argument("--heads", type=int, default=8, help="KV heads in the pool")
    loop.add_argument("--head-dim", type=int, default=128)
    loop.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    loop.add_argument("--pool-blocks", type=int, default=256, help="blocks in each side's pool")
    loop.add_argument("--blocks", type=int, default=128, help="blocks in the request")
    loop.add_argument("--pattern", default="scattered", choices=["scattered", "contiguous"])
    loop.add_argument("--seed", type=int, default=0)
    loop.add_argument("--timeout", type=float, default=60.0, help="transfer timeout, seconds")
    loop.add_argument("--json", help="also write the figures to this JSON file")
    loop.set_defaults(func=_loopback)

    soak = sub.add_parser("soak", help="thousands of handoffs with block reuse, every byte verified, leaks counted")
    soak.add_argument("--backend", help="transport (default: the best available here)")
    soak.add_argument("--handoffs", type=int, default=2000)
    soak.add_argument("--in-flight", type=int, default=8)
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--json", help="also write the report to this JSON file")
    soak.set_defaults(func=_soak)

    gen = sub.add_parser("generate", help="greedy generation on the reference engine, co-located or disaggregated")
    gen.add_argument("--prompts", required=True, help="JSON lines file, each line a list of token ids")
    gen.add_argument("--max-new-tokens", type=int, default=16)
    gen.add_argument("--disagg", action="store_true", help="coordinator + prefill + decode processes on loopback")
    gen.add_argument("--backend", help="transport for --disagg (default: the best available here)")
    gen.add_argument("--timings", action="store_true", help="print timings with the tokens")
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="sweep backends and baselines (two processes, every transfer verified)")
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # NIXL logs every agent it creates at INFO; the command's own table says what happened.
    # Child processes inherit this; a user's own NIXL_LOG_LEVEL wins.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        return args.func(args)
    except kvxfer.KVXferError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
