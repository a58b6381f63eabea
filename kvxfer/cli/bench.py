"""``kvxfer bench``: arguments -> ``BenchConfig`` -> run -> table, JSON, plot, markdown.

The command-line face of ``kvxfer.bench`` (which knows nothing of the command line)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from rich.console import Console

from kvxfer.bench.config import (
    DEFAULT_BASELINES, DEFAULT_BLOCK_COUNTS, DEVICE_BASELINES, DEFAULT_RESHARD_SIZES, DEFAULT_SLICE_SIZES, PATTERNS, BenchConfig, MiB,
    parse_size, tiny_config,
)
from kvxfer.cli.args import MAX_SEED, backend_list, executable_file, seconds, whole_number, writable_file
from kvxfer.cli.errors import RunFailed, UsageError
from kvxfer.defaults import TRANSFER_TIMEOUT_S, SettingError, bounded_int

def _list(item: Callable[[str], Any], example: str) -> Callable[[str], tuple]:
    """A type: a comma-separated list, each item parsed by ``item``."""

    def parse(text: str) -> tuple:
        items = tuple(item(x.strip()) for x in text.split(",") if x.strip())
        if not items:
            raise argparse.ArgumentTypeError(f"empty list {text!r} (give e.g. {example})")
        return items

    if hasattr(item, "bounds"):  # a list of numbers is as bounded as each number (tests/unit/test_settings_bounds.py)
        parse.bounds = item.bounds  # type: ignore[attr-defined]
    return parse


#: The largest slice size a bench point takes (one block x one layer plane): a GiB, far past any model's.
MAX_SLICE_BYTES = 1 << 30


def _size(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (give a size in bytes from 1 to {MAX_SLICE_BYTES}, "
                                         "e.g. 4K, 32KiB, 1M, 4096)") from None
    try:
        return bounded_int("", size, 1, MAX_SLICE_BYTES, unit="a size in bytes")
    except SettingError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_size.bounds = (1, MAX_SLICE_BYTES)  # type: ignore[attr-defined]


def _pattern(text: str) -> str:
    if text not in PATTERNS:
        raise argparse.ArgumentTypeError(f"unknown pattern {text!r} (choose from {', '.join(PATTERNS)})")
    return text


def _baseline(text: str) -> str:
    if text not in (*DEFAULT_BASELINES, "none"):
        raise argparse.ArgumentTypeError(f"unknown baseline {text!r} (choose from {', '.join(DEFAULT_BASELINES)}, or none)")
    return text


def _device(text: str) -> str:
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise argparse.ArgumentTypeError(f"unknown device {text!r} (give cpu, cuda or cuda:N)")
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"--device {text}: no CUDA device here (run on a GPU machine, or use cpu)")
        if index and int(index) >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"--device {text}: this machine has {torch.cuda.device_count()} GPU(s)")
    return text


def default_backends() -> tuple[str, ...]:
    from kvxfer.backends import available_backends

    # push backends (nccl) included: the bench runs them over a Gloo group of its worker and source
    return tuple(info.name for info in available_backends() if info.available)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", type=backend_list, metavar="LIST",
                   help="comma-separated backends (default: every one that can run here)")
    p.add_argument("--baselines", type=_list(_baseline, "memcpy,ucx-perftest"), metavar="LIST",
                   help=f"comma-separated, from {','.join(DEFAULT_BASELINES)}; 'none' for none (default: all of them; "
                        f"with --device cuda: {','.join(DEVICE_BASELINES)}, a device-to-device copy)")
    p.add_argument("--device", type=_device, default="cpu",
                   help="where both pools live: cpu, or cuda[:N] for VRAM pools (needs a CUDA GPU)")
    p.add_argument("--sizes", type=_list(_size, "4K,1M"), default=DEFAULT_SLICE_SIZES, metavar="LIST",
                   help="slice sizes in bytes (one block x one layer plane), e.g. 4K,32K,1M,4M")
    p.add_argument("--blocks", type=_list(whole_number(1, 1 << 20), "16,128"), default=DEFAULT_BLOCK_COUNTS,
                   metavar="LIST",
                   help="blocks per request, e.g. 16,128")
    p.add_argument("--patterns", type=_list(_pattern, "contiguous,scattered"), default=PATTERNS, metavar="LIST",
                   help="block id patterns: contiguous, scattered or both")
    p.add_argument("--layers", type=whole_number(1, 4096), default=4,
                   help="layers in the pool (planes per block = 2 x layers)")
    p.add_argument("--repeats", type=whole_number(1, 100_000), default=10, help="measured repeats per point")
    p.add_argument("--warmup", type=whole_number(0, 100_000), default=2, help="unmeasured warm-up pulls per point")
    p.add_argument("--max-request-mib", type=whole_number(1, 1 << 20), default=16,
                   help="cap on one request's MiB (block counts are lowered to fit)")
    p.add_argument("--reshard", choices=["on", "off", "auto"], default="on",
                   help="TP-reshard axis: TP 2 -> 1 points at --reshard-sizes, and the descriptor-build figure "
                        "('auto' is 'on', kept for older command lines)")
    p.add_argument("--reshard-sizes", type=_list(_size, "32K,1M"), default=DEFAULT_RESHARD_SIZES, metavar="LIST",
                   help="slice sizes that also get TP 2 -> 1 points")
    p.add_argument("--mooncake-python", type=executable_file, metavar="PATH",
                   help="interpreter that has mooncake installed (default: this one)")
    p.add_argument("--timeout", type=seconds(), default=TRANSFER_TIMEOUT_S, help="per-transfer timeout, seconds")
    p.add_argument("--seed", type=whole_number(0, MAX_SEED), default=0,
                   help="seed of the block id patterns and pool bytes")
    p.add_argument("--get-region-mib", type=whole_number(1, 1 << 20), metavar="MIB",
                   help="ucp-get-cold: bytes per side it cycles through (default: 2x the last-level cache, >= 256 MiB)")
    p.add_argument("--note", metavar="TEXT", help="a sentence for the --markdown page (e.g. what else ran on the machine)")
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke sweep (one small size, 1 repeat)")
    p.add_argument("--json", type=writable_file, default="bench-results/bench.json", metavar="PATH",
                   help="write every figure here")
    p.add_argument("--plot", type=writable_file, metavar="PATH", help="write the GB/s plot (PNG) here")
    p.add_argument("--markdown", type=writable_file, metavar="PATH",
                   help="write a benchmarks page (markdown) here; the plot is linked relative to it")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run's config; a combination that cannot run raises ``UsageError`` (exit 2) before anything runs."""
    device = getattr(args, "device", "cpu")
    chosen = args.baselines or (DEFAULT_BASELINES if device == "cpu" else DEVICE_BASELINES)
    baselines = tuple(b for b in chosen if b != "none")
    common = dict(backends=args.backends or default_backends(), baselines=baselines, patterns=args.patterns,
                  reshard="on" if args.reshard == "auto" else args.reshard, seed=args.seed, timeout_s=args.timeout,
                  mooncake_python=args.mooncake_python, device=device)
    if getattr(args, "get_region_mib", None):
        common["get_region_bytes"] = args.get_region_mib * MiB
    try:
        if args.tiny:
            return tiny_config(**common)
        return BenchConfig(slice_sizes=args.sizes, reshard_sizes=args.reshard_sizes, block_counts=args.blocks,
                           num_layers=args.layers, repeats=args.repeats, warmup=args.warmup,
                           max_request_bytes=args.max_request_mib * MiB, **common)
    except ValueError as exc:
        raise UsageError(str(exc), "see 'kvxfer bench --help'") from None


def _sizes(sizes: Sequence[int]) -> str:
    return ",".join(f"{s >> 20}M" if s % MiB == 0 else f"{s >> 10}K" if s % 1024 == 0 else str(s) for s in sizes)


def command_line(cfg: BenchConfig, args: argparse.Namespace) -> str:
    """The explicit command that reproduces ``cfg`` (every axis spelled out, defaults included)."""
    parts = ["kvxfer", "bench", "--backends", ",".join(cfg.backends) or "none",
             "--baselines", ",".join(cfg.baselines) or "none", "--sizes", _sizes(cfg.slice_sizes),
             "--blocks", ",".join(map(str, cfg.block_counts)), "--patterns", ",".join(cfg.patterns),
             "--layers", str(cfg.num_layers), "--repeats", str(cfg.repeats), "--warmup", str(cfg.warmup),
             "--max-request-mib", str(cfg.max_request_bytes // MiB), "--reshard", cfg.reshard,
             "--reshard-sizes", _sizes(cfg.reshard_sizes), "--seed", str(cfg.seed), "--device", cfg.device]
    if cfg.mooncake_python:
        parts += ["--mooncake-python", cfg.mooncake_python]
    if cfg.get_region_bytes:
        parts += ["--get-region-mib", str(cfg.get_region_bytes // MiB)]
    if getattr(args, "note", None):
        parts += ["--note", args.note]
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
    from kvxfer.bench.report import print_report, rich_progress
    from kvxfer.bench.run import run_bench

    cfg = config_from_args(args)
    command = command_line(cfg, args)
    console.print(f"kvxfer bench: backends {', '.join(cfg.backends) or '(none)'}; baselines "
                  f"{', '.join(cfg.baselines) or '(none)'}; {len(list(cfg.points()))} points each")
    with rich_progress(console) as progress:
        report = run_bench(cfg, command=command, progress=progress)
    print_report(report, console)
    try:
        _write_outputs(args, report, command, console)
    except OSError as exc:
        raise RunFailed(f"could not write the results: {exc}", "check the --json/--plot/--markdown paths") from exc
    if not report.ok:
        failed = sum(1 for r in report.results if not r.ok)
        raise RunFailed(f"bench: {failed} of {len(report.results)} points failed",
                        "the table above gives each one's error; --json has them all")
    return 0


def _write_outputs(args: argparse.Namespace, report: Any, command: str, console: Console) -> None:
    from kvxfer.bench.report import markdown, write_json, write_plot

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
        md.write_text(markdown(report, _relative(plot_path, md), command, _relative(Path(args.json), md) if args.json else None,
                               note=getattr(args, "note", None)))
        console.print(f"markdown: {md}")
