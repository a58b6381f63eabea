"""Run the documented kvxfer-vs-baselines comparison and refresh ``docs/benchmarks.md``.

This is ``kvxfer bench`` with the settings the docs quote (every backend that runs
here, every baseline, the full sweep), writing ``docs/benchmarks.md``,
``docs/bench.png`` and ``docs/bench.json``. The page records the exact
command, so anyone can rerun the same measurement without this script.

Mooncake usually lives in its own environment (its wheel pulls in packages the
kvxfer one does not need): point ``--mooncake-python`` or ``KVXFER_MOONCAKE_PYTHON``
at an interpreter that can ``import mooncake.engine``; without one the page says
"not available" and why.

Usage: ``PYTHONPATH=. python tools/bench_compare.py [--quick] [--mooncake-python PATH] [extra kvxfer bench args]``
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvxfer.cli import main as kvxfer_main  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mooncake-python", default=os.environ.get("KVXFER_MOONCAKE_PYTHON"))
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 10 (a first look, not for the docs)")
    parser.add_argument("--out", default="docs", help="folder for benchmarks.md and bench.png (relative to the repo)")
    args, extra = parser.parse_known_args()
    os.chdir(ROOT)  # relative paths, so the command quoted in the page works from any checkout
    out = Path(args.out)
    argv = ["bench", "--json", str(out / "bench.json"), "--plot", str(out / "bench.png"),
            "--markdown", str(out / "benchmarks.md")]
    if args.quick:
        argv += ["--repeats", "3", "--warmup", "1"]
    if args.mooncake_python:
        argv += ["--mooncake-python", args.mooncake_python]
    return kvxfer_main(argv + extra)


if __name__ == "__main__":
    sys.exit(main())
