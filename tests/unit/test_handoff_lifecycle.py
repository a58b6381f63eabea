"""The library's one hand-off lifecycle (``kvxfer.handoff``): states, the guard read, the quarantine.

Real registrations on the ``local`` backend where the transport matters (the guard read carries the
read-done, the data read does not); small stand-in handles where only ``poll``/``storage_safe`` do.
"""

from __future__ import annotations

import pytest
import torch

from kvxfer.backends.local.backend import LocalBackend
from kvxfer.handoff.guard import (UNREAD, GuardedRead, LeaseSlotGuard, LeaseTarget, Phase, ScratchSlots,
                                  begin_data_read, lease_holds)
from kvxfer.handoff.poll import KVPoll
from kvxfer.handoff.quarantine import Quarantine
from tests.conftest import random_pool

SHAPE = (2, 2, 16, 4, 2, 8)
SLOTS = 4


class Stub:
    """A handle that completes after ``polls_to_done`` polls and says ``storage_safe`` as told;
    it counts how often ``storage_safe`` was read."""

    def __init__(self, polls_to_done: int = 0, safe: bool = True) -> None:
        self.polls_to_done, self.safe, self.safe_reads, self.polls = polls_to_done, safe, 0, 0

    def poll(self) -> bool:
        self.polls += 1
        return self.polls > self.polls_to_done

    @property
    def storage_safe(self) -> bool:
        self.safe_reads += 1
        return self.safe


def test_kvpoll_keeps_sglangs_values_and_its_final_states():
    assert [(s.name, int(s)) for s in KVPoll] == [("Failed", 0), ("Bootstrapping", 1), ("WaitingForInput", 2),
                                                  ("Transferring", 3), ("Success", 4)]
    assert {s for s in KVPoll if s.final} == {KVPoll.Success, KVPoll.Failed}


def test_quarantine_releases_only_what_no_handle_can_write_and_judges_each_once():
    q: Quarantine[str, int] = Quarantine()
    unsafe, safe, later = Stub(safe=False), Stub(), Stub(safe=False)
    q.hold("a", [safe, unsafe], "timed out", 1)
    q.hold("b", [safe], "aborted", 2)
    q.hold("c", [later], "aborted", 3)
    q.hold("d", [], "refused half-way", 4)  # nothing can write it: back at once
    released = q.reclaim()
    assert sorted((h.key, h.item, h.reason) for h in released) == [("b", 2, "aborted"), ("d", 4, "refused half-way")]
    assert unsafe.safe_reads == 1 and later.safe_reads == 1  # judged once per call
    assert "a" in q and "c" in q and "b" not in q and len(q) == 2
    later.safe = True
    assert [h.key for h in q.reclaim()] == ["c"]
    assert q.reclaim() == [] and "a" in q


def test_quarantine_is_bounded():
    q: Quarantine[int, None] = Quarantine(capacity=1)
    q.hold(0, [Stub(safe=False)], "x", None)
    with pytest.raises(RuntimeError, match="quarantine full"):
        q.hold(1, [Stub(safe=False)], "x", None)


def test_scratch_slots_come_back_only_once_their_reads_are_safe():
    slots = ScratchSlots(torch.zeros(2, dtype=torch.int64))
    a, b = slots.take(), slots.take()
    assert slots.take() is None and slots.tensor[a] == UNREAD
    pending = Stub(safe=False)
    slots.quarantine(a, [pending])
    slots.quarantine(b, [])  # unsafe with nothing to ask: never reused
    assert slots.reclaim() == [] and slots.free == 0 and slots.quarantined == 1 and slots.lost == 1
    pending.safe = True
    assert slots.reclaim() == [a] and slots.free == 1 and slots.quarantined == 0


class RecordingGuard:
    """Posts nothing; records what the data reads looked like when it was asked to post."""

    def __init__(self, data: list[Stub], verdict: str | None = None, free_after: int = 0) -> None:
        self.data, self.verdict, self.free_after, self.asked = data, verdict, free_after, []

    def post(self):
        self.asked.append([h.polls > h.polls_to_done for h in self.data])
        return None if len(self.asked) <= self.free_after else [Stub(polls_to_done=1)]

    def judge(self):
        return self.verdict


def test_the_guard_read_is_posted_only_after_every_data_read_completed():
    data = [Stub(polls_to_done=0), Stub(polls_to_done=2)]
    guard = RecordingGuard(data, free_after=1)  # first ask: no scratch free
    read = GuardedRead(data, guard)
    assert not read.poll() and read.phase is Phase.DATA and guard.asked == []
    assert not read.poll() and guard.asked == []
    assert not read.poll() and read.phase is Phase.WAITING and guard.asked == [[True, True]]
    assert not read.poll() and read.phase is Phase.GUARD  # posted now; its read is in flight
    assert read.poll() and read.phase is Phase.JUDGED and read.verdict is None
    assert len(read.handles) == 3


def test_a_guard_that_moved_is_the_verdict():
    read = GuardedRead([], RecordingGuard([], verdict="reused"))
    assert not read.poll()
    assert read.poll() and read.verdict == "reused"


@pytest.fixture
def lease_pair():
    """A producer's pool and lease table, a reader's pool and scratch, on the local backend."""
    src_pool, dst_pool = random_pool(SHAPE, torch.bfloat16, seed=3), torch.zeros(SHAPE, dtype=torch.bfloat16)
    src, dst = LocalBackend("prefill", src_pool, 16), LocalBackend("decode", dst_pool, 16)
    table, scratch = torch.zeros(SLOTS, dtype=torch.int64), torch.zeros(SLOTS, dtype=torch.int64)
    src_table = src.new_registered_buffer(memory_buffer=table, expected_num_blocks=SLOTS)
    dst_scratch = dst.new_registered_buffer(memory_buffer=scratch, expected_num_blocks=SLOTS)
    yield src, dst, table, src_table, dst_scratch, scratch, src_pool, dst_pool
    for x in (src_table, dst_scratch, src, dst):
        x.close()


def _lease_read(src, dst, src_table, dst_scratch, scratch, lease, *, pinned_at_offer):
    data = begin_data_read(dst, src.export_meta(), [2, 5], [0, 1], request_id="r1")
    slots = ScratchSlots(scratch)
    guard = LeaseSlotGuard(slots, dst_scratch, [LeaseTarget(src_table.export_meta(), 1, "r1")], lease,
                           pinned_at_offer=pinned_at_offer, explain=lambda _, seen: f"slot shows {seen}")
    read = GuardedRead([data], guard)
    for _ in range(1000):
        if read.poll():
            return read, slots
    raise AssertionError("the guarded read never completed")


def test_a_held_lease_passes_and_only_the_guard_read_says_done(lease_pair):
    src, dst, table, src_table, dst_scratch, scratch, src_pool, dst_pool = lease_pair
    table[1] = 7
    read, slots = _lease_read(src, dst, src_table, dst_scratch, scratch, 7, pinned_at_offer=True)
    assert read.verdict is None and slots.free == SLOTS  # the scratch slot went back
    assert torch.equal(dst_pool[:, :, [0, 1]].view(torch.uint8), src_pool[:, :, [2, 5]].view(torch.uint8))
    assert src.drain_read_done() == []  # the data read carries no read-done...
    assert src_table.drain_read_done() == ["r1"]  # ...the guard read does


def test_a_revoked_lease_fails_the_read(lease_pair):
    src, dst, table, src_table, dst_scratch, scratch, _, _ = lease_pair
    table[1] = -7  # the producer gave the blocks back before the read
    read, _ = _lease_read(src, dst, src_table, dst_scratch, scratch, 7, pinned_at_offer=False)
    assert read.verdict == "slot shows -7"


def test_an_older_lease_holds_only_where_the_pin_may_come_after_the_offer(lease_pair):
    src, dst, table, src_table, dst_scratch, scratch, _, _ = lease_pair
    table[1] = 3  # an older export of the slot: the producer has not pinned ours yet
    lenient, _ = _lease_read(src, dst, src_table, dst_scratch, scratch, 7, pinned_at_offer=False)
    strict, _ = _lease_read(src, dst, src_table, dst_scratch, scratch, 7, pinned_at_offer=True)
    assert lenient.verdict is None and strict.verdict == "slot shows 3"
    assert not lease_holds(UNREAD, 7) and not lease_holds(8, 7) and not lease_holds(-7, 7)
