"""The SGLang prefill's room table (``kvxfer.integrations.sglang.source``) against what a decode
may send before, or instead of, SGLang making a sender: no SGLang needed, the table is kvxfer's.

The decode's metadata can come before the prefill's scheduler makes the room's sender (the two
race in every deployment); it is kept for that sender, but a peer must not be able to grow the
table with metadata for rooms that never get one.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kvxfer.integrations.sglang import wire
from kvxfer.handoff.guard import LeaseTable
from kvxfer.integrations.sglang.source import SourceRooms, request_id
from kvxfer.integrations.sglang.tp import MAX_READERS

EMPTY = {"rooms": 0, "leases_in_use": 0, "busy_decodes": 0, "early": 0, "early_peers": 0, "tells": 0}


def _rooms(max_early: int = 3, early_s: float = 60.0, accept=lambda endpoint, frames: True, busy=None):
    sent, concluded = [], []

    def send(endpoint, frames):
        if not accept(endpoint, frames):
            return False
        sent.append((endpoint, frames))
        return True

    rooms = SourceRooms(LeaseTable(torch.zeros(8, dtype=torch.int64)), prefill_key="127.0.0.1:1", timeout_s=10.0,
                        send=send, conclude=lambda *item: concluded.append(item), max_early=max_early, early_s=early_s,
                        **({} if busy is None else {"busy": busy}))
    return rooms, sent, concluded


def _bodies(sent, tag=wire.CHUNK):
    return [wire.decode(frames)[1] for _, frames in sent if frames[0] == tag]


def test_metadata_before_the_sender_is_kept_and_the_sender_learns_it_came():
    rooms, sent, _ = _rooms()
    assert rooms.metadata(5, {"room": 5, "endpoint": "127.0.0.1:2"}) is False  # no sender yet: not bootstrapped
    assert rooms.sizes()["early"] == 1
    assert rooms.open(5) is True  # the sender finds the decode's metadata (it sets WaitingForInput)
    assert rooms.sizes()["early"] == 0
    rooms.add_chunk(5, np.array([3, 4]), 0, 2, True, None, None)
    assert [endpoint for endpoint, _ in sent] == ["127.0.0.1:2"]  # offered to that decode
    assert rooms.open(6) is False and rooms.metadata(6, {"room": 6, "endpoint": "127.0.0.1:2"}) is True


def test_metadata_for_rooms_without_a_sender_is_bounded_in_number_and_age():
    rooms, _, concluded = _rooms(max_early=3, early_s=60.0)
    for room in range(10):
        rooms.metadata(100 + room, {"room": 100 + room, "endpoint": "127.0.0.1:9"})
    # one peer holds them all: each new one evicts that peer's oldest (counted), so the newest 3 are kept
    assert rooms.sizes() == {**EMPTY, "rooms": 3, "early": 3, "early_peers": 1}
    assert rooms.counters["early_evicted"] == 7
    assert rooms.open(109) is True and rooms.open(100) is False  # an evicted one's sender waits as SGLang would
    rooms.close(100)
    rooms.expire(now=10**9)  # past SGLang's bootstrap timeout: the two never opened are dropped
    assert rooms.sizes() == {**EMPTY, "rooms": 1}
    rooms.close(109)
    assert rooms.sizes() == EMPTY and not concluded


def test_one_peer_cannot_crowd_out_anothers_early_metadata():
    rooms, _, _ = _rooms(max_early=4)
    for room in range(4):
        rooms.metadata(room, {"room": room, "endpoint": "127.0.0.1:9"})  # a stranger fills the table
    rooms.metadata(50, {"room": 50, "endpoint": "127.0.0.1:2"})  # a genuine decode's room: the stranger's oldest goes
    for room in range(4, 20):
        rooms.metadata(room, {"room": room, "endpoint": "127.0.0.1:9"})  # the stranger's own oldest go
    assert rooms.open(50) is True and rooms.counters["early_evicted"] == 17
    assert rooms.sizes()["early"] == 3 and rooms.sizes()["early_peers"] == 1


def test_chunks_are_numbered_and_sent_in_order_when_the_metadata_comes_while_the_scheduler_sends():
    """Chunks sent before the decode's metadata are replayed under the lock when it comes; a chunk the
    scheduler sends meanwhile must not take a lower number than those, nor go out before them."""
    for _ in range(200):
        rooms, sent, _ = _rooms()
        rooms.open(5)
        rooms.add_chunk(5, np.array([1]), 0, 1, False, None, None)
        rooms.add_chunk(5, np.array([2]), 1, 2, False, None, None)
        go = threading.Barrier(2)

        def scheduler():
            go.wait()
            rooms.add_chunk(5, np.array([3]), 2, 3, True, None, None)

        thread = threading.Thread(target=scheduler)
        thread.start()
        go.wait()
        rooms.metadata(5, {"room": 5, "endpoint": "127.0.0.1:2"})
        thread.join()
        bodies = _bodies(sent)
        assert [b["chunk"] for b in bodies] == [0, 1, 2], bodies  # sent in number order
        assert [b["src"] for b in bodies] == [[1], [2], [3]] and bodies[-1]["last"], bodies  # numbered as sent


def test_a_chunk_zmq_will_not_take_fails_the_room_at_once_and_the_decode_is_told_when_it_can_be():
    refuse = {"chunk": True, "revoked": True}
    rooms, sent, concluded = _rooms(accept=lambda endpoint, frames: not refuse[
        "chunk" if frames[0] == wire.CHUNK else "revoked"])
    rooms.open(5)
    rooms.metadata(5, {"room": 5, "endpoint": "127.0.0.1:2"})
    rooms.add_chunk(5, np.array([1, 2]), 0, 2, False, None, None)
    refuse["chunk"] = False
    rooms.add_chunk(5, np.array([3]), 2, 3, True, None, None)  # the room already failed: not sent
    assert rooms.counters["chunks_unsent"] == 1 and not _bodies(sent)
    assert rooms.sizes()["leases_in_use"] == 0  # revoked at once
    rooms.flush()
    assert len(concluded) == 1 and concluded[0][:2] == (5, False) and "chunk 0" in concluded[0][2], concluded
    assert rooms.sizes()["tells"] == 1  # zmq refused the REVOKED too: kept, tried again
    refuse["revoked"] = False
    time.sleep(0.05)  # past the retry interval
    rooms.flush()
    told = _bodies(sent, wire.REVOKED)
    assert len(told) == 1 and told[0]["room"] == 5 and told[0]["prefill"] == "127.0.0.1:1" and told[0]["lease"]
    assert "chunk 0" in told[0]["reason"] and rooms.sizes()["tells"] == 0
    rooms.close(5)
    assert rooms.sizes() == EMPTY


def test_a_failed_report_is_taken_only_from_the_rooms_decode_with_the_rooms_lease():
    rooms, sent, concluded = _rooms()
    rooms.open(5)
    rooms.metadata(5, {"room": 5, "endpoint": "127.0.0.1:2"})
    rooms.decode_failed(5, 123, "127.0.0.1:2", "a lease the room does not have yet")
    rooms.add_chunk(5, np.array([1]), 0, 1, True, None, None)
    lease = _bodies(sent)[0]["lease"]
    rooms.decode_failed(5, lease, "127.0.0.1:3", "another decode (a chunk replayed to it)")
    rooms.decode_failed(5, None, "127.0.0.1:2", "no lease, but the room has one")
    rooms.decode_failed(5, lease + 1, "127.0.0.1:2", "another lease")
    rooms.flush()
    assert not concluded and rooms.counters["foreign_reports"] == 4
    rooms.decode_failed(5, lease, "127.0.0.1:2", "the room's own decode")
    rooms.flush()
    assert concluded == [(5, False, "decode: the room's own decode")]
    rooms.close(5)
    rooms.open(6)
    rooms.metadata(6, {"room": 6, "endpoint": "127.0.0.1:2"})
    rooms.decode_failed(6, None, "127.0.0.1:2", "before any chunk")  # no lease yet: a lease-less report holds
    rooms.flush()
    assert concluded[-1] == (6, False, "decode: before any chunk")


def test_a_failed_that_answers_a_chunk_never_ends_the_room():
    """Issue 49: a room's own chunk replayed to its decode after the decode's Success (the prefill has not drained
    the read-done yet) is answered with a FAILED from the room's decode carrying the room's lease. It names the
    chunk it answers, and the prefill does not take it as the room's failure: the read-done then concludes it."""
    rooms, sent, concluded = _rooms()
    rooms.open(5)
    rooms.metadata(5, {"room": 5, "endpoint": "127.0.0.1:2"})
    rooms.add_chunk(5, np.array([1]), 0, 1, True, None, None)
    lease = _bodies(sent)[0]["lease"]
    rooms.decode_failed(5, lease, "127.0.0.1:2", "the decode has no live request for this room", chunk=0)
    rooms.flush()
    assert not concluded and rooms.counters["chunk_answers"] == 1
    rooms.read_done(request_id(5, lease, 0))
    rooms.flush()
    assert concluded == [(5, True, None)]
    rooms.close(5)
    assert rooms.sizes() == EMPTY


def test_an_endpoint_is_busy_from_its_first_lease_to_its_last_and_told_before_its_first_chunk():
    events, rooms = [], None

    def busy(endpoint, flag):
        events.append((endpoint, flag, len(_bodies(sent))))  # chunks sent when told

    rooms, sent, concluded = _rooms(busy=busy)
    for room in (5, 6):
        rooms.open(room)
        rooms.metadata(room, {"room": room, "endpoint": "127.0.0.1:2"})
        rooms.add_chunk(room, np.array([room]), 0, 1, True, None, None)
    assert events == [("127.0.0.1:2", True, 0)], events  # once, before the first chunk went
    leases = {b["room"]: b["lease"] for b in _bodies(sent)}
    rooms.read_done(request_id(5, leases[5], 0))
    assert len(events) == 1  # room 6 still holds it
    rooms.abort(6, "aborted")
    assert events[-1] == ("127.0.0.1:2", False, 2), events
    rooms.flush()
    for room in (5, 6):
        rooms.close(room)
    assert rooms.sizes() == EMPTY


def test_leases_are_random_and_a_reused_slot_never_shows_its_last_lease():
    table = LeaseTable(torch.zeros(4, dtype=torch.int64))
    seen, slots = set(), []
    for _ in range(400):
        slot, lease = table.take()
        assert 0 < lease < 1 << 63 and lease not in seen and int(table.table[slot]) == lease
        seen.add(lease)
        slots.append(slot)
        table.revoke(slot, lease)
        assert int(table.table[slot]) == -lease
    assert min(seen) > 1 << 40 and len(set(slots)) == 4  # not 1, 2, 3, ...; every slot used, not only slot 0


# --- several decode ranks reading one room (a decode of larger attention TP: SGLang's required_dst_info_num)

def _chunks(sent, endpoint=None, tag=wire.CHUNK):
    return [wire.decode(frames)[1] for to, frames in sent if frames[0] == tag and endpoint in (None, to)]


A, B, C = "127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4"


def test_a_room_read_by_two_decode_ranks_succeeds_only_when_both_read_every_chunk():
    rooms, sent, concluded = _rooms(max_early=8)
    assert rooms.open(5) is False
    assert rooms.metadata(5, {"room": 5, "endpoint": A, "readers": 2}) is False  # one of two: not bootstrapped
    rooms.add_chunk(5, np.array([1, 2]), 0, 2, False, None, None)  # sent to A now, to B when its metadata comes
    assert rooms.metadata(5, {"room": 5, "endpoint": B, "readers": 2}) is True
    assert rooms.metadata(5, {"room": 5, "endpoint": C, "readers": 2}) is False  # a third: ignored, counted
    assert rooms.counters["foreign_metas"] == 1
    rooms.add_chunk(5, np.array([3]), 2, 3, True, 4, None)
    a, b = _chunks(sent, A), _chunks(sent, B)
    assert [c["chunk"] for c in a] == [c["chunk"] for c in b] == [0, 1] and [c["src"] for c in b] == [[1, 2], [3]]
    assert a[0]["lease"] != b[0]["lease"] and a[0]["slot"] != b[0]["slot"]  # each reader its own lease
    assert not _chunks(sent, C) and rooms.sizes()["leases_in_use"] == 2
    for c in a + b[:1]:
        rooms.read_done(request_id(5, c["lease"], c["chunk"]))
    rooms.flush()
    assert not concluded  # B has not read its last chunk
    rooms.read_done(request_id(5, b[1]["lease"], 1))
    rooms.flush()
    assert concluded == [(5, True, None)] and rooms.sizes()["leases_in_use"] == 0
    rooms.close(5)
    assert not rooms.sizes()["rooms"]


def test_one_reader_failing_fails_the_room_and_tells_the_other():
    rooms, sent, concluded = _rooms(max_early=8)
    rooms.open(6)
    for endpoint in (A, B):
        rooms.metadata(6, {"room": 6, "endpoint": endpoint, "readers": 2})
    rooms.add_chunk(6, np.array([1]), 0, 1, True, None, None)
    b = _chunks(sent, B)[0]
    rooms.decode_failed(6, _chunks(sent, A)[0]["lease"], B, "B names A's lease")  # foreign: each has its own
    assert rooms.counters["foreign_reports"] == 1
    rooms.decode_failed(6, b["lease"], B, "its read failed")
    rooms.flush()
    assert concluded == [(6, False, "decode: its read failed")] and rooms.sizes()["leases_in_use"] == 0
    told = _chunks(sent, tag=wire.REVOKED)
    assert [(t["room"], t["lease"]) for t in told] == [(6, _chunks(sent, A)[0]["lease"])]  # A told, B not (it said)


def test_dummy_readers_read_nothing_and_metadata_bounds():
    rooms, sent, concluded = _rooms(max_early=8)
    rooms.open(7)
    assert rooms.metadata(7, {"room": 7, "endpoint": A, "readers": 1, "dummy": True}) is True
    rooms.add_chunk(7, np.array([1]), 0, 1, False, None, None)
    rooms.add_chunk(7, np.array([2]), 1, 2, True, 3, None)
    rooms.flush()
    assert not _chunks(sent) and concluded == [(7, True, None)]  # nothing offered, nothing held
    with pytest.raises(wire.WireError):  # more readers than any TP ratio: refused by the schema
        wire.decode(wire.encode(wire.META, {"room": 1, "endpoint": A, "readers": MAX_READERS + 1}))
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode(wire.META, {"room": 1, "endpoint": A, "readers": 0}))
