"""No stranger holds a vLLM decode's confirmations (issue 49, item 3).

Without a cluster key a decode rank confirms a producer's ucx metas with the source processes they name
before its first load from that producer (``HandshakeCache`` -> ``confirm_rank_sources`` ->
``kvxfer/backends/ucx/confirm.py``), and waits up to ``LIVE_SOURCE_WAIT_S`` (120 s) on a source that lives but
does not answer. Round 6: four tickets naming a same-host producer that stopped its confirmation child held the
decode's pool of 4 confirmation threads, and a genuine producer's first load waited behind them (25 s seen; up to
120 s). Now each confirmation runs on its own thread, one per producer address, and a producer whose confirmation
failed backs off without one.

Real processes (``tests/support/vllm_tp_ranks.py``), ucx, no cluster key: TP 1 prefill ranks (the worker's
``Sender``) and a TP 1 decode rank (the worker's ``Receiver`` and handshake cache, ``transfer_timeout_s`` 5 s,
its confirmation limit). The stalled producer is a real prefill rank whose confirmation child is SIGSTOPped
(the rank itself lives and runs, so each question waits the long bound), served at four addresses, as a
stranger of this host can serve any producer's document.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import ExitStack

import pytest

from kvxfer.integrations.vllm.handshake_cache import FAILED_KEPT_S, _Confirmations
from kvxfer.integrations.vllm.side_channel import HandshakeListener
from tests.support.vllm_tp_ranks import Prefill, Rank, submit

pytestmark = pytest.mark.timeout(300)

BACKEND = "ucx"
PREFILL_BLOCKS, DECODE_BLOCKS = 24, 40
GRACE_S = 120.0
STALLED = 4
GENUINE_BOUND_S = 2.0      # the bound for a genuine first load behind the stalls
SRC_BLOCKS, DST_BLOCKS = [3, 7, 8], [5, 6, 30]
REFUSED_S = 3.0            # a load refused from memory, on a loaded 2-core machine (well under the 5 s limit)


def resume_on_exit(stack: ExitStack, pid: int) -> None:
    def resume() -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    stack.callback(resume)


def test_four_stalled_producers_do_not_delay_a_genuine_first_load(keyless):
    """Before: the genuine load was still waiting after 30 s (the four stalls held the 4 threads, each up to
    5 + 120 s). Now it finishes in under 2 s while the four stalled confirmations still run."""
    stack = keyless
    stalled = Prefill(stack, 1, BACKEND, PREFILL_BLOCKS, GRACE_S)
    genuine = Prefill(stack, 1, BACKEND, PREFILL_BLOCKS, GRACE_S)
    decode = Rank("decode", "0", "1", BACKEND, str(DECODE_BLOCKS), "handshake", "5")
    stack.callback(decode.close)
    children = stalled.ranks[0].children("confirm_server")
    assert len(children) == 1, children
    os.kill(children[0], signal.SIGSTOP)
    resume_on_exit(stack, children[0])  # before the rank closes (callbacks run last first)

    ports = [stalled.listener.port]
    for _ in range(STALLED - 1):  # the same producer's document at three more addresses
        listener = HandshakeListener("127.0.0.1", 0, lambda: stalled.document, local_peers_only=True)
        stack.callback(listener.close)
        ports.append(listener.port)
    for i, port in enumerate(ports):
        params = stalled.export(f"stall-{i}", SRC_BLOCKS, slot=i + 1, lease=1, port=port)
        decode.send(f"load stall-{i} {json.dumps(params, separators=(',', ':'))} {','.join(map(str, DST_BLOCKS))}")
    time.sleep(1.0)  # fetched and confirming: each waits on the stopped child (5 s, then on while its source runs)

    params = genuine.export("genuine", SRC_BLOCKS, slot=1, lease=1)
    began = time.monotonic()
    decode.send(f"load genuine {json.dumps(params, separators=(',', ':'))} {','.join(map(str, DST_BLOCKS))}")
    try:
        event = decode.next(30.0)
    except AssertionError:
        pytest.fail(f"no answer for the genuine load within 30 s behind {STALLED} stalled producers")
    took = time.monotonic() - began
    print(f"\nMEASURED genuine first load behind {STALLED} stalled producers: {event.get('finished')} after "
          f"{took:.2f} s; handshakes {event.get('handshakes')}")
    assert event.get("finished") == "genuine" and "failed" not in event, event
    assert took < GENUINE_BOUND_S, took
    assert event["handshakes"]["confirming"] >= STALLED, event  # the stalls were under way all along


def test_a_producer_that_failed_to_confirm_backs_off_without_a_confirmation(keyless):
    """A stopped producer fails its confirmation at the limit (5 s). Its loads are then refused at once for
    ``FAILED_KEPT_S``; the next confirmation fails again (a short probe), and from then on it is refused for
    twice as long: before, every ``FAILED_KEPT_S`` cost another fetch and confirmation."""
    stack = keyless
    stopped = Prefill(stack, 1, BACKEND, PREFILL_BLOCKS, GRACE_S)
    decode = Rank("decode", "0", "1", BACKEND, str(DECODE_BLOCKS), "handshake", "5")
    stack.callback(decode.close)
    os.kill(stopped.ranks[0].proc.pid, signal.SIGSTOP)  # the rank and (stopped with it) its confirmation child
    resume_on_exit(stack, stopped.ranks[0].proc.pid)
    for pid in stopped.ranks[0].children("confirm_server"):
        os.kill(pid, signal.SIGSTOP)
        resume_on_exit(stack, pid)
    params = stopped.export("r", SRC_BLOCKS, slot=1, lease=1)  # pins are queued on its stdin; the ticket is signed

    def load(name: str) -> tuple[dict, float]:
        began = time.monotonic()
        event = submit(decode, name, params, DST_BLOCKS)
        assert event.get("failed") == name, event
        return event["handshakes"], time.monotonic() - began

    first, took = load("first")
    assert first["fetches"] == 1 and took > 4.0, (first, took)  # its confirmation waited out the 5 s limit
    second, took = load("second")
    assert second["fetches"] == 1 and took < REFUSED_S, (second, took)  # remembered
    time.sleep(FAILED_KEPT_S + 0.5)
    third, _ = load("third")
    assert third["fetches"] == 2, third  # asked again once the failure was FAILED_KEPT_S old: failed again
    time.sleep(FAILED_KEPT_S + 0.5)
    fourth, took = load("fourth")
    print(f"\nMEASURED stopped producer: handshakes after each load {first}, {second}, {third}, {fourth}; "
          f"the fourth refused in {took:.2f} s")
    assert fourth["fetches"] == 2 and took < REFUSED_S, (fourth, took)  # backing off: no fetch, no confirmation
    assert fourth.get("confirmations") == 2, fourth


def test_confirmations_beyond_the_bound_wait_without_a_thread_and_run_in_order():
    """The bound on confirmations running at once (``MAX_CONFIRMING``): with ``limit`` calls blocked, the next ones
    start no thread and run, in order, on the thread of the first call that ends; a closed lane drops them."""
    lane = _Confirmations(2)
    release = [threading.Event() for _ in range(2)]
    ran: list[int] = []

    def call(i: int):
        def run() -> None:
            ran.append(i)
            if i < 2:
                assert release[i].wait(10.0)
        return run

    def threads() -> int:
        return sum(t.name == "kvxfer-vllm-confirm" for t in threading.enumerate())

    for i in range(5):
        lane.submit(call(i))
    deadline = time.monotonic() + 5
    while len(ran) < 2:
        assert time.monotonic() < deadline, ran
        time.sleep(0.01)
    assert lane.running == 2 and threads() == 2 and ran == [0, 1]
    release[0].set()
    while len(ran) < 5 or lane.running > 1:
        assert time.monotonic() < deadline, (ran, lane.running)
        time.sleep(0.01)
    assert ran == [0, 1, 2, 3, 4]  # 2, 3 and 4 ran on the thread call 0 held, one after the other
    lane.close()
    with pytest.raises(RuntimeError, match="closed"):
        lane.submit(call(9))
    release[1].set()
    while lane.running:
        assert time.monotonic() < deadline, lane.running
        time.sleep(0.01)
