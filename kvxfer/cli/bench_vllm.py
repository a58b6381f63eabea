"""``kvxfer bench-vllm``: the command-line face of ``kvxfer.bench.vllm_bench`` (arguments in, usage errors
as exit 2 before anything starts, a failed or token-unequal target as exit 1)."""

from __future__ import annotations

import argparse
from typing import Any

from kvxfer.bench.vllm_bench import TARGETS, check_args, render, run_vllm_bench
from kvxfer.cli.args import MAX_SEED, whole_number, writable_file
from kvxfer.cli.bench_report import run_report_bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=whole_number(1, 10_000), default=40, help="prompts per connector")
    parser.add_argument("--min-tokens", type=whole_number(1, 1900), default=64, help="shortest prompt, tokens")
    parser.add_argument("--max-tokens", type=whole_number(1, 1900), default=1024, help="longest prompt, tokens")
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help=f"comma-separated, from {','.join(TARGETS)}")
    parser.add_argument("--model", help="a local model directory (default: a tiny random Llama made in a temp dir)")
    parser.add_argument("--json", type=writable_file, default="bench-results/vllm-bench.json",
                        help="where to write the report")
    parser.add_argument("--seed", type=whole_number(0, MAX_SEED), default=0, help="seed of the prompts")


def run_command(args: argparse.Namespace, console: Any) -> int:
    return run_report_bench(
        "bench-vllm", args, console, check=check_args, run=run_vllm_bench, render=render,
        failed=lambda report: [r["target"] for r in report["results"]
                               if "error" in r or r["tokens_equal"] != r["tokens_total"]],
        failure="failed or gave tokens unlike co-located generation")
