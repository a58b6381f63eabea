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

SOURCE_ORDER = ("local", "nixl", "ucx", "nccl", "naive-nixl", "mooncake", "ucp-get-cold", "ucx-perftest", "memcpy")
CEILINGS = ("memcpy", "ucx-perftest", "ucp-get-cold")


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


def _x(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


COLUMNS = (("source", "left"), ("slice", "right"), ("blocks", "right"), ("pattern", "left"), ("bytes", "right"),
           ("desc raw", "right"), ("desc", "right"), ("build ms", "right"), ("post ms", "right"), ("p50 ms", "right"),
           ("p99 ms", "right"), ("GB/s", "right"), ("gather GB/s", "right"), ("x gather", "right"),
           ("get GB/s", "right"), ("x get", "right"), ("read-done ms", "right"), ("verified", "left"))


def row_cells(r: PointResult) -> list[str]:
    """One table row, the same in the terminal and in markdown (the verified cell is added by each)."""
    get = f"{_gbps(r.get_gbps)} @{size_label(r.get_size)}" if r.get_gbps is not None and r.get_size else "-"
    return [r.source, size_label(r.slice_bytes), str(r.num_blocks), pattern_label(r), size_label(r.bytes),
            f"{r.raw_descriptors:,}", f"{r.descriptors:,}", _ms(r.build_ms), _ms(r.post_ms), _ms(r.transfer_ms_p50),
            _ms(r.transfer_ms_p99), _gbps(r.gbps), _gbps(r.gather_gbps), _x(r.vs_gather), get, _x(r.vs_get),
            _ms(r.read_done_ms_p50)]


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
    for name, justify in COLUMNS:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in sorted(report.results, key=sort_key):
        verified = "[green]yes[/green]" if r.ok else f"[red]{r.error or 'NO'}[/red]"
        table.add_row(*row_cells(r), verified)
    return table


def ceiling_summary(report: BenchReport) -> list[dict[str, Any]]:
    """Per (backend, plain/reshard, pattern): medians of the ratios to both ceilings, and the 16-block latency."""
    import statistics

    groups: dict[tuple, list[PointResult]] = {}
    for r in report.results:
        if r.kind == "backend" and r.ok:
            groups.setdefault((r.source, r.reshard, r.pattern), []).append(r)
    rows = []
    for (source, reshard, pattern), rs in sorted(groups.items(), key=lambda kv: (sort_key(kv[1][0]), kv[0])):
        gather = [r.vs_gather for r in rs if r.vs_gather]
        get = [r.vs_get for r in rs if r.vs_get]
        # the small request: 16 blocks (smallest slice); else the group's fewest blocks
        small = sorted(rs, key=lambda r: (r.num_blocks != 16, r.num_blocks, r.slice_bytes))
        rows.append({"source": source, "pattern": pattern + (" tp2->1" if reshard else ""), "points": len(rs),
                     "vs_gather_median": statistics.median(gather) if gather else None,
                     "vs_gather_range": (min(gather), max(gather)) if gather else None,
                     "vs_get_median": statistics.median(get) if get else None,
                     "vs_get_range": (min(get), max(get)) if get else None,
                     "gbps_median": statistics.median(r.gbps or 0.0 for r in rs),
                     "small": small[0] if small else None})
    return rows


def target_lines(targets: dict[str, Any]) -> list[str]:
    """The three targets as plain sentences (measured, stated, not asserted)."""
    lines = []
    t = targets.get("large_reads_vs_ucx_perftest", {})
    if t.get("backends"):
        for name, e in t["backends"].items():
            vs_mean = (f"; {e['median_ratio_vs_mean']:.2f}x of its mean throughput"
                       if e.get("median_ratio_vs_mean") else "")
            lines.append(f"coalesced >= 1 MiB reads vs {t.get('reference', 'ucx-perftest')} ({t['target']}): {name} "
                         f"median {e['median_ratio']:.2f}x of its median-get GB/s (min {e['min_ratio']:.2f}x, "
                         f"{len(e['points'])} points){vs_mean} -> {'met' if e['met'] else 'NOT met'}")
    else:
        lines.append(f"coalesced >= 1 MiB reads vs ucp_get: {t.get('status', 'not measured')}")
    t = targets.get("reshard_vs_plain", {})
    if t.get("backends"):
        for name, e in t["backends"].items():
            lines.append(f"TP 2 -> 1 reshard vs plain pull ({t['target']}): {name} median {e['median_ratio']:.2f}x "
                         f"(min {e['min_ratio']:.2f}x, {len(e['points'])} points) -> {'met' if e['met'] else 'NOT met'}")
    elif t:
        lines.append(f"TP 2 -> 1 reshard vs plain pull: {t.get('status', 'not measured')}")
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
    wide = console if console.width >= 210 else Console(width=210, file=console.file, force_terminal=console.is_terminal)
    wide.print(results_table(report))  # 18 columns: never squeeze them into 80
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
    write_report(report.to_json(), path)


def write_report(data: Any, path: "Path | str", console: Optional[Console] = None) -> Path:
    """A benchmark's JSON report at ``path`` (its folder made); says where on ``console`` if given."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
    if console is not None:
        console.print(f"wrote {path}", highlight=False)
    return path


def plot_lines(results: Sequence[PointResult], pattern: str) -> dict[str, list[tuple[int, float]]]:
    """Per source, (slice size, GB/s) using the largest request at each size (ucx_perftest in both panels)."""
    best: dict[tuple[str, int], PointResult] = {}
    for r in results:
        if not r.ok or not r.gbps or (r.pattern != pattern and r.source not in ("ucx-perftest", "ucp-get-cold")):
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
            style = "--" if source in CEILINGS else ":" if "tp2->1" in source else "-"
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


def _region(report: BenchReport) -> int:
    regions = [r.extra.get("region_bytes") for r in report.results if r.source == "ucp-get-cold"]
    return max([r for r in regions if r] or [0])


def ceiling_lines(report: BenchReport) -> list[str]:
    """The summary: every backend against the two ceilings measured in this run, and its latency."""
    rows = ceiling_summary(report)
    if not rows:
        return []
    out = ["", "## Against the ceilings (same run)", "",
           "Medians over each group's points of the point's GB/s divided by its own ceilings (range in brackets): "
           "*x gather* against the same-process gather copy of exactly its slices, *x get* against two-process "
           "`ucp_get` over buffers larger than the LLC at its coalesced message size. Latency: the group's "
           "16-block request with the smallest slice, p50 / p99 per request. A ratio above 1x to *gather* means the "
           "transport copied faster than that torch copy, which makes two passes (`index_select` into a temporary, "
           "then `index_copy_`) where a CMA read is one kernel copy: it is the pattern's cost for a same-process "
           "torch gather, not a hard bound.", "",
           "| backend | pattern | points | median GB/s | x gather | x get | request | p50 ms | p99 ms |",
           "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for row in rows:
        def ratio(key: str) -> str:
            med, rng = row[key + "_median"], row[key + "_range"]
            return "-" if med is None else f"{med:.2f}x ({rng[0]:.2f}-{rng[1]:.2f})"
        small = row["small"]
        req = f"{small.num_blocks} x {size_label(small.slice_bytes)}" if small else "-"
        out.append(f"| {row['source']} | {row['pattern']} | {row['points']} | {row['gbps_median']:.2f} | "
                   f"{ratio('vs_gather')} | {ratio('vs_get')} | {req} | {_ms(small.transfer_ms_p50 if small else None)} | "
                   f"{_ms(small.transfer_ms_p99 if small else None)} |")
    return out


def markdown(report: BenchReport, plot_name: Optional[str], command: str, json_name: Optional[str] = None,
             note: Optional[str] = None) -> str:
    """``docs/benchmarks.md``: the command, the machine, the targets, the plot, the table."""
    m = report.machine
    v = m["versions"]
    out = ["# Benchmarks", "",
           "Produced by `kvxfer bench` (`kvxfer/bench/`); regenerate with:", "", "```", command, "```", "",
           f"Run {report.started_utc}, {report.runtime_s:.0f} s, {len(report.results)} points, "
           + ("every transfer verified byte for byte." if report.ok else "**some points failed (see the table)**.")
           + (f" Every figure and sample, with the machine: [{Path(json_name).name}]({json_name})." if json_name else "")
           + " Every ratio on this page is within this one run.", "",
           *([f"**Note:** {note}", ""] if note else []),
           "## Machine", "",
           f"- CPU: {m['cpu_model']}, {m['logical_cores']} logical cores ({m['usable_cores']} usable)",
           f"- last-level cache: {size_label(m.get('llc_bytes') or 0)} (sysfs, cpu0)",
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
    out += ceiling_lines(report)
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
            "`kvxfer.runtime.multi_pull.begin_pull_from_peers`, verified against the joined heads; every backend "
            "of the run gets them.",
            "- *gather* (per point, same run): right after the point, in the decode worker, a same-process copy of "
            "exactly the point's slices -- the same ids per repeat, the same pool shapes, into the decode's own pool -- "
            "as 8-byte words, one `index_select` + `index_copy_` per K/V plane (for TP 2 -> 1: each source rank's "
            "heads into its head range of every token row). It is the memory-bandwidth limit of the pattern; "
            "*x gather* = the point's GB/s / the gather's GB/s (both at their p50). The first copy is checked.",
            f"- *get* (per message size, same run): `ucp-get-cold`, two processes, `ucp_get_nbx` through kvxfer's UCP "
            f"binding on an endpoint without peer error handling (ucx_perftest's default, so the same protocol), "
            f"cycling through a source and a destination region of {size_label(_region(report))} each "
            + (f"(> the {size_label(m.get('llc_bytes') or 0)} last-level cache, so no get is served from cache), "
               if _region(report) > (m.get("llc_bytes") or 0) else
               f"(NOT larger than the {size_label(m.get('llc_bytes') or 0)} last-level cache in this run: "
               "--get-region-mib was set lower, so its figures are cache-warm), ")
            + "up to 128 gets "
            "(4 MiB) posted per batch; per-get time = batch time / gets. Measured at every coalesced message size "
            "the plain pulls post (a slice; a contiguous request's run, blocks x slice). *get GB/s @size* is that "
            "figure at the largest measured size not above the point's mean descriptor; *x get* = point GB/s / it. "
            "ucx_perftest 1.22 cannot do this itself: its options (`-s`, `-n`, `-w`, `-O`, `-D iov` with `-i` spacing "
            "one message's entries) always reread one buffer of the message size, which stays in cache.",
            "- Baselines: *naive-nixl* is the reference's way (one descriptor per (block, plane) built in Python per request, "
            "`initialize_xfer`, raw `nixl_agent`, two processes, same ids, same verification); *ucx-perftest* is "
            "`ucx_perftest -t ucp_get` (server + client on 127.0.0.1, window 1, its one cache-warm buffer) at every power "
            "of two in the slice range and every coalesced size; *mooncake* is `batch_transfer_sync_read` over TCP "
            "(P2P handshake) of the same coalesced runs kvxfer plans; *memcpy* is one flat same-process `memmove` of "
            "the request's bytes (one run: the limit of a flat copy, not of the pattern).",
            "- *p50/p99* are per request over the measured repeats (with 10 repeats p99 is close to the slowest); for "
            "ucp-get-cold they are per get; ucx_perftest reports a median and a mean, no p99.",
            "- Waits poll every ~20 us (no GIL-holding spin that would starve a transport's progress thread on 2 cores).",
            *push_lines(report),
            "", "## Not measured here", ""]
    out += [f"- **{u.name}**: {u.reason}" for u in report.unavailable] or ["- (everything requested ran)"]
    out += [f"- TP reshard axis: {report.reshard_axis}", ""]
    if plot_name:
        out += ["## Plot", "", f"![GB/s vs slice size]({plot_name})", ""]
    out += ["## Results", "",
            "Times are per request, over the measured repeats (warm-up excluded). *build*: descriptor build (median); "
            "*post*: the call that posts the reads (median); *p50/p99*: request start (build included) to every byte "
            "landed; *read-done*: from the reader's completion to the source seeing the notification (negative: the "
            "source saw it first). GB/s = bytes / p50 (1 GB = 1e9 B). *gather GB/s*, *x gather*, *get GB/s @size*, "
            "*x get*: the point's two ceilings and its ratio to each (see above). ucx_perftest and ucp-get-cold rows "
            "are single gets of one message; memcpy is one flat same-process copy of the same bytes.", "",
            "| " + " | ".join(name for name, _ in COLUMNS) + " |",
            "|" + "|".join("---" if justify == "left" else "---:" for _, justify in COLUMNS) + "|"]
    for r in sorted(report.results, key=sort_key):
        verified = "yes" if r.ok else f"**{r.error or 'NO'}**"
        out.append("| " + " | ".join(row_cells(r) + [verified]) + " |")
    return "\n".join(out) + "\n"
