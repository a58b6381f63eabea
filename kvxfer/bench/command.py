"""``kvxfer bench``: arguments -> ``BenchConfig`` -> run -> table, JSON, plot, markdown."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console

from kvxfer.bench.config import (
    DEFAULT_BASELINES, DEFAULT_BLOCK_COUNTS, DEFAULT_RESHARD_SIZES, DEFAULT_SLICE_SIZES, PATTERNS, BenchConfig, MiB,
    tiny_config,
)

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20}


def parse_size(text: str) -> int:
    """``4K``, ``32KiB``, ``1M``, ``4096`` -> bytes (binary units)."""
    t = text.strip().upper()
    digits = t.rstrip("KMIB")
    unit = t[len(digits):]
    if not digits.isdigit() or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4K, 32KiB, 1M, 4096)")
    return int(digits) * _UNITS[unit]


def _list(kind: type = str):  # noqa: ANN202 - an argparse type factory
    def parse(text: str) -> tuple:
        items = [x for x in text.split(",") if x.strip()]
        return tuple(parse_size(x) if kind is bytes else kind(x.strip()) for x in items)

    return parse


def default_backends() -> tuple[str, ...]:
    from kvxfer.backends import available_backends

    return tuple(info.name for info in available_backends() if info.available)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", type=_list(), help="comma-separated backends (default: every one that can run here)")
    p.add_argument("--baselines", type=_list(), default=DEFAULT_BASELINES,
                   help=f"comma-separated, from {','.join(DEFAULT_BASELINES)} (default: all); 'none' for none")
    p.add_argument("--sizes", type=_list(bytes), default=DEFAULT_SLICE_SIZES,
                   help="slice sizes (one block x one layer plane), e.g. 4K,32K,1M,4M")
    p.add_argument("--blocks", type=_list(int), default=DEFAULT_BLOCK_COUNTS, help="blocks per request, e.g. 16,128")
    p.add_argument("--patterns", type=_list(), default=PATTERNS, help="contiguous,scattered")
    p.add_argument("--layers", type=int, default=4, help="layers in the pool (planes per block = 2 x layers)")
    p.add_argument("--repeats", type=int, default=10, help="measured repeats per point")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured warm-up pulls per point")
    p.add_argument("--max-request-mib", type=int, default=16, help="cap on one request's bytes (block counts are lowered)")
    p.add_argument("--reshard", choices=["auto", "off"], default="auto",
                   help="TP-reshard axis: auto = on when kvxfer.plan.reshard is importable")
    p.add_argument("--reshard-sizes", type=_list(bytes), default=DEFAULT_RESHARD_SIZES,
                   help="slice sizes that also get TP 2 -> 1 points (default: 32K,1M)")
    p.add_argument("--mooncake-python", help="interpreter that has mooncake installed (default: this one)")
    p.add_argument("--timeout", type=float, default=60.0, help="per-transfer timeout, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke sweep (2 small sizes, 1 repeat)")
    p.add_argument("--json", default="bench-results/bench.json", help="write every figure here (default: %(default)s)")
    p.add_argument("--plot", help="write the GB/s plot (PNG) here")
    p.add_argument("--markdown", help="write a benchmarks page (markdown) here; the plot is linked relative to it")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run's config; an unknown backend name raises ``BackendUnavailableError`` (exit 2) before anything runs."""
    from kvxfer.backends import construct_kv_transfer_backend_class

    for name in args.backends or ():
        construct_kv_transfer_backend_class(name)
    baselines = tuple(b for b in args.baselines if b != "none")
    common = dict(backends=args.backends or default_backends(), baselines=baselines, patterns=args.patterns,
                  reshard=args.reshard, seed=args.seed, timeout_s=args.timeout, mooncake_python=args.mooncake_python)
    if args.tiny:
        return tiny_config(**common)
    return BenchConfig(slice_sizes=args.sizes, reshard_sizes=args.reshard_sizes, block_counts=args.blocks, num_layers=args.layers, repeats=args.repeats,
                       warmup=args.warmup, max_request_bytes=args.max_request_mib * MiB, **common)


def _sizes(sizes: Sequence[int]) -> str:
    return ",".join(f"{s >> 20}M" if s % MiB == 0 else f"{s >> 10}K" if s % 1024 == 0 else str(s) for s in sizes)


def command_line(cfg: BenchConfig, args: argparse.Namespace) -> str:
    """The explicit command that reproduces ``cfg`` (every axis spelled out, defaults included)."""
    parts = ["kvxfer", "bench", "--backends", ",".join(cfg.backends) or "none",
             "--baselines", ",".join(cfg.baselines) or "none", "--sizes", _sizes(cfg.slice_sizes),
             "--blocks", ",".join(map(str, cfg.block_counts)), "--patterns", ",".join(cfg.patterns),
             "--layers", str(cfg.num_layers), "--repeats", str(cfg.repeats), "--warmup", str(cfg.warmup),
             "--max-request-mib", str(cfg.max_request_bytes // MiB), "--reshard", cfg.reshard,
             "--reshard-sizes", _sizes(cfg.reshard_sizes), "--seed", str(cfg.seed)]
    if cfg.mooncake_python:
        parts += ["--mooncake-python", cfg.mooncake_python]
    for flag in ("json", "plot", "markdown"):
        if getattr(args, flag, None):
            parts += [f"--{flag}", getattr(args, flag)]
    return " ".join(shlex.quote(p) for p in parts)


def _relative(path: Optional[Path], page: Path) -> Optional[str]:
    """``path`` as the markdown page at ``page`` should link it."""
    if path is None:
        return None
    try:
        return str(path.resolve().relative_to(page.resolve().parent))
    except ValueError:
        return str(path.resolve())


def run_command(args: argparse.Namespace, console: Console) -> int:
    from kvxfer.bench.report import markdown, print_report, rich_progress, write_json, write_plot
    from kvxfer.bench.run import run_bench

    cfg = config_from_args(args)
    command = command_line(cfg, args)
    console.print(f"kvxfer bench: backends {', '.join(cfg.backends) or '(none)'}; baselines "
                  f"{', '.join(cfg.baselines) or '(none)'}; {len(list(cfg.points()))} points each")
    with rich_progress(console) as progress:
        report = run_bench(cfg, command=command, progress=progress)
    print_report(report, console)
    if args.json:
        write_json(report, Path(args.json))
        console.print(f"JSON: {args.json}")
    plot_path = Path(args.plot) if args.plot else None
    if plot_path:
        why = write_plot(report, plot_path)
        console.print(f"plot: {plot_path}" if why is None else f"[yellow]{why}[/yellow]")
        if why:
            plot_path = None
    if args.markdown:
        md = Path(args.markdown)
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(markdown(report, _relative(plot_path, md), command, _relative(Path(args.json), md) if args.json else None))
        console.print(f"markdown: {md}")
    return 0 if report.ok else 1
