"""Different attention TP or PP between an SGLang prefill and decode, in kvxfer's pure parts (no SGLang
needed): the bytes of a page each decode rank reads from each prefill rank, into which of its buffers
(``kvxfer.integrations.sglang.tp``). The prefill's room table with several decode ranks reading one room is in
``test_sglang_source_rooms.py``.

The plan is checked by applying it to pages laid out as SGLang's ``MHATokenToKVPool`` lays them out
(``[tokens, heads_on_rank, head_dim]`` per layer): each decode rank must end up holding exactly its heads;
and, for pipeline stages, buffers laid out as each stage's pool holds its layers (K layers then V layers, or
one latent per layer): the decode must end up holding every layer, each from the stage that holds it.
The real-process runs are ``test_sglang_tp.py`` and ``test_sglang_pp.py``."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.integrations.sglang.tp import parallel_refusal, plan_pair, stage_coverage

PAGE, HEAD_DIM, LAYERS = 4, 8, 2  # bf16: 16 B per head per token


def layout(tp: int, rank: int, heads_total: int, *, role: str, mla: bool = False, state=(), pp=(1, 0),
           layers=(0, LAYERS), **over):
    """A ``regions.kv_layout`` dict as each role's manager makes it (heads stated on a non-MLA prefill only; the
    stage's layers ``[start, stop)`` and SGLang's ``prefill_end_layer`` too, which a decode does not state)."""
    heads = max(1, heads_total // tp)
    item = PAGE * (1 if mla else heads) * (72 if mla else HEAD_DIM) * 2
    count = LAYERS if layers is None else layers[1] - layers[0]
    out = {"model": "m", "page_size": PAGE, "kv_cache_dtype": "bfloat16", "kv_layout": None, "attn_tp_size": tp,
           "attn_tp_rank": rank, "pp_size": pp[0], "pp_rank": pp[1], "layers": None if layers is None else list(layers),
           "mla": mla,
           "kv_head_num": heads if role == "prefill" and not mla else None,
           "total_kv_head_num": heads_total if role == "prefill" and not mla else None, "num_draft_entries": 0,
           "kv_buffers": count * (1 if mla else 2), "kv_item_lens": [item] * (count * (1 if mla else 2)),
           "aux_item_lens": [64], "state_types": list(state), "state_item_lens": [[32] for _ in state]}
    if role == "prefill":
        out["prefill_end_layer"] = None if layers is None else layers[1]
    out.update(over)
    return out


def read_page(src: np.ndarray, dst: np.ndarray, parts) -> None:
    """What the transport does with a plan's parts for one page pair (flat byte views)."""
    if parts is None:
        dst[:] = src
        return
    for p in parts:
        dst[p.dst_offset:p.dst_offset + p.length] = src[p.src_offset:p.src_offset + p.length]


def mamba(tp: int, rank: int, heads: int, role: str, *, dims, outer=(1, 1), groups=(None, None), elem=4, mla=False):
    """A layout with one Mamba component of two tensors (a conv state, a temporal state) of one layer: each slot
    ``outer`` rows of its TP-sharded axis (``dims``, this rank's size of it) of ``elem``-byte units."""
    return layout(tp, rank, heads, role=role, mla=mla, state_types=["mamba"],
                  state_item_lens=[[d * o * elem for d, o in zip(dims, outer)]], state_dims=[list(dims)],
                  state_outer_counts=[list(outer)], state_conv_groups=[list(groups)])


def shard(full: np.ndarray, tp: int, rank: int, groups) -> np.ndarray:
    """A rank's slot of a state tensor, as SGLang's ranks hold it: ``full`` is ``[outer, axis, unit]``; the axis
    is one block sharded by TP, or sub-blocks (``groups``, their full sizes) each sharded apart, concatenated."""
    subs, at, out = groups or [full.shape[1]], 0, []
    for size in subs:
        per = size // tp
        out.append(full[:, at + rank * per:at + (rank + 1) * per])
        at += size
    return np.concatenate(out, axis=1).reshape(-1)


@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4)])
@pytest.mark.parametrize("groups,outer", [((None, None), (1, 1)), (([16, 16, 32], None), (1, 1)),
                                          ((None, None), (3, 2))])
def test_each_decode_rank_ends_up_holding_exactly_its_mamba_state(tp_p, tp_d, groups, outer):
    """A conv state (its axis 64 in all, plain or three sub-blocks each sharded apart as GDN's) and a temporal
    state (8 heads), ``outer`` rows each, split as SGLang's ranks hold them: every decode rank reads from the
    prefill ranks SGLang pairs it with, through ``plan_pair``'s state parts: its slot is its shard, byte for byte."""
    rng = np.random.default_rng(tp_p * 10 + tp_d + outer[0])
    full = [rng.integers(0, 256, size=(o, n, 4), dtype=np.uint8) for o, n in zip(outer, (64, 8))]

    def side(tp, rank, role):
        return mamba(tp, rank, 4, role, dims=[64 // tp, 8 // tp], outer=outer, groups=groups)

    for d in range(tp_d):
        sources = [d // (tp_d // tp_p)] if tp_d >= tp_p else list(range(d * (tp_p // tp_d), (d + 1) * (tp_p // tp_d)))
        for j, tensor in enumerate(full):
            got = np.zeros_like(shard(tensor, tp_d, d, groups[j]))
            for p in sources:
                refused, plan = plan_pair(side(tp_p, p, "prefill"), side(tp_d, d, "decode"))
                assert refused is None, refused
                read_page(shard(tensor, tp_p, p, groups[j]), got, plan.state.parts[0][j])
            assert (got == shard(tensor, tp_d, d, groups[j])).all(), (tp_p, tp_d, d, j)
    same = plan_pair(side(2, 1, "prefill"), side(2, 1, "decode"))
    assert same[0] is None and same[1].state is None  # the same TP: whole slots, as before


@pytest.mark.parametrize("tp_p,tp_d,heads", [(1, 2, 4), (2, 1, 4), (2, 4, 8), (4, 2, 8), (1, 4, 2), (1, 2, 1),
                                             (2, 4, 2)])
def test_each_decode_rank_ends_up_holding_exactly_its_heads(tp_p, tp_d, heads):
    """Global pages of ``heads`` heads, split as SGLang's ranks hold them; every decode rank reads from the
    prefill ranks SGLang pairs it with, through ``plan_pair``'s parts: its page is its heads, byte for byte."""
    rng = np.random.default_rng(tp_p * 10 + tp_d)
    page = rng.integers(0, 256, size=(PAGE, heads, HEAD_DIM * 2), dtype=np.uint8)  # one global page of one layer

    def held(tp, rank):  # a rank's heads, as KVShardLayout places them (replicated when TP > heads)
        per = max(1, heads // tp)
        start = rank * per if tp <= heads else rank // (tp // heads)
        return page[:, start:start + per].reshape(-1)

    for d in range(tp_d):
        sources = [d // (tp_d // tp_p)] if tp_d >= tp_p else list(range(d * (tp_p // tp_d), (d + 1) * (tp_p // tp_d)))
        got = np.zeros_like(held(tp_d, d))
        for p in sources:
            refused, plan = plan_pair(layout(tp_p, p, heads, role="prefill"), layout(tp_d, d, heads, role="decode"))
            assert refused is None, refused
            assert len(plan.parts) == 2 * LAYERS
            read_page(held(tp_p, p), got, plan.parts[0])
        assert (got == held(tp_d, d)).all(), (tp_p, tp_d, d)


def test_plans_name_their_heads_and_merge_nothing_they_need_not():
    refused, plan = plan_pair(layout(1, 0, 4, role="prefill"), layout(2, 1, 4, role="decode"))
    assert refused is None and plan.heads == (2, 0, 2) and not plan.whole_pages
    assert len(plan.parts[0]) == PAGE  # one run of heads per token row of a page
    same = plan_pair(layout(2, 1, 4, role="prefill"), layout(2, 1, 4, role="decode"))
    assert same[0] is None and same[1].whole_pages  # the same TP: whole pages, as before
    mla = plan_pair(layout(2, 1, 4, role="prefill", mla=True), layout(1, 0, 4, role="decode", mla=True))
    assert mla[0] is None and mla[1].whole_pages  # MLA: one latent copy per rank, any TP
    replicated = plan_pair(layout(1, 0, 1, role="prefill"), layout(2, 1, 1, role="decode"))
    assert replicated[0] is None and replicated[1].whole_pages  # one KV head, on every decode rank


@pytest.mark.parametrize("prefill,decode,words", [
    (layout(1, 0, 6, role="prefill"), layout(4, 1, 6, role="decode"), ["6 KV heads do not divide evenly", "tp_size=4"]),
    (layout(2, 0, 4, role="prefill"), layout(3, 0, 4, role="decode"), ["do not divide one another"]),
    (layout(4, 0, 2, role="prefill"), layout(2, 0, 2, role="decode"), ["replicates its 2 KV heads"]),
    (layout(1, 0, 4, role="prefill", state=["swa"]), layout(2, 0, 4, role="decode", state=["swa"]),
     ["does not slice state", "only Mamba"]),
    (layout(1, 0, 4, role="prefill", state=["mamba"]), layout(2, 0, 4, role="decode", state=["mamba"]),
     ["mamba state tensors do not pair"]),  # no sharded axis stated
    (mamba(1, 0, 4, "prefill", dims=[48, 4]), mamba(2, 0, 4, "decode", dims=[32, 2]),
     ["mamba state tensor 0", "a sharded axis of 48 x TP 1 on the prefill, 32 x TP 2"]),
    (mamba(1, 0, 4, "prefill", dims=[0, 4]), mamba(2, 0, 4, "decode", dims=[0, 2]), ["replicated"]),
    (mamba(2, 0, 4, "prefill", dims=[32, 2], mla=True), mamba(1, 0, 4, "decode", dims=[64, 4], mla=True),
     ["dummy pairings"]),
    (mamba(1, 0, 4, "prefill", dims=[64, 4], outer=(10**6, 1)), mamba(2, 0, 4, "decode", dims=[32, 2], outer=(10**6, 1)),
     ["blocks per slot"]),  # a peer's layout cannot cost a plan of any size
    (mamba(1, 0, 4, "prefill", dims=[64, 4], outer=(-1, 1)), mamba(2, 0, 4, "decode", dims=[32, 2], outer=(-1, 1)),
     ["-1 rows"]),
    (layout(1, 0, 4, role="prefill", mla=True), layout(2, 0, 4, role="decode", mla=True, kv_item_lens=[9] * 2),
     ["MLA pages differ"]),
    (layout(1, 0, 4, role="prefill", kv_head_num=None, total_kv_head_num=None), layout(2, 0, 4, role="decode"),
     ["states no KV head count"]),
    (layout(1, 0, 4, role="prefill"), layout(2, 0, 4, role="decode", kv_item_lens=[4 * 2 * 16 * 2] * 4),
     ["KV buffer 0", "its page is 256 B"]),  # another head size on the decode
    (layout(1, 0, 4, role="prefill", num_draft_entries=2), layout(2, 0, 4, role="decode", num_draft_entries=2),
     ["draft-model"]),
    (layout(1, 0, 4, role="prefill"), layout(2, 0, 4, role="decode", page_size=8), ["page_size: prefill=4 decode=8"]),
    (layout(2, 1, 4, role="prefill"), layout(2, 0, 4, role="decode"), ["attn_tp_rank: prefill=1 decode=0"]),
])
def test_what_cannot_be_read_byte_exact_is_refused_naming_both_layouts(prefill, decode, words):
    refused, plan = plan_pair(prefill, decode)
    assert plan is None and refused and all(w in refused for w in words), refused
    if prefill["attn_tp_size"] != decode["attn_tp_size"] and "page_size:" not in words[0]:
        assert f"attn_tp_size={prefill['attn_tp_size']}" in refused and f"attn_tp_size={decode['attn_tp_size']}" \
            in refused, refused  # both layouts named


def test_bootstrap_refuses_decode_pp_pp_across_tp_uneven_tp_and_state():
    assert parallel_refusal(prefill_tp=1, prefill_pp=1, decode_tp=2, decode_pp=1, decode_state=[]) is None
    assert parallel_refusal(prefill_tp=1, prefill_pp=2, decode_tp=1, decode_pp=1, decode_state=[]) is None
    assert parallel_refusal(prefill_tp=2, prefill_pp=4, decode_tp=2, decode_pp=1, decode_state=[]) is None
    assert "decode of PP 1 only" in parallel_refusal(prefill_tp=1, prefill_pp=2, decode_tp=1, decode_pp=2,
                                                     decode_state=[])
    assert "same attention TP" in parallel_refusal(prefill_tp=1, prefill_pp=2, decode_tp=2, decode_pp=1,
                                                   decode_state=[])
    assert "pipeline stages" in parallel_refusal(prefill_tp=1, prefill_pp=2, decode_tp=1, decode_pp=1,
                                                 decode_state=["mamba"])
    assert "divide" in parallel_refusal(prefill_tp=2, prefill_pp=1, decode_tp=3, decode_pp=1, decode_state=[])
    assert parallel_refusal(prefill_tp=1, prefill_pp=1, decode_tp=2, decode_pp=1, decode_state=["mamba"]) is None
    assert "swa" in parallel_refusal(prefill_tp=1, prefill_pp=1, decode_tp=2, decode_pp=1, decode_state=["swa"])
    assert parallel_refusal(prefill_tp=2, prefill_pp=1, decode_tp=2, decode_pp=1, decode_state=["mamba"]) is None


def stage_buffers(layers: tuple[int, int], total: int, mla: bool, rng) -> list[np.ndarray]:
    """A pool's KV buffers as SGLang orders them in ``KVArgs`` (one page each): K of each layer, then V of each
    (MHA/GQA), or one latent per layer (MLA); a decode of PP 1 holds ``(0, total)``."""
    return [rng.integers(0, 256, size=64, dtype=np.uint8) for _ in range((1 if mla else 2) * (layers[1] - layers[0]))]


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("split", [(2, 3), (3, 2), (1, 1, 3), (5,)])
def test_each_decode_layer_is_read_from_the_stage_that_holds_it(split, mla):
    """A model of ``sum(split)`` layers split over pipeline stages (SGLang's ``get_pp_indices`` gives uneven
    splits too): each stage's buffers go into the decode buffers of their layers, and together every decode
    buffer exactly once, byte for byte."""
    rng = np.random.default_rng(len(split) * 7 + split[0])
    total, pp = sum(split), len(split)
    per_layer = 1 if mla else 2
    truth = {}  # (K or V or latent, layer) -> the page the stage holding that layer has
    decode = layout(1, 0, 4, role="decode", mla=mla, layers=(0, total))
    got: dict[int, np.ndarray] = {}
    plans, start = [], 0
    for rank, n in enumerate(split):
        stage = layout(1, 0, 4, role="prefill", mla=mla, pp=(pp, rank), layers=(start, start + n))
        pages = stage_buffers((start, start + n), total, mla, rng)
        for i, page in enumerate(pages):
            truth[(i // n, start + i % n)] = page
        refused, plan = plan_pair(stage, decode)
        assert refused is None, refused
        assert plan.whole_pages and plan.layers == ((start, start + n) if pp > 1 else None)  # PP 1: as before
        for s_index, d_index in plan.pairs():
            assert d_index not in got, f"decode buffer {d_index} written twice"
            got[d_index] = pages[s_index]
        plans.append((f"stage{rank}", plan))
        start += n
    assert sorted(got) == list(range(per_layer * total))
    for (kind, layer), page in truth.items():  # decode buffer of (K or V, layer): K layers then V layers
        assert (got[kind * total + layer] == page).all(), (kind, layer)
    assert stage_coverage(plans, decode) is None


def test_stages_that_do_not_give_every_layer_once_are_refused_naming_them():
    decode = layout(1, 0, 4, role="decode", layers=(0, 5))

    def plans(*ranges):
        out = []
        for rank, (a, b) in enumerate(ranges):
            refused, plan = plan_pair(layout(1, 0, 4, role="prefill", pp=(2, rank), layers=(a, b)), decode)
            assert refused is None, refused
            out.append((f"s{rank}", plan))
        return out

    assert "[2, 5) are read from none" in stage_coverage(plans((0, 2)), decode)
    assert "layer 2 is read from none" in stage_coverage(plans((0, 2), (3, 5)), decode)
    assert "layer 1 twice" in stage_coverage(plans((0, 2), (1, 5)), decode)
    assert stage_coverage(plans((2, 5), (0, 2)), decode) is None  # SGLang fetches the last stage first
    tp_plan = plan_pair(layout(1, 0, 4, role="prefill", layers=(0, 5)), decode)[1]
    assert "ranks that are none" in stage_coverage([*plans((0, 2)), ("tp", tp_plan)], decode)


@pytest.mark.parametrize("prefill,decode,words", [
    (layout(1, 0, 4, role="prefill", pp=(2, 0)), layout(1, 0, 4, role="decode", pp=(2, 0), layers=None),
     ["decode of PP 1 only", "this decode has PP 2", "pp_size=2 rank 0 (layers not stated)"]),
    (layout(1, 0, 4, role="prefill", pp=(2, 0)), layout(2, 0, 4, role="decode"),
     ["same attention TP only", "attn_tp_size=1", "attn_tp_size=2"]),
    (layout(1, 0, 4, role="prefill", pp=(2, 1), state=["mamba"]), layout(1, 0, 4, role="decode", state=["mamba"]),
     ["does not read state", "pipeline stages"]),
    (layout(1, 0, 4, role="prefill", pp=(2, 1), num_draft_entries=2), layout(1, 0, 4, role="decode",
                                                                              num_draft_entries=2), ["draft-model"]),
    (layout(1, 0, 4, role="prefill", pp=(2, 1), kv_layout="dsv4"), layout(1, 0, 4, role="decode", kv_layout="dsv4"),
     ["kv_layout='dsv4'"]),
    (layout(1, 0, 4, role="prefill", pp=(2, 1), layers=(1, 3)), layout(1, 0, 4, role="decode", layers=(0, 2)),
     ["[1, 3) are not within the decode's 2 layers"]),
    (layout(1, 0, 4, role="prefill", pp=(2, 1), layers=(1, 2), prefill_end_layer=3),
     layout(1, 0, 4, role="decode", layers=(0, 3)), ["prefill_end_layer=3", "end at 2"]),
    (layout(1, 0, 4, role="prefill", pp=(2, 1), layers=(1, 2)),
     layout(1, 0, 4, role="decode", layers=(0, 3), kv_item_lens=[256, 128, 256, 256, 256, 256]),
     ["KV buffer 0 of the prefill stage (layer 1) has pages of 256 B", "decode's buffer 1 of 128 B"]),
    (layout(1, 0, 4, role="prefill", pp=(2, 1), page_size=8), layout(1, 0, 4, role="decode"),
     ["page_size: prefill=8 decode=4"]),
    (layout(2, 1, 4, role="prefill", pp=(2, 1)), layout(2, 0, 4, role="decode"), ["attn_tp_rank: prefill=1 decode=0"]),
])
def test_what_a_stage_cannot_give_byte_exact_is_refused_naming_both_layouts(prefill, decode, words):
    refused, plan = plan_pair(prefill, decode)
    assert plan is None and refused and all(w in refused for w in words), refused
