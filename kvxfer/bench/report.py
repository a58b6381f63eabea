"""Presenting a bench run: progress bars, the rich table, JSON, the PNG and markdown.

Nothing here measures; everything reads ``BenchReport`` so the terminal, the JSON
file and ``docs/benchmarks.md`` always show the same numbers.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvxfer.bench.results import PointResult
from kvxfer.bench.run import BenchReport

SOURCE_ORDER = ("local", "nixl", "ucx", "nccl", "naive-nixl", "mooncake", "ucx-perftest", "memcpy")


def size_label(num_bytes: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else (f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}")


def pattern_label(r: PointResult) -> str:
    """The id pattern, plus the TP change for reshard points."""
    return f"{r.pattern} tp2->1" if r.reshard else r.pattern


def _gbps(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


@contextmanager
def rich_progress(console: Console) -> Iterator[Callable[[str, int], Callable[[PointResult], None]]]:
    """Progress bars, one per backend/baseline; each finished point is printed above them."""
    with Progress(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as bars:

        def start(name: str, total: int) -> Callable[[PointResult], None]:
            task = bars.add_task(name, total=total)

            def done(res: PointResult) -> None:
                bars.advance(task)
                status = "[green]ok[/green]" if res.ok else f"[red]{res.error or 'not verified'}[/red]"
                bars.console.print(f"  {res.source:<13} {size_label(res.slice_bytes):>8} x {res.num_blocks:<4} "
                                   f"{pattern_label(res):<17} {_gbps(res.gbps):>7} GB/s  p50 {_ms(res.transfer_ms_p50)} ms  {status}")

            return done

        yield start


def sort_key(r: PointResult) -> tuple:
    order = SOURCE_ORDER.index(r.source) if r.source in SOURCE_ORDER else len(SOURCE_ORDER)
    return (order, r.source, r.reshard, r.pattern, r.slice_bytes, r.num_blocks)


def results_table(report: BenchReport, title: str = "kvxfer bench") -> Table:
    table = Table(title=title)
    for name, justify in (("source", "left"), ("slice", "right"), ("blocks", "right"), ("pattern", "left"),
                          ("bytes", "right"), ("desc raw", "right"), ("desc", "right"), ("build ms", "right"),
                          ("post ms", "right"), ("p50 ms", "right"), ("p99 ms", "right"), ("GB/s", "right"),
                          ("read-done ms", "right"), ("verified", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in sorted(report.results, key=sort_key):
        verified = "[green]yes[/green]" if r.ok else f"[red]{r.error or 'NO'}[/red]"
        table.add_row(r.source, size_label(r.slice_bytes), str(r.num_blocks), pattern_label(r), size_label(r.bytes),
                      f"{r.raw_descriptors:,}", f"{r.descriptors:,}", _ms(r.build_ms), _ms(r.post_ms),
                      _ms(r.transfer_ms_p50), _ms(r.transfer_ms_p99), _gbps(r.gbps), _ms(r.read_done_ms_p50), verified)
    return table


def target_lines(targets: dict[str, Any]) -> list[str]:
    """The three targets as plain sentences (measured, stated, not asserted)."""
    lines = []
    t = targets.get("large_reads_vs_ucx_perftest", {})
    if t.get("backends"):
        for name, e in t["backends"].items():
            vs_mean = (f"; {e['median_ratio_vs_mean']:.0%} of its mean throughput"
                       if e.get("median_ratio_vs_mean") else "")
            lines.append(f"coalesced >= 1 MiB reads vs ucx_perftest ucp_get ({t['target']}): {name} median "
                         f"{e['median_ratio']:.0%} of its median-get GB/s (min {e['min_ratio']:.0%}, "
                         f"{len(e['points'])} points){vs_mean} -> {'met' if e['met'] else 'NOT met'}")
    else:
        lines.append(f"coalesced >= 1 MiB reads vs ucx_perftest: {t.get('status', 'not measured')}")
    t = targets.get("scattered_32k_vs_naive_nixl", {})
    if t.get("backends"):
        for name, e in t["backends"].items():
            pts = ", ".join(f"{p['num_blocks']} blocks {p['speedup']:.2f}x" for p in e["points"])
            lines.append(f"scattered 32 KiB vs naive NIXL ({t['target']}): {name} {pts} -> "
                         f"{'met' if e['met'] else 'NOT met'}")
    else:
        lines.append(f"scattered 32 KiB vs naive NIXL: {t.get('status', 'no kvxfer backend point to compare')}")
    t = targets.get("reshard_descriptor_build", {})
    if "flat" in t:
        forms = ", ".join(f"{form} {t[form]['build_ms_p50']:.2f} ms ({t[form]['descriptors']:,} rows)"
                          for form in ("flat", "strided"))
        lines.append(f"reshard descriptor build, {t['case']} ({t['target']}): {forms} -> {'met' if t['met'] else 'NOT met'}")
    else:
        lines.append(f"reshard descriptor build: {t.get('status', 'not measured')}")
    return lines


def print_report(report: BenchReport, console: Console) -> None:
    wide = console if console.width >= 170 else Console(width=170, file=console.file, force_terminal=console.is_terminal)
    wide.print(results_table(report))  # 14 columns: never squeeze them into 80
    for u in report.unavailable:
        console.print(f"[yellow]{u.name}: not available:[/yellow] {u.reason}")
    console.print(f"reshard axis: {report.reshard_axis}")
    for line in target_lines(report.targets):
        console.print(f"target: {line}")
    m = report.machine
    console.print(f"machine: {m['cpu_model']}, {m['logical_cores']} cores, {(m['memory_bytes'] or 0) / 2**30:.0f} GiB, "
                  f"kernel {m['kernel']}, load {m['load_average_start']} -> {m.get('load_average_end')}")
    console.print(f"{len(report.results)} points in {report.runtime_s:.1f} s: "
                  + ("[green]every point verified[/green]" if report.ok else "[red]some points failed[/red]"))


def write_json(report: BenchReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=2, default=str))


def plot_lines(results: Sequence[PointResult], pattern: str) -> dict[str, list[tuple[int, float]]]:
    """Per source, (slice size, GB/s) using the largest request at each size (ucx_perftest in both panels)."""
    best: dict[tuple[str, int], PointResult] = {}
    for r in results:
        if not r.ok or not r.gbps or (r.pattern != pattern and r.source != "ucx-perftest"):
            continue
        key = (f"{r.source} tp2->1" if r.reshard else r.source, r.slice_bytes)
        if key not in best or r.bytes > best[key].bytes:
            best[key] = r
    lines: dict[str, list[tuple[int, float]]] = {}
    for (source, size), r in sorted(best.items(), key=lambda kv: kv[0][1]):
        lines.setdefault(source, []).append((size, r.gbps or 0.0))
    return lines


def write_plot(report: BenchReport, path: Path) -> Optional[str]:
    """GB/s vs slice size, contiguous and scattered panels. Returns why not, when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter
    except ImportError:
        return "matplotlib is not installed (pip install 'kvxfer[bench]'); no plot written"
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, pattern in zip(axes, ("contiguous", "scattered")):
        lines = plot_lines(report.results, pattern)
        for source in sorted(lines, key=lambda s: (SOURCE_ORDER.index(s.split()[0]) if s.split()[0] in SOURCE_ORDER
                                                   else 99, s)):
            xs, ys = zip(*lines[source])
            style = "--" if source in ("memcpy", "ucx-perftest") else ":" if "tp2->1" in source else "-"
            ax.plot(xs, ys, style, marker="o", label=source)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r.slice_bytes for r in report.results}))
        ax.set_xticklabels([size_label(s) for s in sorted({r.slice_bytes for r in report.results})], rotation=30)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{pattern} block ids")
        ax.set_xlabel("slice size (one block x one layer plane)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s (bytes / median request time)")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    m = report.machine
    fig.suptitle(f"kvxfer bench, {m['cpu_model']}, {m['usable_cores']} cores ({report.started_utc})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def perftest_protocols(report: BenchReport) -> list[str]:
    """A markdown line saying which UCX protocol/transport served ucx_perftest's gets (UCX_PROTO_INFO)."""
    rows = sorted({row for r in report.results if r.source == "ucx-perftest" for row in r.extra.get("get_protocols", [])})
    return [f"- ucx_perftest `ucp_get` was served by: {'; '.join(rows)}"] if rows else []


def push_lines(report: BenchReport) -> list[str]:
    """How a push backend's points differ, when the run has any."""
    pushed = sorted({r.source for r in report.results if r.extra.get("direction") == "push"})
    if not pushed:
        return []
    names = ", ".join(f"*{n}*" for n in pushed)
    return [f"- Push backends ({names}): worker and source join one Gloo process group (TCP store on 127.0.0.1). "
            "Megatron's order: the decode posts its receives (*post*), then asks the source to push (one pipe "
            "message); *p50/p99* run from posting to every byte landed, so they include that message and the "
            "source's gather; *read-done* is the source's push completing. *desc raw/desc* are the byte runs gathered "
            "into one message per peer pair. TP reshard points: both prefill TP ranks live in the one source process "
            "(one rank of the group) and their messages pair by post order."]


def markdown(report: BenchReport, plot_name: Optional[str], command: str, json_name: Optional[str] = None) -> str:
    """``docs/benchmarks.md``: the command, the machine, the targets, the plot, the table."""
    m = report.machine
    v = m["versions"]
    out = ["# Benchmarks", "",
           "Produced by `kvxfer bench` (`kvxfer/bench/`); regenerate with:", "", "```", command, "```", "",
           f"Run {report.started_utc}, {report.runtime_s:.0f} s, {len(report.results)} points, "
           + ("every transfer verified byte for byte." if report.ok else "**some points failed (see the table)**.")
           + (f" Every figure and sample, with the machine: [{Path(json_name).name}]({json_name})." if json_name else ""), "",
           "## Machine", "",
           f"- CPU: {m['cpu_model']}, {m['logical_cores']} logical cores ({m['usable_cores']} usable)",
           f"- memory: {(m['memory_bytes'] or 0) / 2**30:.1f} GiB; kernel {m['kernel']}; Python {m['python']}",
           f"- torch {v['torch']}, numpy {v['numpy']}, nixl {v['nixl']}, libucx-cu12 {v['libucx-cu12']} ({v['ucx']})",
           f"- load average at start {m['load_average_start']}, at end {m.get('load_average_end')} "
           "(the machine was shared; figures are medians over repeats)",
           f"- UCX/NIXL environment: {m['env'] or '(defaults)'}; every UCX user here (NIXL's own UCX, the ucx "
           "backend, ucx_perftest) picks its transports from that same environment",
           *[f"- {name}: " + ", ".join(f"{k}={v}" for k, v in info.items()) for name, info in m.get("transports", {}).items()],
           *perftest_protocols(report),
           "",
           "## Targets (measured, not asserted)", ""]
    out += [f"- {line}" for line in target_lines(report.targets)]
    out += ["", "## How it is measured", "",
            "- Pool `[2, L, B, T=16, H=8, d]` bf16; the *slice* (one block x one K/V layer plane) is `16 x 8 x d x 2` bytes, "
            "swept by `d`. A request moves `blocks x 2L` slices; block counts are capped so a request stays under "
            "`--max-request-mib`.",
            "- Each kvxfer backend runs in a worker process (the decode side) that spawns the prefill side as a second "
            "process (`local` cannot cross processes: its source lives in the worker). The bench process only "
            "orchestrates, so a transport crash fails its points, not the run.",
            "- Per point: warm-up pulls (not measured), then the measured repeats. The first measured pull starts from a "
            "destination pool reset to a sentinel and is verified: SHA-256 of the pulled blocks equals the source's, and "
            "no other destination block changed. A point that fails verification is reported as an error, not a figure.",
            "- Scattered ids are a fresh random draw per repeat (from a pool twice the request); contiguous ids are one run.",
            "- TP reshard points: two prefill ranks (4 heads each) -> one decode rank (8 heads) through "
            "`kvxfer.runtime.multi_pull.begin_pull_from_peers`, verified against the joined heads.",
            "- Baselines: *naive-nixl* is the reference's way (one descriptor per (block, plane) built in Python per request, "
            "`initialize_xfer`, raw `nixl_agent`, two processes, same ids, same verification); *ucx-perftest* is "
            "`ucx_perftest -t ucp_get` (server + client on 127.0.0.1, window 1) at every power of two in the slice range; "
            "*mooncake* is `batch_transfer_sync_read` over TCP (P2P handshake) of the same coalesced runs kvxfer plans; "
            "*memcpy* is one flat same-process `memmove` of the request's bytes, the physical ceiling.",
            "- ucx_perftest reuses one buffer per message size (cache-warm up to the cache size) and keeps one get in "
            "flight; kvxfer requests read from pools twice their size. Its median get is the optimistic reference; its "
            "mean throughput is stated next to it.",
            "- Waits poll every ~20 us (no GIL-holding spin that would starve a transport's progress thread on 2 cores).",
            *push_lines(report),
            "", "## Not measured here", ""]
    out += [f"- **{u.name}**: {u.reason}" for u in report.unavailable] or ["- (everything requested ran)"]
    out += [f"- TP reshard axis: {report.reshard_axis}", ""]
    if plot_name:
        out += ["## Plot", "", f"![GB/s vs slice size]({plot_name})", ""]
    out += ["## Results", "",
            "Times are per request, medians over the measured repeats (warm-up excluded). *build*: descriptor build; "
            "*post*: the call that posts the reads; *p50/p99*: request start (build included) to every byte landed; "
            "*read-done*: from the reader's completion to the source seeing the notification (negative: the source saw "
            "it first). GB/s = bytes / p50 (1 GB = 1e9 B). ucx_perftest rows are single `ucp_get`s of one message; "
            "memcpy is one flat same-process copy of the same bytes.", "",
            "| source | slice | blocks | pattern | bytes | desc raw | desc | build ms | post ms | p50 ms | p99 ms | GB/s | read-done ms | verified |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(report.results, key=sort_key):
        verified = "yes" if r.ok else f"**{r.error or 'NO'}**"
        out.append(f"| {r.source} | {size_label(r.slice_bytes)} | {r.num_blocks} | {pattern_label(r)} | {size_label(r.bytes)} | "
                   f"{r.raw_descriptors:,} | {r.descriptors:,} | {_ms(r.build_ms)} | {_ms(r.post_ms)} | "
                   f"{_ms(r.transfer_ms_p50)} | {_ms(r.transfer_ms_p99)} | {_gbps(r.gbps)} | {_ms(r.read_done_ms_p50)} | {verified} |")
    return "\n".join(out) + "\n"
