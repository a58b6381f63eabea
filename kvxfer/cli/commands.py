"""The bodies of ``kvxfer info``, ``loopback``, ``soak`` and ``generate``.

Each command first checks what the parser could not check alone (options that
must agree with each other, memory the run needs) and raises ``UsageError``
before anything runs; then it runs, prints its result on stdout, and raises
``RunFailed`` if the run did not succeed.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.markup import escape
from rich.table import Table

import kvxfer
from kvxfer.cli.errors import RunFailed, UsageError
from kvxfer.errors import KVXferError
from kvxfer.harness.progress import DelayedProgress

console = Console()


# ---------------------------------------------------------------- info

def cuda_summary() -> tuple[bool, str]:
    """Whether CUDA is usable here, and a line that says so."""
    import torch

    if torch.cuda.is_available():
        return True, f"cuda available: {torch.cuda.device_count()} device(s)"
    built = "torch built without CUDA" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}, no device visible"
    return False, f"cuda not available ({built})"


def _probe_value(key: str, value: Any, cuda: bool) -> str:
    """A probe's value as shown; a transport that could move GPU memory says so only where a GPU exists."""
    if key == "VRAM" and value == "ok" and not cuda:
        return "no CUDA device here"
    return str(value)


def run_info(args: argparse.Namespace) -> int:
    import torch

    from kvxfer.backends import available_backends, default_backend_name, transport_probes

    table = Table(title=f"kvxfer {kvxfer.__version__}")
    table.add_column("backend")
    table.add_column("available")
    table.add_column("why not / fix")
    default = default_backend_name()
    for info in available_backends():  # reasons are text (a plugin's exception, say), never markup
        name = f"{info.name} (default)" if info.name == default else info.name
        table.add_row(escape(name), "yes" if info.available else "no", escape(info.reason))
    console.print(table)
    console.print(staging_line(), highlight=False)
    console.print(meta_auth_line(), highlight=False)
    cuda, cuda_line = cuda_summary()
    console.print(f"python {platform.python_version()}  torch {torch.__version__}  {cuda_line}")
    risks = []
    for name, details in transport_probes().items():
        console.print(f"[bold]{escape(name)}[/bold]: "
                      + "  ".join(escape(f"{k}={_probe_value(k, v, cuda)}") for k, v in details.items()))
        risks += [f"{name}: {value}" for value in details.values() if isinstance(value, str) and value.startswith("RISK")]
    for line in risks:  # e.g. nixl reading over TCP (docs/nixl.md): said again where it cannot be missed
        console.print("[bold yellow]" + escape(line) + "[/bold yellow]", highlight=False)
    from kvxfer.backends.vram_lanes import vram_lane_lines  # the backends import torch: not for a usage error
    for line in vram_lane_lines(cuda_device=cuda):
        console.print(("[bold red]" + line + "[/bold red]") if "DEFECT" in line else line, highlight=False)
    console.print(control_plane_line(getattr(args, "control_plane", None)), highlight=False)
    return 0


def staging_line() -> str:
    """How much memory each backend holds for resharding, and how to change it."""
    from kvxfer.backends import available_backends, construct_kv_transfer_backend_class
    from kvxfer.backends.staging import STAGING_ENV, staging_bytes_from_env

    try:
        size = staging_bytes_from_env()
    except KVXferError as exc:
        return f"staging: {exc}"
    staged = [info.name for info in available_backends() if info.available
              and getattr(construct_kv_transfer_backend_class(info.name), "supports_staging", False)]
    held = "none (staged reshard disabled)" if size == 0 else f"{size / (1 << 20):g} MiB"
    return (f"staging: {held} per {'/'.join(staged) or 'staging-capable'} registration, allocated on its first "
            f"TP-resharding pull ({STAGING_ENV}; 0 disables); nccl keeps its own buffers per push "
            "(idle ones up to 1 GiB per device)")


def meta_auth_line() -> str:
    """Whether peer metas are authenticated here (they carry the key to a rank's memory)."""
    from kvxfer.meta.seal import meta_key_from_env, unauthenticated_metas_allowed_by_env

    try:
        key = meta_key_from_env()
    except KVXferError as exc:
        return f"metas: {exc}"
    if key is not None:
        return "metas: signed and checked with the cluster key (KVXFER_SECRET_FILE)"
    if unauthenticated_metas_allowed_by_env():
        return ("metas: UNAUTHENTICATED, from any host (KVXFER_ALLOW_UNAUTHENTICATED_METAS is set): anyone who can "
                "hand this process a meta can point its reads anywhere the source registered; set KVXFER_SECRET_FILE")
    return ("metas: UNAUTHENTICATED (no KVXFER_SECRET_FILE): only metas sealed on this host are accepted (ucx: "
            "only once the process a meta names confirms it exported it), and a process of this host can still "
            "pose as a source; set KVXFER_SECRET_FILE to the cluster secret")


def control_plane_line(url: Optional[str]) -> str:
    """``kvxfer info``'s control-plane line: the embedded coordinator, or an etcd fleet and its health."""
    if not url:
        return ("control plane: embedded ZeroMQ coordinator (default; 'kvxfer generate --disagg' starts one; "
                "--control-plane etcd://host:port for a fleet)")
    from urllib.parse import urlsplit

    if not urlsplit(url).netloc.rpartition("@")[2]:
        return "control plane: etcd, demo mode (each 'kvxfer generate --disagg' starts a private, secured etcd)"
    from engine_integration.control_plane import ControlPlaneError, open_control_plane

    try:
        plane = open_control_plane(url, allow_unauthenticated=True)   # health only: no record is read here
    except (ControlPlaneError, OSError, ValueError) as exc:
        return f"control plane: etcd {url}: cannot connect: {exc}"
    try:
        health = plane.health()
    finally:
        plane.close()
    if not health.ok:
        return f"control plane: etcd {health.endpoint} cluster {plane.config.cluster!r}: UNHEALTHY: {health.detail}"
    return (f"control plane: etcd {health.endpoint} cluster {plane.config.cluster!r}: healthy, etcd "
            f"{health.server_version}, lease TTL {plane.config.ttl_s}s, poll {plane.config.poll_interval_s}s")


# ---------------------------------------------------------------- loopback

def _mem_available_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def loopback_config(args: argparse.Namespace) -> Any:
    """The run's ``LoopbackConfig``; options that cannot work together raise ``UsageError`` (checked before the
    backends and torch are imported: a mistake is answered in a fraction of a second)."""
    if args.blocks > args.pool_blocks:
        raise UsageError(f"--blocks {args.blocks} is more than the pool holds (--pool-blocks {args.pool_blocks})",
                         "give --blocks <= --pool-blocks")
    others = {"2 (K and V)": 2, "--layers": args.layers, "--tokens-per-block": args.tokens_per_block,
              "--heads": args.heads, "--head-dim": args.head_dim}
    clash = [name for name, size in others.items() if size == args.pool_blocks]
    if clash:
        raise UsageError(f"--pool-blocks {args.pool_blocks} equals {', '.join(clash)}: the blocks axis of "
                         "[2, L, B, T, H, d] is found by its size, so it must differ from the others",
                         "choose another --pool-blocks")
    from kvxfer.backends import default_backend_name
    from kvxfer.harness.loopback_config import LoopbackConfig
    from kvxfer.plan.geometry import dtype_from_name

    cfg = LoopbackConfig(
        backend=args.backend or default_backend_name(), num_layers=args.layers, tokens_per_block=args.tokens_per_block,
        num_heads=args.heads, head_dim=args.head_dim, dtype=args.dtype, pool_blocks=args.pool_blocks,
        request_blocks=args.blocks, pattern=args.pattern, seed=args.seed, timeout_s=args.timeout,
    )
    pool_bytes = dtype_from_name(cfg.dtype).itemsize
    for dim in cfg.pool_shape:
        pool_bytes *= dim
    need = 4 * pool_bytes  # two pools, plus the random bytes the source pool is filled from
    available = _mem_available_bytes()
    if available is not None and need > available:
        raise UsageError(f"the pools need about {need / 2**30:.1f} GiB and this machine has {available / 2**30:.1f} GiB "
                         "available", "lower --pool-blocks, --layers, --heads or --head-dim")
    return cfg


def print_loopback(result: Any) -> None:
    cfg = result.config
    push = getattr(result, "direction", "pull") == "push"
    how = ("push: decode posts receives, prefill sends 1 message of gathered byte runs" if push
           else "pull: decode reads")
    console.print(f"kvxfer loopback on [bold]{cfg.backend}[/bold] ({how}): {cfg.request_blocks} {cfg.pattern} blocks "
                  f"of a [2, {cfg.num_layers}, {cfg.pool_blocks}, {cfg.tokens_per_block}, {cfg.num_heads}, "
                  f"{cfg.head_dim}] {cfg.dtype} pool")
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    if push:  # one message per peer pair; the byte runs are what the prefill gathers and the decode scatters
        labels = ("byte runs before coalescing", "byte runs after coalescing", "run plan build",
                  "transfer time (receives posted -> landed)", "push done at prefill after", "push completion seen once")
    else:
        labels = ("descriptors before coalescing", "descriptors after coalescing", "descriptor build",
                  "transfer time", "read-done at source after", "read-done received once")
    rows = [
        ("bytes moved", f"{result.bytes_moved:,} ({result.bytes_moved / 2**20:.1f} MiB)"),
        (labels[0], f"{result.raw_descriptors:,}"),
        (labels[1], f"{result.descriptors:,}"),
        (labels[2], f"{result.plan_ms:.2f} ms"),
        (labels[3], f"{result.transfer_s * 1e3:.2f} ms"),
        ("bandwidth", f"{result.gbps:.2f} GB/s"),
        (labels[4], f"{result.read_done_s * 1e3:.2f} ms"),
        ("blocks freed by prefill", f"{result.freed_blocks}"),
        ("bytes verified", "[green]exact[/green]" if result.verified else "[red]MISMATCH[/red]"),
        ("other blocks untouched", "[green]yes[/green]" if result.untouched_ok else "[red]NO[/red]"),
        (labels[5], "[green]yes[/green]" if result.read_done_ok else "[red]NO[/red]"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print("[green]OK[/green]" if result.ok else "[red]FAILED[/red]")


def _write_json(path: Optional[str], data: Any) -> None:
    if not path:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as fh:
            json.dump(data, fh, indent=2, default=str)
    except OSError as exc:
        raise RunFailed(f"could not write {path}: {exc.strerror or exc}", "choose another --json path") from exc


def run_loopback_command(args: argparse.Namespace) -> int:
    cfg = loopback_config(args)
    from kvxfer.harness.loopback import run_loopback

    with DelayedProgress(f"loopback on {cfg.backend}", enabled=not args.quiet) as progress:
        result = run_loopback(cfg, on_phase=progress.phase)
    if result.transfer_s > 0:  # figures exist only once the pull ran
        print_loopback(result)
    _write_json(args.json, result.to_json())
    if result.ok:
        return 0
    why = result.error or ("the pulled bytes differ from the source" if not result.verified else
                           "destination blocks outside the request changed" if not result.untouched_ok else
                           "the prefill side did not get exactly one read-done")
    raise RunFailed(f"loopback on {cfg.backend} failed: {why}", "rerun with --debug for the details",
                    child_traceback=result.extra.get("child_traceback", ""))


# ---------------------------------------------------------------- soak

def soak_config(args: argparse.Namespace) -> Any:
    from kvxfer.backends import default_backend_name
    from kvxfer.harness.soak import SoakConfig

    cfg = SoakConfig(backend=args.backend or default_backend_name(), handoffs=args.handoffs, in_flight=args.in_flight,
                     seed=args.seed, timeout_s=args.timeout)
    most = cfg.pool_blocks // cfg.max_blocks - 1  # keep one request's worth of blocks free on the decode side
    if cfg.in_flight > most:
        raise UsageError(f"--in-flight {cfg.in_flight} does not fit the soak's {cfg.pool_blocks}-block pools "
                         f"(requests of up to {cfg.max_blocks} blocks)", f"give --in-flight between 1 and {most}")
    return cfg


def run_soak_command(args: argparse.Namespace) -> int:
    from kvxfer.harness.soak import run_soak

    cfg = soak_config(args)
    with DelayedProgress(f"soak on {cfg.backend}: handoffs verified", total=cfg.handoffs,
                         enabled=not args.quiet) as progress:
        report = run_soak(cfg, on_progress=progress.advance_to)
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
    _write_json(args.json, report.to_json())
    console.print("[green]OK[/green]" if report.ok else "[red]FAILED[/red]")
    if report.ok:
        return 0
    why = (report.failures[0] if report.failures else
           f"{report.mismatches} byte mismatches" if report.mismatches else
           "blocks, handles or reservations were still held at the end")
    raise RunFailed(f"soak on {cfg.backend} failed: {why}", "the table above has the counts; rerun with --debug",
                    child_traceback=report.extra.get("child_traceback", ""))


# ---------------------------------------------------------------- generate

def check_prompts(path: str) -> int:
    """The number of prompts in ``path``; a file that cannot be read as prompts raises ``UsageError``."""
    from engine_integration.prompts import read_prompts  # not launch: that imports torch and the engines

    shape = "each line must be a JSON list of token ids, e.g. [1, 2, 3]"
    try:
        lines = Path(path).read_text().splitlines()
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a text file", "give a JSON-lines file of token-id lists") from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}", "check the --prompts path") from None
    for number, line in enumerate(lines, 1):
        try:
            json.loads(line) if line.strip() else None
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{number}: not JSON ({exc.msg})", shape) from None
    try:
        prompts = read_prompts(path)
    except ValueError as exc:
        raise UsageError(str(exc), shape) from None
    if not prompts:
        raise UsageError(f"{path} holds no prompts", "add one JSON list of token ids per line")
    return len(prompts)


def run_generate(args: argparse.Namespace) -> int:
    if args.backend and not args.disagg:
        raise UsageError("--backend only applies to a disaggregated run", "add --disagg, or drop --backend")
    control_plane = getattr(args, "control_plane", None)
    if control_plane and not args.disagg:
        raise UsageError("--control-plane only applies to a disaggregated run", "add --disagg, or drop --control-plane")
    count = check_prompts(args.prompts)
    from engine_integration.launch import run_generate_command
    from kvxfer.backends import default_backend_name

    backend = args.backend or default_backend_name()
    if control_plane:
        from engine_integration.control_plane import push_refusal

        refused = push_refusal(control_plane, backend)
        if refused:
            raise UsageError(refused, "drop --control-plane, or choose a pull backend: --backend ucx or nixl")
    where = f"disaggregated on {backend}" if args.disagg else "co-located"
    if control_plane:
        where += f", control plane {control_plane}"
    with DelayedProgress(f"generating {count} prompt(s), {where}", enabled=not args.quiet):
        status = run_generate_command(args.prompts, args.max_new_tokens, disagg=args.disagg, backend=backend,
                                      timings=args.timings, control_plane=control_plane)
    if status != 0:
        raise RunFailed("some requests failed", "each failed prompt's line on stdout says why")
    return 0
