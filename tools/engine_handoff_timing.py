"""Handoff time per request next to prefill compute time, for a batch of prompts.

    PYTHONPATH=. python tools/engine_handoff_timing.py --backend local --prompts 32

Per request: ``prefill_s`` (prefill compute on the prefill engine), ``pull_s`` (from
posting the one-sided read to the decode loop seeing it complete), ``decode_queue_s``
(waiting in the decode FIFO for blocks) and ``handoff_s`` (at the coordinator: from
the prefill's handoff message to the decode's transfer-ready, i.e. routing + queue +
pull + notification). Also checks the tokens against co-located generation.
"""

from __future__ import annotations

import argparse
import json
import statistics

from engine_integration.launch import ClusterConfig, DisaggCluster, generate_colocated


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="local")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--sequential", action="store_true", help="one request at a time (no queueing)")
    args = ap.parse_args()
    prompts = [[(13 * i + 7 * j) % 256 for j in range(8 + (i * 7) % 57)] for i in range(args.prompts)]
    expected = generate_colocated(prompts, args.max_new_tokens)
    with DisaggCluster(ClusterConfig(backend=args.backend)) as cluster:
        cluster.generate(prompts[:2], 2)  # warm-up (first-touch, connection setup)
        if args.sequential:
            results = [cluster.generate([p], args.max_new_tokens)[0] for p in prompts]
        else:
            results = cluster.generate(prompts, args.max_new_tokens)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert [r.tokens for r in results] == [r.tokens for r in expected], "disaggregated != co-located"
    summary = {"backend": args.backend, "prompts": len(prompts), "sequential": args.sequential,
               "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))]}
    for key in ("prefill_s", "pull_s", "decode_queue_s", "handoff_s", "total_s"):
        vals = sorted(r.timings[key] * 1e3 for r in results)
        summary[key.replace("_s", "_ms")] = {"median": round(statistics.median(vals), 3),
                                             "p90": round(vals[int(0.9 * (len(vals) - 1))], 3),
                                             "mean": round(statistics.fmean(vals), 3)}
    summary["pulled_blocks_total"] = sum(r.pulled_blocks for r in results)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
