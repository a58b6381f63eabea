"""``kvxfer bench-vllm``: the same prompts through vLLM P/D with KvxferConnector (nixl, ucx) and
vLLM's own NixlConnector, in one run, on this machine.

Per connector: a prefill instance (core 0) and a decode instance (core 1) are started
(``kvxfer.drive.vllm_engine`` in the vLLM environment), three warm-up handoffs pay the
handshakes, then every prompt goes prefill (``do_remote_decode``, ``max_tokens=1``) ->
decode (its ``kv_transfer_params``, ``max_tokens=1``), one at a time, so each decode-side
handoff is timed alone. Measured, identically for both connectors (``vllm_timing``): the
handoff on the decode worker, from the step that asks for the request's KV to the step
that reports it received; TTFT of the decode request as the client sees it; bytes and
descriptors per handoff; and whether the decode's tokens equal co-located generation
(a final batched pass with ``max_tokens=4``). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

from kvxfer.drive.vllm_control import VllmInstance, VllmInstanceError, vllm_python

TARGETS = {  # name -> (driver connector, kv_connector_extra_config, environment)
    "kvxfer-nixl": ("timed-kvxfer", {"backend": "nixl"}, {}),
    # NIXL's progress thread as vLLM's NixlConnector runs it: a busy loop (kvxfer's default pauses 2 ms)
    "kvxfer-nixl-busy": ("timed-kvxfer", {"backend": "nixl"}, {"KVXFER_NIXL_PROGRESS_DELAY_US": "0"}),
    # a one-host deployment: NIXL's UCX without peer failure handling reads over CMA (docs/environment.md)
    "kvxfer-nixl-same-host": ("timed-kvxfer", {"backend": "nixl"}, {"KVXFER_NIXL_SAME_HOST": "1"}),
    "kvxfer-ucx": ("timed-kvxfer", {"backend": "ucx"}, {}),
    # the same without polling reads in the engine step (completion_spin_us, default 200): does the spin pay?
    "kvxfer-ucx-nospin": ("timed-kvxfer", {"backend": "ucx", "completion_spin_us": 0}, {}),
    "vllm-nixl": ("timed-nixl", {"backends": ["UCX"]}, {}),
}
#: KvxferConnector's handoff p50 must be at most this fraction of NixlConnector's (issue 20).
TARGET_RATIO = 0.8


def check_args(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Problems with the arguments, as ``(what, how to fix)``; empty when fine."""
    problems = []
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        problems.append((f"--targets {args.targets!r} names unknown targets {unknown}",
                         f"choose from {', '.join(TARGETS)}"))
    if not 1 <= args.prompts <= 10000:
        problems.append((f"--prompts {args.prompts} is out of range", "give 1..10000"))
    if not 1 <= args.min_tokens <= args.max_tokens <= 1900:
        problems.append((f"--min-tokens {args.min_tokens} / --max-tokens {args.max_tokens} are out of range",
                         "1 <= min <= max <= 1900: the bench model's max_model_len is 2048"))
    if vllm_python() is None:
        problems.append(("no vLLM environment", "run `bash tools/bootstrap.sh` (it builds .venv-vllm) or set "
                                                "KVXFER_VLLM_PYTHON"))
    return problems


def _percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _engine_args(model: str, connector: str, role: str, extra: dict[str, Any], port: int) -> list[str]:
    return ["--model", model, "--connector", connector, "--role", role, "--extra", json.dumps(extra),
            "--kv-port", str(port), "--blocks", "2048"]


def run_target(name: str, model: str, prompts: list[list[int]], side_port: int) -> dict[str, Any]:
    connector, extra, target_env = TARGETS[name]
    env = {**target_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port)}
    with ExitStack() as stack:
        prefill = VllmInstance(f"{name}-prefill", _engine_args(model, connector, "kv_producer", extra, 0), cpu="0",
                               env=env)
        stack.callback(prefill.close)
        decode = VllmInstance(f"{name}-decode", _engine_args(model, connector, "kv_consumer", extra, 0), cpu="1",
                              env={**target_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port + 1)})
        stack.callback(decode.close)
        prefill.wait_ready()
        decode.wait_ready()
        rng = random.Random(1)
        for i in range(3):  # warm-up: handshakes, first-use allocations
            warm = [rng.randrange(1, 1000) for _ in range(64 + 32 * i)]
            ticket = prefill.generate([{"prompt": warm, "max_tokens": 1, "params": {"do_remote_decode": True}}])
            decode.generate([{"prompt": warm, "max_tokens": 1, "params": ticket["outputs"][0]["params"]}])
        before = decode.stats()["connector"][0]
        ttft = []
        for p in prompts:
            ticket = prefill.generate([{"prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}}])
            t0 = time.perf_counter()
            decode.generate([{"prompt": p, "max_tokens": 1, "params": ticket["outputs"][0]["params"]}])
            ttft.append(time.perf_counter() - t0)
        after = decode.stats()
        timing = after["connector"][0]
        handoffs = timing["bench_handoff_s"][len(before["bench_handoff_s"]):]
        n = max(1, len(handoffs))
        # correctness: all prompts again, batched, 4 tokens, against co-located generation (after the
        # timed part, so every target's pools start the same)
        reference = [o["tokens"] for o in prefill.generate([{"prompt": p, "max_tokens": 4} for p in prompts],
                                                           timeout_s=600)["outputs"]]
        tickets = prefill.generate([{"prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}}
                                    for p in prompts], timeout_s=600)
        out = decode.generate([{"prompt": p, "max_tokens": 4, "params": o["params"]}
                               for p, o in zip(prompts, tickets["outputs"])], timeout_s=600)
        equal = sum(o["tokens"] == r for o, r in zip(out["outputs"], reference))
        phases = _kvxfer_phases(timing.get("recent", []), len(handoffs))
        return {
            "target": name, "connector": connector, "extra": extra, "prompts": len(prompts),
            "handoffs_timed": len(handoffs),
            "handoff_p50_ms": 1000 * _percentile(handoffs, 0.5) if handoffs else None,
            "handoff_p99_ms": 1000 * _percentile(handoffs, 0.99) if handoffs else None,
            "ttft_p50_ms": 1000 * statistics.median(ttft), "ttft_p99_ms": 1000 * _percentile(ttft, 0.99),
            "bytes_per_handoff": (timing["bench_bytes"] - before["bench_bytes"]) / n,
            "descriptors_per_handoff": (timing["bench_descriptors"] - before["bench_descriptors"]) / n,
            "tokens_equal": equal, "tokens_total": len(prompts),
            "decode_prompt_tokens": after["prompt_tokens"], "kvxfer_phases_p50_ms": phases,
            "startup_s": [prefill.startup_s, decode.startup_s], "reference": reference,
        }


def _kvxfer_phases(recent: list[dict[str, Any]], count: int) -> Optional[dict[str, float]]:
    """KvxferConnector only: where a timed handoff's time went (p50 ms from the step's metadata):
    ticket, handshake and layouts checked; reads posted (planning); lease read posted (data landed); done."""
    timed = [r for r in recent if "handoff_s" in r][-count:] if count else []
    if not timed:
        return None
    out = {}
    for key, name in (("checked_s", "checked"), ("data_posted_s", "data_posted"), ("lease_posted_s", "lease_posted"),
                      ("handoff_s", "done")):
        values = [r[key] for r in timed if key in r]
        if values:
            out[name] = 1000 * statistics.median(values)
    return out


def run_vllm_bench(args: argparse.Namespace, progress=print) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(args.min_tokens, args.max_tokens))]
               for _ in range(args.prompts)]
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    with tempfile.TemporaryDirectory(prefix="kvxfer-vllm-bench-") as tmp:
        model = args.model
        if model is None:
            import subprocess

            model = str(Path(tmp) / "tiny-llama")
            subprocess.run([vllm_python(), "-m", "kvxfer.drive.vllm_model", model], check=True, capture_output=True,
                           timeout=300)
        results = []
        for i, name in enumerate(targets):
            progress(f"bench-vllm: {name} ({i + 1}/{len(targets)}) ...")
            try:
                result = run_target(name, model, prompts, 15600 + 10 * i)
            except VllmInstanceError as exc:
                result = {"target": name, "error": str(exc)[-3000:]}
            results.append(result)
    references = [r.pop("reference") for r in results if "reference" in r]
    same_reference = all(ref == references[0] for ref in references)
    report: dict[str, Any] = {"command": "kvxfer bench-vllm", "prompts": args.prompts,
                              "prompt_tokens": [args.min_tokens, args.max_tokens], "seed": args.seed,
                              "results": results, "target_ratio": TARGET_RATIO,
                              "co_located_outputs_agree_across_targets": same_reference}
    base = next((r for r in results if r.get("target") == "vllm-nixl" and r.get("handoff_p50_ms")), None)
    for r in results:
        if base and r.get("handoff_p50_ms") is not None:
            r["handoff_p50_vs_vllm_nixl"] = r["handoff_p50_ms"] / base["handoff_p50_ms"]
    return report


def render(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"vLLM P/D handoffs: {report['prompts']} prompts of {report['prompt_tokens'][0]}-"
                        f"{report['prompt_tokens'][1]} tokens, one at a time")
    for column in ("target", "handoff p50", "p99", "vs vllm-nixl", "TTFT p50", "p99", "KiB", "descr",
                   "tokens"):
        table.add_column(column, justify="right" if column != "target" else "left")
    for r in report["results"]:
        if "error" in r:
            table.add_row(r["target"], "failed: " + r["error"].splitlines()[0][:60], *[""] * 7)
            continue
        ratio = r.get("handoff_p50_vs_vllm_nixl")
        table.add_row(r["target"], f"{r['handoff_p50_ms']:.2f}", f"{r['handoff_p99_ms']:.2f}",
                      "" if ratio is None else f"{ratio:.2f}x", f"{r['ttft_p50_ms']:.2f}", f"{r['ttft_p99_ms']:.2f}",
                      f"{r['bytes_per_handoff'] / 1024:.0f}", f"{r['descriptors_per_handoff']:.1f}",
                      f"{r['tokens_equal']}/{r['tokens_total']}")
    console.print(table)
    console.print("times in ms, on the decode; KiB and descr(iptors) per handoff; tokens: decode output equal to "
                  "co-located generation", highlight=False)
