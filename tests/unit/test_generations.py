"""Torn-read detection with real registrations: reuse is caught, clean reads never flagged."""

import numpy as np
import pytest
import torch

from kvxfer.backends.local.backend import LocalBackend
from kvxfer.errors import BlockIdError, TornReadError
from kvxfer.handoff.generations import BlockGenerations, GenerationChecker
from tests.conftest import random_pool

SHAPE = (2, 2, 32, 4, 2, 8)


@pytest.fixture
def pair():
    src_pool, dst_pool = random_pool(SHAPE, torch.bfloat16, seed=5), torch.zeros(SHAPE, dtype=torch.bfloat16)
    src, dst = LocalBackend("prefill", src_pool, 32), LocalBackend("decode", dst_pool, 32)
    gens, checker = BlockGenerations(src), GenerationChecker(dst)
    yield src, dst, gens, checker, src_pool, dst_pool
    for x in (gens, checker, src, dst):
        x.close()


def test_clean_read_passes_and_read_done_follows_the_check(pair):
    src, dst, gens, checker, src_pool, dst_pool = pair
    ids_src, ids_dst = [3, 9, 4], [0, 1, 2]
    expected = gens.snapshot(ids_src)
    handle = checker.begin_pull_verified(src.export_meta(), gens.export_meta(), ids_src, ids_dst, expected, request_id=11)
    assert src.drain_read_done() == []  # the data read itself carries no read-done
    handle.wait(5)
    assert torch.equal(dst_pool[:, :, ids_dst].view(torch.uint8), src_pool[:, :, ids_src].view(torch.uint8))
    assert gens.drain_read_done() == [11]


def test_reused_blocks_are_detected(pair):
    src, dst, gens, checker, src_pool, _ = pair
    ids_src = [5, 6, 7]
    expected = gens.snapshot(ids_src)
    gens.bump([6])  # the source freed block 6 and gave it to another request...
    src_pool[:, :, 6] = 0  # ...which overwrote it
    handle = checker.begin_pull_verified(src.export_meta(), gens.export_meta(), ids_src, [0, 1, 2], expected, request_id=12)
    with pytest.raises(TornReadError, match=r"source blocks \[6\]"):
        handle.wait(5)
    assert handle.storage_safe
    assert gens.drain_read_done() == [12]  # the source may release: nothing is still reading


def test_detected_equals_injected_over_many_handoffs(pair):
    src, dst, gens, checker, src_pool, dst_pool = pair
    rng = np.random.default_rng(7)
    injected = detected = false_alarms = 0
    for request in range(60):
        ids_src = rng.choice(32, 4, replace=False)
        ids_dst = rng.choice(32, 4, replace=False)
        expected = gens.snapshot(ids_src)
        reuse = rng.random() < 0.3
        if reuse:
            gens.bump(ids_src[rng.integers(4)])
            injected += 1
        handle = checker.begin_pull_verified(src.export_meta(), gens.export_meta(), ids_src, ids_dst, expected, request_id=request)
        try:
            handle.wait(5)
        except TornReadError:
            detected += 1
            false_alarms += int(not reuse)
        else:
            assert torch.equal(dst_pool[:, :, ids_dst].view(torch.uint8), src_pool[:, :, ids_src].view(torch.uint8))
        gens.bump(ids_src)  # the source frees the blocks after read-done
        assert gens.drain_read_done() == [request]
    assert detected == injected and false_alarms == 0 and injected > 5


def test_expected_list_must_match(pair):
    src, _, gens, checker, *_ = pair
    with pytest.raises(BlockIdError, match="2 expected generations for 3 blocks"):
        checker.begin_pull_verified(src.export_meta(), gens.export_meta(), [1, 2, 3], [1, 2, 3], [0, 0], request_id=1)
