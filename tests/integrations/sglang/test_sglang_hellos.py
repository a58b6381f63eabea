"""The prefill's HELLO pacing (``kvxfer.integrations.sglang.hellos``) on a clock the test moves: per decode
endpoint one HELLO per pace, the REGs between coalesced into one answer when the window ends; over all endpoints
a budget; a bounded table. No SGLang (``test_sglang_wire_attacks.py`` runs it between real ranks)."""

from __future__ import annotations

import pytest

from kvxfer.integrations.sglang.hellos import HelloPacer, pace_from_env


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pacer(**kw):
    sent, clock = [], Clock()
    return HelloPacer(sent.append, clock=clock, **kw), sent, clock


def reg(endpoint: str, n: int = 0) -> dict:
    return {"endpoint": endpoint, "layout": {"n": n}}


def test_one_hello_per_endpoint_per_pace_the_latest_reg_answered_when_the_window_ends():
    p, sent, clock = pacer(pace_s=1.0)
    assert p.reg(reg("d:1", 0)) is True
    for n in range(1, 1500):  # a replayed burst
        assert p.reg(reg("d:1", n)) is False
    p.flush()
    assert [b["layout"]["n"] for b in sent] == [0]
    clock.now += 1.0
    p.flush()
    assert [b["layout"]["n"] for b in sent] == [0, 1499]  # once, the latest
    assert p.counters == {"hellos": 2, "coalesced": 1498, "dropped": 0}
    clock.now += 1.0
    p.flush()  # idle for a whole window: forgotten, and the next REG is answered at once
    assert p.sizes() == {"hello_endpoints": 0, "hello_waiting": 0}
    assert p.reg(reg("d:1", 7)) is True and len(sent) == 3


def test_endpoints_are_paced_apart_and_all_together_within_a_budget():
    p, sent, clock = pacer(pace_s=1.0, burst=4)
    answered = [p.reg(reg(f"d:{i}")) for i in range(10)]  # a stranger naming a new endpoint each time
    assert answered == [True] * 4 + [False] * 6 and len(sent) == 4
    assert p.sizes() == {"hello_endpoints": 10, "hello_waiting": 6}
    clock.now += 0.5  # half a window refills half the budget
    p.flush()
    assert len(sent) == 6
    clock.now += 10
    p.flush()
    p.flush()
    assert len(sent) == 10 and p.sizes()["hello_waiting"] == 0
    assert sorted(b["endpoint"] for b in sent) == sorted(f"d:{i}" for i in range(10))


def test_the_table_is_bounded_and_what_it_drops_is_counted():
    p, sent, clock = pacer(pace_s=1.0, burst=1, max_endpoints=8)
    for i in range(100):
        p.reg(reg(f"d:{i}"))
    assert p.sizes()["hello_endpoints"] <= 8
    assert p.counters["hellos"] + p.counters["dropped"] + p.sizes()["hello_waiting"] == 100, p.counters
    clock.now += 100
    for _ in range(20):
        p.flush()
        clock.now += 1
    assert p.sizes() == {"hello_endpoints": 0, "hello_waiting": 0}


def test_pace_zero_answers_every_reg_and_the_setting_is_checked():
    p, sent, _ = pacer(pace_s=0.0)
    for n in range(5):
        assert p.reg(reg("d:1", n)) is True
    assert len(sent) == 5
    assert pace_from_env({}) == 1.0 and pace_from_env({"KVXFER_SGLANG_HELLO_PACE_S": "0.25"}) == 0.25
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(ValueError):
            pace_from_env({"KVXFER_SGLANG_HELLO_PACE_S": bad})
