"""Different TP, moved for real: the connector's worker halves (``Sender``, ``Receiver``) in one
process per TP rank, two prefill ranks feeding one decode rank and one feeding two.

Each decode rank must hold exactly its heads of the prefill's blocks, byte for byte what vLLM's
own LBHNC layout holds on that rank, and nothing else; each prefill rank frees a request only
once every decode rank that reads it is done, and a reader that never comes costs only
``pin_grace_s``. The same on ``LBNHC`` (NHD), which NixlConnector refuses across TP sizes: there a rank's
heads are read as one run per token, over the views vLLM itself makes.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest
import torch

from tests.support.vllm_tp_ranks import BLOCK, Prefill, Rank, heads_of, load, released, values, vllm_views

BACKEND = "nixl"
PREFILL_BLOCKS, DECODE_BLOCKS = 24, 40  # pools sized differently, as vLLM's profiling does
GRACE_S = 3.0


def expected(rank: int, tp: int, src_blocks: list[int], dst_blocks: list[int]) -> torch.Tensor:
    """What vLLM's LBHNC pool holds on decode rank ``rank`` of ``tp`` once the blocks arrived."""
    out = torch.zeros(3, DECODE_BLOCKS, len(heads_of(rank, tp)), BLOCK, 32, dtype=torch.bfloat16)
    out[:, dst_blocks] = values(PREFILL_BLOCKS, heads_of(rank, tp))[:, src_blocks]
    return out


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2)])
def test_each_decode_rank_gets_its_heads_and_the_prefill_waits_for_every_reader(src_tp, dst_tp, tmp_path):
    src_blocks, dst_blocks = [3, 7, 8, 20, 0], [5, 6, 30, 1, 39]
    with ExitStack() as stack:
        prefill = Prefill(stack, src_tp, BACKEND, PREFILL_BLOCKS, GRACE_S)
        decodes = [Rank("decode", str(r), str(dst_tp), BACKEND, str(DECODE_BLOCKS)) for r in range(dst_tp)]
        for rank in decodes:
            stack.callback(rank.close)
        params = prefill.export("req-a", src_blocks, slot=1, lease=1)

        # the first decode rank reads; a prefill rank with another reader still holds the request
        event = load(decodes[0], "req-a", params, dst_blocks)
        assert event["recent"][0]["blocks"] == len(dst_blocks)
        if dst_tp > src_tp:
            assert released(prefill.ranks[0], 1.5) is None, "freed before its second reader was done"
            load(decodes[1], "req-a", params, dst_blocks)
        for rank in prefill.ranks:  # every reader done: each prefill rank frees it, on a read-done
            event = released(rank, 10.0)
            assert event and event["released"] == "req-a" and event["counters"]["released_read_done"] == 1, event

        for r, decode in enumerate(decodes):  # byte for byte what vLLM's layout holds on that rank
            path = tmp_path / f"decode{r}.pt"
            decode.send(f"dump {path}")
            assert decode.next(30.0) == {"dumped": str(path)}
            got = torch.load(path)
            want = expected(r, dst_tp, src_blocks, dst_blocks)
            assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16)), r

        if dst_tp > src_tp:  # a reader that never comes costs pin_grace_s, no more
            params = prefill.export("req-b", src_blocks[:2], slot=2, lease=2)
            pinned = time.monotonic()
            load(decodes[0], "req-b", params, dst_blocks[:2])
            event = released(prefill.ranks[0], GRACE_S + 10.0)
            assert event and event["released"] == "req-b" and event["counters"]["released_grace"] == 1, event
            assert GRACE_S - 0.5 <= event["at"] - pinned <= GRACE_S + 5.0


# --- NHD (LBNHC) across TP: a head range read as one run per token, over vLLM's own views ----------------

@pytest.fixture(scope="module")
def views(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vllm_views(tmp_path_factory.mktemp("views"), [
        {"layout": lay, "heads": h, "block_size": BLOCK, "blocks": n}
        for lay in ("LBHNC", "LBNHC") for h in (2, 4) for n in (PREFILL_BLOCKS, DECODE_BLOCKS)])


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2)])
def test_nhd_across_tp_is_byte_exact_and_costs_one_descriptor_per_token(views, src_tp, dst_tp, tmp_path):
    """Both layouts in one run, each over the views vLLM 0.32 makes (``create_kv_cache_views``): on LBHNC a
    rank's heads of a block are one run per layer, on LBNHC one run per token per layer (a token's heads are
    contiguous, a head's tokens are not); the bytes are the same and land byte for byte where vLLM's layout
    puts them on each decode rank."""
    src_blocks, dst_blocks = [3, 7, 8, 20, 0], [5, 6, 30, 1, 39]
    sources = max(1, src_tp // dst_tp)  # prefill ranks one decode rank reads
    descriptors = {}
    for layout in ("LBHNC", "LBNHC"):
        extra = ("layout", layout, "views", views)
        with ExitStack() as stack:
            prefill = Prefill(stack, src_tp, BACKEND, PREFILL_BLOCKS, GRACE_S, *extra)
            decodes = [Rank("decode", str(r), str(dst_tp), BACKEND, str(DECODE_BLOCKS), *extra) for r in range(dst_tp)]
            for rank in decodes:
                stack.callback(rank.close)
            params = prefill.export("req-a", src_blocks, slot=1, lease=1)
            for r, decode in enumerate(decodes):
                record = load(decode, "req-a", params, dst_blocks)["recent"][0]
                assert record["bytes"] == len(dst_blocks) * 3 * len(heads_of(r, dst_tp)) * BLOCK * 32 * 2, record
                descriptors[layout] = record["descriptors"]
            for rank in prefill.ranks:
                event = released(rank, 10.0)
                assert event and event["counters"]["released_read_done"] == 1, event
            for r, decode in enumerate(decodes):
                path = tmp_path / f"{layout}-{r}.pt"
                decode.send(f"dump {path}")
                assert decode.next(30.0) == {"dumped": str(path)}
                got, want = torch.load(path), expected(r, dst_tp, src_blocks, dst_blocks)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (layout, r)
    assert descriptors == {"LBHNC": len(dst_blocks) * 3 * sources, "LBNHC": len(dst_blocks) * 3 * sources * BLOCK}
