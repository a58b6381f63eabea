"""One path for the commands that run a bench and write a report: check the arguments, run, print the
table, write the JSON, and exit 1 naming what failed (``bench-vllm``, ``bench-sglang``,
``bench-prefix-routing``; ``bench-fleet-scale`` checks the same way and writes its own report).

A bench module supplies ``check_args(args) -> [(what, how to fix), ...]`` (empty when fine), its run and its
renderer; a problem is a usage error (one line, exit 2) before anything starts."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

from kvxfer.cli.errors import RunFailed, UsageError

Problems = Sequence[tuple[str, str]]


def refuse(problems: Problems) -> None:
    """The first problem as a usage error, if there is one."""
    if problems:
        raise UsageError(*problems[0])


def run_report_bench(command: str, args: argparse.Namespace, console: Any, *,
                     check: Callable[[argparse.Namespace], Problems],
                     run: Callable[..., dict[str, Any]],
                     render: Callable[[dict[str, Any], Any], None],
                     failed: Callable[[dict[str, Any]], list[str]], failure: str) -> int:
    """Check, run (progress lines on ``console``), print, write ``args.json``; ``RunFailed`` naming the rows
    ``failed`` picks out of the report, with ``failure`` saying what went wrong with them."""
    refuse(check(args))
    report = run(args, progress=lambda line: console.print(line, highlight=False))
    from kvxfer.bench.report import write_report

    render(report, console)
    path = write_report(report, args.json, console)
    bad = failed(report)
    if bad:
        raise RunFailed(f"{command}: {', '.join(bad)} {failure}", f"see {path}")
    return 0
