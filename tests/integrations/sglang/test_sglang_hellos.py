"""The prefill's HELLO pacing (``kvxfer.integrations.sglang.hellos``) on a clock the test moves: a REG is kept and
answered once its endpoint has a room in flight (``busy``), at most one HELLO per pace per endpoint, the REGs
between coalesced into one answer when the window ends; REGs from endpoints with no room cost nothing but a
bounded entry. No SGLang (``test_sglang_wire_attacks.py`` runs it between real ranks)."""

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


def test_a_reg_is_answered_when_its_endpoint_has_a_room_and_replays_once_per_pace():
    p, sent, clock = pacer(pace_s=1.0)
    assert p.reg(reg("d:1", 0), size=100) is False and sent == []  # no room here yet: kept, nothing sent
    p.busy("d:1", True)  # its first room's first chunk is about to go: the HELLO goes first
    assert [b["layout"]["n"] for b in sent] == [0]
    for n in range(1, 1500):  # a replayed burst while the room is in flight
        assert p.reg(reg("d:1", n), size=100) is False
    p.flush()
    assert len(sent) == 1
    clock.now += 1.0
    p.flush()
    assert [b["layout"]["n"] for b in sent] == [0, 1499]  # once, the latest
    assert p.counters == {"hellos": 2, "coalesced": 1498, "dropped": 0}
    assert p.reg(reg("d:1", 7)) is False  # inside the new window: due when it ends
    clock.now += 1.0
    assert p.reg(reg("d:1", 8)) is True and len(sent) == 3  # window over: at once, the latest
    p.busy("d:1", False)
    assert p.sizes() == {"hello_endpoints": 0, "hello_bytes": 0, "hello_busy": 0, "hello_waiting": 0}
    p.reg(reg("d:1", 9))  # no room in flight: kept, not answered, however long it waits
    clock.now += 100
    p.flush()
    assert len(sent) == 3 and p.sizes()["hello_endpoints"] == 1


def test_a_flood_of_new_endpoints_costs_no_hello_and_cannot_delay_a_genuine_one():
    """Issue 49: a REG waiting for the overall budget was queued at the front, so every newer stranger's REG was
    served first (0 of 3 genuine REGs answered during a flood). Now strangers get nothing; the genuine decode,
    whose REG came in the middle of the flood, is answered the moment its room starts."""
    p, sent, clock = pacer(pace_s=1.0, max_endpoints=4096)
    for i in range(2000):
        p.reg(reg(f"s:{i}"), size=50)
    p.reg(reg("genuine:1", 42), size=50)
    for i in range(2000, 4000):
        p.reg(reg(f"s:{i}"), size=50)
        clock.now += 0.002  # 500 REG/s
    p.flush()
    assert sent == []
    p.busy("genuine:1", True)
    assert [b["endpoint"] for b in sent] == ["genuine:1"] and sent[0]["layout"]["n"] == 42
    assert p.counters["hellos"] == 1


def test_the_table_is_bounded_in_count_and_bytes_and_what_it_drops_is_counted():
    p, sent, clock = pacer(pace_s=1.0, max_endpoints=8, max_bytes=1000)
    for i in range(100):
        p.reg(reg(f"d:{i}"), size=10)
    assert p.sizes()["hello_endpoints"] == 8 and p.counters["dropped"] == 92
    for i in range(100, 110):
        p.reg(reg(f"d:{i}"), size=400)
    assert p.sizes()["hello_bytes"] <= 1000, p.sizes()
    assert p.reg(reg("big"), size=10 << 20) is False and "big" not in str(p.sizes())
    p.busy("d:0", True)  # dropped long ago: nothing to answer (the decode registers again: ``puller``)
    assert sent == []
    p.busy("d:109", True)
    assert [b["endpoint"] for b in sent] == ["d:109"]


def test_pace_zero_answers_every_reg_and_the_setting_is_checked():
    p, sent, _ = pacer(pace_s=0.0)
    for n in range(5):
        assert p.reg(reg("d:1", n)) is True
    assert len(sent) == 5
    assert pace_from_env({}) == 1.0 and pace_from_env({"KVXFER_SGLANG_HELLO_PACE_S": "0.25"}) == 0.25
    for bad in ("-1", "nan", "inf", "1e999", "soon"):
        with pytest.raises(ValueError):
            pace_from_env({"KVXFER_SGLANG_HELLO_PACE_S": bad})
