"""The ``kvxfer`` command: ``info``, ``loopback``, ``soak``, ``generate``, ``bench``, ``bench-vllm``, ``bench-sglang``, ``bench-prefix-routing`` and ``bench-fleet-scale`` (see ``kvxfer --help``).

Exit status: 0 success, 1 a run that failed, 2 a usage error (nothing ran),
130 interrupted. Every error is one line on stderr,
``kvxfer: error: <what> (<how to fix>)``; ``--debug`` adds the traceback.

Owns the command line, its process's logging setup and the console: the front door, the only
part of ``kvxfer`` that imports ``engine_integration``; nothing imports it.
Its imports: its row of ``LAYERS`` in tests/project/test_library_layout.py (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import kvxfer
from kvxfer.cli import logs
from kvxfer.cli.args import (MAX_SEED, HelpFormatter, Parser, add_common, backend_name, control_plane_url,
                             readable_file, seconds, whole_number, writable_file)
from kvxfer.cli.errors import INTERRUPTED, CommandError, one_line, report
from kvxfer.defaults import TRANSFER_TIMEOUT_S

DTYPES = ("float32", "bfloat16", "float16")


def _subparser(sub: argparse._SubParsersAction, name: str, help_text: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
    add_common(p, in_subcommand=True)
    return p


def build_parser() -> argparse.ArgumentParser:
    from kvxfer.cli import bench, commands

    parser = Parser(prog="kvxfer", formatter_class=HelpFormatter,
                    description="Move an LLM request's KV cache from a prefill instance to a decode instance.",
                    epilog="Exit status: 0 ok, 1 the run failed, 2 usage error (nothing ran).")
    parser.add_argument("--version", action="version", version=f"kvxfer {kvxfer.__version__}")
    add_common(parser, in_subcommand=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    info = _subparser(sub, "info", "version, backends and whether they can run here, transports, control plane")
    info.add_argument("--control-plane", type=control_plane_url, metavar="URL",
                      help="also check this etcd control plane's health (etcd://host:port[/cluster])")
    info.set_defaults(func=commands.run_info)

    loop = _subparser(sub, "loopback", "a real prefill -> decode handoff on this machine, every byte verified")
    loop.add_argument("--backend", type=backend_name, help="transport (default: the best one that can run here)")
    loop.add_argument("--layers", type=whole_number(1, 4096), default=32, help="layers in the pool")
    loop.add_argument("--tokens-per-block", type=whole_number(1, 65536), default=16, help="tokens per KV block")
    loop.add_argument("--heads", type=whole_number(1, 4096), default=8, help="KV heads in the pool")
    loop.add_argument("--head-dim", type=whole_number(1, 65536), default=128, help="elements per head")
    loop.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="element type of the pool")
    loop.add_argument("--pool-blocks", type=whole_number(1, 1 << 24), default=256, help="blocks in each side's pool")
    loop.add_argument("--blocks", type=whole_number(1, 1 << 24), default=128,
                      help="blocks in the request (<= --pool-blocks)")
    loop.add_argument("--pattern", default="scattered", choices=["scattered", "contiguous"],
                      help="block ids: random on both sides, or the same run")
    loop.add_argument("--seed", type=whole_number(0, MAX_SEED), default=0, help="seed of the block ids and pool bytes")
    loop.add_argument("--timeout", type=seconds(), default=TRANSFER_TIMEOUT_S, help="transfer timeout, seconds")
    loop.add_argument("--json", type=writable_file, metavar="PATH", help="also write the figures to this JSON file")
    loop.set_defaults(func=commands.run_loopback_command)

    soak = _subparser(sub, "soak", "thousands of handoffs with block reuse, every byte verified, leaks counted")
    soak.add_argument("--backend", type=backend_name, help="transport (default: the best one that can run here)")
    soak.add_argument("--handoffs", type=whole_number(1, 10**9), default=2000, help="handoffs to run and verify")
    soak.add_argument("--in-flight", type=whole_number(1, 4096), default=8, help="handoffs in flight at once")
    soak.add_argument("--seed", type=whole_number(0, MAX_SEED), default=0, help="seed of the request sizes and bytes")
    soak.add_argument("--timeout", type=seconds(), default=TRANSFER_TIMEOUT_S,
                      help="per-transfer timeout, seconds")
    soak.add_argument("--json", type=writable_file, metavar="PATH", help="also write the report to this JSON file")
    soak.set_defaults(func=commands.run_soak_command)

    gen = _subparser(sub, "generate", "greedy generation on the reference engine, co-located or disaggregated")
    gen.add_argument("--prompts", required=True, type=readable_file, metavar="PATH",
                     help="JSON lines file, each line a list of token ids")
    gen.add_argument("--max-new-tokens", type=whole_number(1, 65536), default=16, help="tokens to generate per prompt")
    gen.add_argument("--disagg", action="store_true",
                     help="coordinator + prefill + decode processes on this machine (default: one co-located engine)")
    gen.add_argument("--backend", type=backend_name, help="transport for --disagg (default: the best one here)")
    gen.add_argument("--timings", action="store_true", help="print timings with the tokens")
    gen.add_argument("--control-plane", type=control_plane_url, metavar="URL",
                     help="with --disagg: the etcd fleet control plane instead of the embedded coordinator "
                          "(etcd://host:port[/cluster][?ttl=5&poll=0.25]; etcd:// starts a private etcd)")
    gen.set_defaults(func=commands.run_generate)

    bench_parser = _subparser(sub, "bench", "sweep backends and baselines (two processes, every transfer verified)")
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=lambda args: bench.run_command(args, commands.console))

    from kvxfer.cli import bench_vllm  # noqa: PLC0415 - imports no vLLM itself

    vllm_parser = _subparser(sub, "bench-vllm", "vLLM P/D through KvxferConnector (nixl, ucx) and vLLM's NixlConnector")
    bench_vllm.add_arguments(vllm_parser)
    vllm_parser.set_defaults(func=lambda args: bench_vllm.run_command(args, commands.console))

    from kvxfer.cli import bench_sglang  # noqa: PLC0415 - imports no SGLang itself

    sglang_parser = _subparser(sub, "bench-sglang",
                               "SGLang PD through SGLang's queues: kvxfer_ucx, kvxfer_nixl and SGLang's own nixl")
    bench_sglang.add_arguments(sglang_parser)
    sglang_parser.set_defaults(func=lambda args: bench_sglang.run_command(args, commands.console))

    from kvxfer.cli import bench_fleet  # noqa: PLC0415 - starts no engine itself

    prefix_parser = _subparser(sub, "bench-prefix-routing",
                               "prefix-aware routing against least-loaded on a small real fleet (both planes)")
    bench_fleet.add_prefix_routing_arguments(prefix_parser)
    prefix_parser.set_defaults(func=lambda args: bench_fleet.run_prefix_routing(args, commands.console))

    scale_parser = _subparser(sub, "bench-fleet-scale",
                              "control-plane operations and latency per handoff as simulated fleets grow (both planes)")
    bench_fleet.add_fleet_scale_arguments(scale_parser)
    scale_parser.set_defaults(func=lambda args: bench_fleet.run_fleet_scale(args, commands.console))
    return parser


def _wants_debug(argv: Sequence[str]) -> bool:
    """``--debug`` anywhere on the line (known even when parsing fails)."""
    return "--debug" in argv


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _wants_debug(argv)
    try:
        args = build_parser().parse_args(argv)
        logs.configure(args.verbose, args.quiet)
        # NIXL logs every agent it creates at INFO; the command's own table says what happened.
        # Child processes inherit this; a user's own NIXL_LOG_LEVEL wins.
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        return int(args.func(args))
    except CommandError as exc:
        report(exc.line(), debug=debug, child_traceback=exc.child_traceback, exc=exc)
        return exc.status
    except KeyboardInterrupt:
        report(one_line("interrupted"), debug=debug)
        return INTERRUPTED
    except kvxfer.KVXferError as exc:  # raised by a run after the checks passed: the run failed
        report(one_line(f"{type(exc).__name__}: {exc}", "rerun with --debug for the traceback"), debug=debug, exc=exc)
        return 1
    except Exception as exc:  # noqa: BLE001 - a bug or a broken environment: still one line, unless --debug
        report(one_line(f"unexpected {type(exc).__name__}: {exc}",
                        "rerun with --debug for the traceback, and report it if kvxfer is at fault"),
               debug=debug, exc=exc)
        return 1


__all__ = ["build_parser", "main"]
