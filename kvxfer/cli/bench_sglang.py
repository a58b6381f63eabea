"""``kvxfer bench-sglang``: the command-line face of ``kvxfer.bench.sglang_bench`` (arguments in, usage errors
as exit 2 before anything starts, a failed or not byte-exact target as exit 1)."""

from __future__ import annotations

import argparse
from typing import Any

from kvxfer.bench.sglang_bench import TARGETS, check_args, failed_targets, render, run_sglang_bench
from kvxfer.cli.args import seconds, whole_number, writable_file
from kvxfer.cli.bench_report import run_report_bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rooms", type=whole_number(1, 8), default=4, help="rooms in flight at once (a batch), 1..8")
    parser.add_argument("--batches", type=whole_number(1, 100_000), default=5, help="timed batches per target")
    parser.add_argument("--pages", type=whole_number(1, 7), default=6, help="pages per room (page size 4), 1..7")
    parser.add_argument("--chunks", type=whole_number(1, 7), default=3, help="chunks each room is sent in")
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, from {','.join(TARGETS)}")
    parser.add_argument("--timeout", type=seconds(), default=60.0, help="per batch, seconds")
    parser.add_argument("--json", type=writable_file, default="bench-results/sglang-bench.json", metavar="PATH",
                        help="where to write the report")


def run_command(args: argparse.Namespace, console: Any) -> int:
    return run_report_bench("bench-sglang", args, console, check=check_args, run=run_sglang_bench, render=render,
                            failed=failed_targets, failure="failed or moved rooms that were not byte-exact")
