"""A prefill of pipeline parallel size 2 read into a decode of PP 1, moved for real: the connector's worker halves
(``Sender``, ``Receiver``) in one process per (stage, TP rank), as ``test_vllm_tp_transfer.py`` runs TP.

Stage 0 holds layers [0, 2), stage 1 layer 2 (vLLM's ``get_pp_indices`` split of 3 layers), each in its own
pool registered as ``KvxferWorker.register_kv_caches`` does (one region for its layers). Each decode layer must
hold, byte for byte, what the stage holding it computed, read from that stage's rank into the rows of the
decode's one region that hold that layer (``pp_stages``); each stage frees its blocks on its own read-done.
The handshake's stages are a peer's claim: checked and bounded before anything is read (the pure tests below).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace

import pytest
import torch

from kvxfer.errors import LayoutError, PeerMetadataError
from kvxfer.integrations.vllm.handshake import EngineLayout, check_compatible, first_difference
from kvxfer.integrations.vllm.pp_stages import Stage, compose_stages
from kvxfer.integrations.vllm.tp_reads import rank_reads
from tests.support.vllm_tp_ranks import (BLOCK, LAYERS, Prefill, Rank, dump, heads_of, load, released, values,
                                 vllm_views)

BACKEND = "nixl"
PREFILL_BLOCKS, DECODE_BLOCKS = 24, 40
STAGES = [(0, 2), (2, 1)]  # layers [0, 2) on stage 0, [2, 3) on stage 1


def expected(rank: int, tp: int, src_blocks: list[int], dst_blocks: list[int]) -> torch.Tensor:
    out = torch.zeros(LAYERS, DECODE_BLOCKS, len(heads_of(rank, tp)), BLOCK, 32, dtype=torch.bfloat16)
    out[:, dst_blocks] = values(PREFILL_BLOCKS, heads_of(rank, tp))[:, src_blocks]
    return out


@pytest.fixture(scope="module")
def views(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vllm_views(tmp_path_factory.mktemp("views"), [
        {"layout": lay, "heads": h, "block_size": BLOCK, "blocks": n, "layers": layers}
        for lay in ("LBHNC", "LBNHC") for h in (2, 4) for n, layers in ((DECODE_BLOCKS, LAYERS),
                                                                         *((PREFILL_BLOCKS, c) for _, c in STAGES))])


@pytest.mark.parametrize("tp,layout", [(1, "LBHNC"), (2, "LBHNC"), (2, "LBNHC")])
def test_each_decode_layer_comes_from_its_stage_and_each_stage_frees_after_its_reads(views, tp, layout, tmp_path):
    """Over the views vLLM 0.32 makes (``create_kv_cache_views``) on HND and NHD: a stage's pool is its layers'
    views of one allocation, the decode's one region of every layer gets each stage's rows."""
    src_blocks, dst_blocks = [3, 7, 8, 20, 0], [5, 6, 30, 1, 39]
    extra = ("layout", layout, "views", views)
    with ExitStack() as stack:
        prefill = Prefill(stack, tp, BACKEND, PREFILL_BLOCKS, 30.0, *extra, stages=STAGES)
        decodes = [Rank("decode", str(r), str(tp), BACKEND, str(DECODE_BLOCKS), *extra) for r in range(tp)]
        for rank in decodes:
            stack.callback(rank.close)
        # the second request goes over the same handshake: the windows registered once are reused
        moved_src, moved_dst = [], []
        for n, (request, src, dst) in enumerate([("req-a", src_blocks, dst_blocks), ("req-b", [1, 2], [10, 11])], 1):
            params = prefill.export(request, src, slot=n, lease=n)
            for r, decode in enumerate(decodes):
                record = load(decode, request, params, dst)["recent"][0]
                # every layer's blocks once: stage 0's two layers and stage 1's one, this rank's heads
                assert record["bytes"] == len(dst) * LAYERS * len(heads_of(r, tp)) * BLOCK * 32 * 2, record
                if n == 1:  # as at PP 1: one descriptor per block and layer (no two of these blocks adjacent)
                    assert record["descriptors"] == len(dst) * LAYERS, record
            for rank in prefill.ranks:  # each stage's rank frees on its own read-done, well before pin_grace_s
                event = released(rank, 10.0)
                assert event and event["released"] == request and event["counters"]["released_read_done"] == n, event
            moved_src, moved_dst = moved_src + src, moved_dst + dst
            for r, decode in enumerate(decodes):  # byte for byte what vLLM's layout holds on that rank
                got, want = dump(decode, tmp_path / f"decode{r}-{n}.pt"), expected(r, tp, moved_src, moved_dst)
                assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16)), r


# --- the stages a handshake claims: pure --------------------------------------------------------------------

def _region(layers: int, heads: int = 4) -> dict:
    return {"layers": layers, "layer_shape": [None, heads, BLOCK, 32], "blocks_axis": 0, "layout": "LBHNC",
            "dtype": "bfloat16"}


MODEL = {"num_layers": 3, "num_kv_heads": 4, "head_size": 16, "dtype": "bfloat16", "kv_dtype": "auto"}
DECODE = EngineLayout(model=MODEL, tp_size=1, pp_size=1, block_size=BLOCK, regions=(_region(3),), num_blocks=40)


def _prefill(stages: list, regions: list, **kw) -> dict:
    doc = {"model": MODEL, "tp_size": 1, "pp_size": len(stages or [0]), "block_size": BLOCK, "regions": regions,
           "num_blocks": 24, "stages": stages}
    doc.update(kw)
    return doc


def test_accepted_stages_map_each_layer_to_its_stage():
    prefill = EngineLayout.from_dict(_prefill([[0, 2, 1], [2, 1, 1]], [_region(2), _region(1)]))
    assert prefill.stages == (Stage(0, 0, 2, 1), Stage(1, 2, 1, 1)) and first_difference(prefill, DECODE) is None
    reads = rank_reads(0, DECODE, prefill)
    assert [r.src_rank for r in reads.reads] == [0, 1] and [n.rank for n in reads.notify] == [0, 1]
    assert [r.targets for r in reads.reads] == [((0, 0, 2),), ((0, 2, 1),)]  # decode region 0, rows of layers
    # per-layer regions on the prefill (one per layer) into a decode region of all layers
    per_layer = EngineLayout.from_dict(_prefill([[0, 2, 2], [2, 1, 1]], [_region(1)] * 3))
    assert [r.targets for r in rank_reads(0, DECODE, per_layer).reads] == [((0, 0, 1), (0, 1, 1)), ((0, 2, 1),)]
    assert EngineLayout.from_dict(prefill.to_dict()) == prefill


@pytest.mark.parametrize("stages,regions,why", [
    ([[0, 2, 1]], [_region(2)], "must list 2 stages"),  # pp_size 2 below
    ([[0, 2, 1], [1, 2, 1]], [_region(2), _region(2)], "follow one another"),  # layer 1 twice
    ([[0, 1, 1], [2, 1, 1]], [_region(1), _region(1)], "follow one another"),  # layer 1 in none
    ([[0, 2, 1], [2, 1, 1]], [_region(2)], "hold 2 regions"),
    ([[0, 2, 1], [2, True, 1]], [_region(2), _region(1)], "ints"),
    ([[0, 2, 1], [2, 1 << 20, 1]], [_region(2), _region(1)], "ints"),
    ([[0, 2, 3], [2, 1, 1]], [_region(1)] * 4, "at most one region per layer"),
    ("many", [_region(3)], "must list"),
])
def test_malformed_stages_are_refused_before_anything_is_read(stages, regions, why):
    with pytest.raises(PeerMetadataError, match=why):
        EngineLayout.from_dict(_prefill(stages, regions, pp_size=2))


@pytest.mark.parametrize("change,why", [
    (dict(stages=[[0, 1, 1], [1, 1, 1]], regions=[_region(1), _region(1)]), "stages hold layers \\[0, 2\\)"),
    (dict(regions=[_region(2, 2), _region(1, 2)]), "per-layer KV layout across pipeline stages"),
    (dict(tp_size=2), "combined with different TP"),
    (dict(block_size=8), "block size with pipeline stages"),
])
def test_stages_that_do_not_give_this_decode_its_layers_are_refused_naming_both(change, why):
    doc = _prefill([[0, 2, 1], [2, 1, 1]], [_region(2), _region(1)])
    doc.update(change)
    prefill = EngineLayout.from_dict(doc)
    assert why.replace("\\", "") in (first_difference(prefill, DECODE) or "") or \
        pytest.fail(first_difference(prefill, DECODE))


def test_a_decode_of_pp_2_and_a_stage_straddling_two_decode_regions_are_refused():
    prefill = EngineLayout.from_dict(_prefill([[0, 2, 1], [2, 1, 1]], [_region(2), _region(1)]))
    assert "decode of PP 1 only" in first_difference(prefill, replace(DECODE, pp_size=2))
    split = replace(DECODE, regions=(_region(1), _region(2)))  # decode regions [0, 1), [1, 3): stage 0 straddles
    assert "not within one region" in first_difference(prefill, split)
    no_stages = EngineLayout.from_dict(_prefill(None, [_region(3)], pp_size=2))
    assert first_difference(no_stages, DECODE) == "pipeline parallelism"


def test_refusal_names_both_layouts():
    doc = _prefill([[0, 2, 1], [2, 1, 1]], [_region(2), _region(1)], tp_size=2)
    from kvxfer.integrations.vllm.handshake import Handshake

    hs = Handshake("eng", "inst", BACKEND, EngineLayout.from_dict(doc), (), (), None)
    with pytest.raises(LayoutError, match="stage 0 layers \\[0, 2\\), stage 1 layers \\[2, 3\\).*decode TP 1 x PP 1"):
        check_compatible(DECODE, BACKEND, hs)


def test_the_producer_composes_its_stages_and_refuses_stages_that_do_not_fit():
    """What the producer's scheduler serves from its stages' TP rank 0 layouts (``compose_stages``)."""
    stage = lambda regions: replace(DECODE, pp_size=2, regions=regions, num_blocks=24)  # noqa: E731
    whole = compose_stages({0: stage((_region(2),)), 1: stage((_region(1),))}, {0: (0, 2), 1: (2, 1)})
    assert whole.stages == (Stage(0, 0, 2, 1), Stage(1, 2, 1, 1)) and len(whole.regions) == 2
    assert first_difference(EngineLayout.from_dict(whole.to_dict()), DECODE) is None
    with pytest.raises(LayoutError, match="follow one another"):
        compose_stages({0: stage((_region(2),)), 1: stage((_region(1),))}, {0: (0, 2), 1: (1, 1)})
    with pytest.raises(LayoutError, match="stages \\[0\\]"):
        compose_stages({0: stage((_region(2),))}, {0: (0, 2), 1: (2, 1)})
    with pytest.raises(LayoutError, match="differs from stage 0"):
        compose_stages({0: stage((_region(2),)), 1: replace(stage((_region(1),)), block_size=8)},
                       {0: (0, 2), 1: (2, 1)})
