"""A prefill worker starved of its GIL costs the decode nothing, and a dead one fails the load at once (issue 40,
item 0).

ucx without a cluster key (``KVXFER_SECRET_FILE`` unset): before a decode rank reads, its handshake cache's
confirmation thread asks each prefill source process whether it exported its meta (``confirm_rank_sources``,
``kvxfer/backends/ucx/confirm.py``). A daemon thread of the source used to answer, so only when the source's
main thread let go of the GIL, which vLLM's engine holds through long C calls; a small child process of the
source answers now (``confirm_server.py``), on the socket the source itself listens on. (Where that child
cannot start, the thread answers, and the decode's ``Receiver`` waits past ``2 * handshake_timeout_s + 1`` while
the confirmation waits on a source that lives: ``tests/backends/test_ucx_confirm_live_source.py``.)

Real processes (``tests/support/vllm_tp_ranks.py``): a TP 1 prefill rank (the worker's ``Sender``) pins a
request, then holds its GIL in C for ``HOLD_S`` from its main thread (``hold``); a TP 1 decode rank (the
worker's ``Receiver``, ``handshake_timeout_s`` 1 s, so the old bound is 3 s) loads it. It must finish
byte-exact during the hold, and the prefill must free the request on the read-done once the hold ends; a
source SIGKILLed during its hold must fail the load at once, well before the long bound the receiver allows.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import ExitStack

import pytest
import torch

from kvxfer.backends.same_host import LIVE_SOURCE_WAIT_S
from tests.support.vllm_tp_ranks import BLOCK, Prefill, Rank, dump, heads_of, released, submit, values

pytestmark = pytest.mark.timeout(240)

BACKEND = "ucx"
PREFILL_BLOCKS, DECODE_BLOCKS = 24, 40
GRACE_S = 60.0           # the pin outlives the hold: only the read-done may free it
HANDSHAKE_S = 1.0
OLD_BOUND_S = 2 * HANDSHAKE_S + 1
CONFIRM_LIMIT_S = 5.0    # the decode rank's transfer_timeout_s (tests/support/vllm_tp_ranks.py)
LONG_BOUND_S = OLD_BOUND_S + CONFIRM_LIMIT_S + LIVE_SOURCE_WAIT_S
HOLD_S = 8.0
SRC_BLOCKS, DST_BLOCKS = [3, 7, 8, 20, 0], [5, 6, 30, 1, 39]


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch):
    """A TP 1 prefill rank with ``req-a`` pinned and a TP 1 decode rank, no cluster key."""
    monkeypatch.delenv("KVXFER_SECRET_FILE", raising=False)
    monkeypatch.delenv("KVXFER_ALLOW_UNAUTHENTICATED_METAS", raising=False)
    with ExitStack() as stack:
        prefill = Prefill(stack, 1, BACKEND, PREFILL_BLOCKS, GRACE_S)
        decode = Rank("decode", "0", "1", BACKEND, str(DECODE_BLOCKS), "handshake", str(HANDSHAKE_S))
        stack.callback(decode.close)
        params = prefill.export("req-a", SRC_BLOCKS, slot=1, lease=1)
        yield prefill, decode, params


def test_a_load_from_a_prefill_rank_holding_its_gil_completes_byte_exact_during_the_hold(ranks, tmp_path):
    """Before the confirmation child: refused at the old bound (3 s), "no handshake from prefill engine ... in
    time", though the source lived all along; with the receiver's longer wait, finished only once the hold ended
    (8 s). Now: finished during the hold, and freed on the read-done."""
    prefill, decode, params = ranks
    prefill.ranks[0].hold_gil(HOLD_S)  # after the pin (its commands run in order), before the decode's first load
    began = time.monotonic()
    event = submit(decode, "req-a", params, DST_BLOCKS)
    took = time.monotonic() - began
    print(f"\nMEASURED load from a prefill rank holding its GIL {HOLD_S:g} s: {event} after {took:.2f} s "
          f"(old bound {OLD_BOUND_S:g} s)")
    assert event.get("finished") == "req-a", event
    assert event["recent"][0]["blocks"] == len(DST_BLOCKS), event
    assert took < OLD_BOUND_S, took

    freed = released(prefill.ranks[0], 20.0)
    assert freed and freed["released"] == "req-a" and freed["counters"]["released_read_done"] == 1, freed

    got = dump(decode, tmp_path / "decode0.pt")
    want = torch.zeros(3, DECODE_BLOCKS, len(heads_of(0, 1)), BLOCK, 32, dtype=torch.bfloat16)
    want[:, DST_BLOCKS] = values(PREFILL_BLOCKS, heads_of(0, 1))[:, SRC_BLOCKS]
    assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_prefill_rank_killed_during_its_gil_hold_fails_the_load_at_once(ranks):
    """SIGKILLed during its hold, before the decode's first load: the load fails within seconds, as the source's
    confirmation failing (its process and its confirmation child are gone), not at the long bound."""
    prefill, decode, params = ranks
    source = prefill.ranks[0]
    source.hold_gil(HOLD_S)
    os.kill(source.proc.pid, signal.SIGKILL)
    source.proc.wait(timeout=10)
    began = time.monotonic()
    event = submit(decode, "req-a", params, DST_BLOCKS)
    took = time.monotonic() - began
    reason = event["recent"][0].get("failed", "") if event.get("recent") else ""
    print(f"\nMEASURED load from a prefill rank SIGKILLed during its GIL hold: {event} after {took:.2f} s "
          f"(long bound {LONG_BOUND_S:g} s)")
    assert event.get("failed") == "req-a", event
    assert "could not confirm its meta" in reason, reason  # the source's death, not the receiver's bound
    assert took < 3.0, took
