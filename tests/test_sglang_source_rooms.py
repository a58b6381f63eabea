"""The SGLang prefill's room table (``kvxfer.integrations.sglang.source``) against what a decode
may send before, or instead of, SGLang making a sender: no SGLang needed, the table is kvxfer's.

The decode's metadata can come before the prefill's scheduler makes the room's sender (the two
race in every deployment); it is kept for that sender, but a peer must not be able to grow the
table with metadata for rooms that never get one.
"""

from __future__ import annotations

import numpy as np
import torch

from kvxfer.integrations.sglang.source import LeaseTable, SourceRooms


def _rooms(max_early: int = 3, early_s: float = 60.0):
    sent, concluded = [], []
    rooms = SourceRooms(LeaseTable(torch.zeros(8, dtype=torch.int64)), prefill_key="127.0.0.1:1", timeout_s=10.0,
                        send=lambda endpoint, frames: sent.append((endpoint, frames)),
                        conclude=lambda *item: concluded.append(item), max_early=max_early, early_s=early_s)
    return rooms, sent, concluded


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
    assert rooms.sizes() == {"rooms": 3, "leases_in_use": 0, "early": 3}  # the first 3 kept, the rest dropped
    assert rooms.open(100) is True and rooms.open(109) is False  # a dropped one's sender waits as SGLang would
    rooms.close(109)
    rooms.expire(now=10**9)  # past SGLang's bootstrap timeout: the two never opened are dropped
    assert rooms.sizes() == {"rooms": 1, "leases_in_use": 0, "early": 0}
    rooms.close(100)
    assert rooms.sizes() == {"rooms": 0, "leases_in_use": 0, "early": 0} and not concluded
