"""A vLLM producer's ucx confirmation child killed while the producer lives is started again (issue 49, item 3).

Real processes (``tests/support/vllm_tp_ranks.py``), ucx, no cluster key: a TP 1 prefill rank and a TP 1 decode rank
that has not confirmed the prefill's metas yet. The prefill's confirmation child (``confirm_server.py``) is
SIGKILLed; a new one must appear on the same socket and the decode's first load must finish.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.support.vllm_tp_ranks import Prefill, Rank, submit

pytestmark = pytest.mark.timeout(300)

BACKEND = "ucx"
PREFILL_BLOCKS, DECODE_BLOCKS = 24, 40
GRACE_S = 120.0
SRC_BLOCKS, DST_BLOCKS = [3, 7, 8], [5, 6, 30]


def test_a_killed_confirmation_child_is_started_again_and_a_new_decode_loads(keyless):
    """Issue 49: a producer's ucx confirmation child SIGKILLed while the producer lives was never started again,
    so every load from a decode that had not confirmed it before failed (the socket its metas name was gone)
    until the producer restarted. Now the producer starts another on the same socket, told every export, and a
    new decode's load finishes."""
    stack = keyless
    prefill = Prefill(stack, 1, BACKEND, PREFILL_BLOCKS, GRACE_S)
    decode = Rank("decode", "0", "1", BACKEND, str(DECODE_BLOCKS), "handshake", "5")
    stack.callback(decode.close)
    (child,) = prefill.ranks[0].children("confirm_server")
    os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not (now := [pid for pid in prefill.ranks[0].children("confirm_server") if pid != child]):
        assert time.monotonic() < deadline, "no confirmation child started again within 10 s"
        time.sleep(0.05)
    params = prefill.export("after-kill", SRC_BLOCKS, slot=1, lease=1)
    began = time.monotonic()
    event = submit(decode, "after-kill", params, DST_BLOCKS)
    took = time.monotonic() - began
    print(f"\nMEASURED load after the confirmation child's SIGKILL (new child {now}): {event.get('finished') or event} "
          f"in {took:.2f} s")
    assert event.get("finished") == "after-kill" and "failed" not in event, event
