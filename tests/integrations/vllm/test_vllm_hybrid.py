"""Hybrid attention+Mamba models (issue 27 item 3) at the connector's level, without vLLM.

What vLLM 0.32 hands a ``SupportsHMA`` connector (read from its source; docs/vllm.md, "Hybrid and MLA models"):
several KV cache groups (``kv_cache_config.transfer_group_ids``), block ids per group, and one int8 allocation
(``v1/worker/utils.py`` ``allocate_kv_cache``) that every group's layer views alias, layer slot ``l`` at
``l * num_blocks * page``, on one (padded) page size. KvxferConnector registers that allocation as pages
``uint8 [slots, num_blocks, page]`` and reads whole pages: an attention block's KV, a Mamba slot's state.
Here: the group checks, the ticket per group, the handshake's refusals, the page registration byte-exact
on an allocation laid out as vLLM lays it out, and a real ucx transfer of both groups into a decode's pool.
Real vLLM runs a tiny GraniteMoeHybrid through the connector in ``tests/integrations/vllm/test_vllm_hybrid_engine.py``.
"""

from __future__ import annotations

import copy
import time
from contextlib import ExitStack
from dataclasses import replace

import pytest
import torch

from kvxfer.errors import GeometryError, LayoutError, PeerMetadataError
from kvxfer.integrations.vllm.config import (DISABLE_HMA_HINT, MAMBA_ONLY_REFUSAL, ConnectorConfigError,
                                             check_kv_cache_groups)
from kvxfer.integrations.vllm.handshake import Handshake, check_compatible
from kvxfer.integrations.vllm.kv_buffers import TensorPlacement, hma_pages_region
from kvxfer.integrations.vllm.receiver import block_pairs
from kvxfer.integrations.vllm.specs import ATTENTION, MAMBA, GroupLoad, LoadSpec, TransferGroup
from kvxfer.integrations.vllm.tickets import derive_ticket_key, parse_ticket, prompt_digest, sign_ticket
from tests.support.vllm_support import (BLOCK, HYBRID_PAGE, HYBRID_SLOTS, HYBRID_STATE, Decode, Producer, engine_layout,
                                hybrid_pool)

ATTENTION_SPEC = ["FullAttentionSpec", "AttentionSpec", "KVCacheSpec", "object"]
MLA_SPEC = ["MLAAttentionSpec", *ATTENTION_SPEC]
MAMBA_SPEC = ["MambaSpec", "KVCacheSpec", "object"]
SWA_SPEC = ["SlidingWindowSpec", "AttentionSpec", "KVCacheSpec", "object"]
GROUPS = (TransferGroup(ATTENTION, BLOCK), TransferGroup(MAMBA, 2048))
KEY = derive_ticket_key(b"h" * 32)
PROMPT = list(range(1, 101))


def test_groups_attention_and_mamba_are_taken_sliding_window_and_pure_mamba_refused():
    assert check_kv_cache_groups([ATTENTION_SPEC]) == (ATTENTION,)
    assert check_kv_cache_groups([MLA_SPEC]) == (ATTENTION,)
    assert check_kv_cache_groups([MAMBA_SPEC, ATTENTION_SPEC]) == (MAMBA, ATTENTION)
    with pytest.raises(ConnectorConfigError) as info:
        check_kv_cache_groups([MAMBA_SPEC])
    assert str(info.value).startswith("this model's KV cache is MambaSpec (Mamba/SSM state) only")
    assert MAMBA_ONLY_REFUSAL in str(info.value)
    with pytest.raises(ConnectorConfigError, match="KV cache groups are all Mamba/SSM state"):
        check_kv_cache_groups([MAMBA_SPEC, MAMBA_SPEC])
    with pytest.raises(ConnectorConfigError) as info:
        check_kv_cache_groups([ATTENTION_SPEC, SWA_SPEC])
    assert "SlidingWindowSpec" in str(info.value) and "--disable-hybrid-kv-cache-manager" in str(info.value)
    assert DISABLE_HMA_HINT in str(info.value)


def ticket(groups=([4, 5, 9], [17]), num_tokens=99, **changes):
    params = dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=[list(g) for g in groups],
                  remote_engine_id="e1", remote_request_id="r1", remote_host="127.0.0.1", remote_port=5000,
                  tp_size=1, remote_num_tokens=num_tokens, **changes)
    return sign_ticket(params, {"instance": "i1", "slot": 3, "lease": 7, "backend": "ucx",
                                "prompt": prompt_digest(PROMPT, num_tokens)}, KEY)


def test_ticket_per_group_parsed_and_bounded():
    parsed = parse_ticket(ticket(), block_size=BLOCK, max_tokens=len(PROMPT), groups=GROUPS)
    assert parsed.groups == ((4, 5, 9), (17,)) and parsed.block_ids == (4, 5, 9) and parsed.num_tokens == 99
    parsed.verify(KEY)
    parsed.check_prompt(PROMPT)
    with pytest.raises(PeerMetadataError, match="has 1 KV cache groups; this decode's model has 2 .attention, mamba"):
        parse_ticket(ticket(groups=([4, 5, 9],)), groups=GROUPS)
    with pytest.raises(PeerMetadataError, match="has 3 KV cache groups"):
        parse_ticket(ticket(groups=([4], [17], [18])), groups=GROUPS)
    with pytest.raises(PeerMetadataError, match=r"group 1 \(Mamba state\) lists 2 blocks; .*exactly one"):
        parse_ticket(ticket(groups=([4, 5, 9], [17, 18])), groups=GROUPS)
    with pytest.raises(PeerMetadataError, match=r"group 1 \(Mamba state\) lists 0 blocks"):
        parse_ticket(ticket(groups=([4, 5, 9], [])), groups=GROUPS)
    with pytest.raises(PeerMetadataError, match="lists 6 blocks, more than the 5"):  # cdiv(99, 32) + 1
        parse_ticket(ticket(groups=([1, 2, 3, 4, 5, 6], [17])), groups=GROUPS)
    # the whole prompt's state: vLLM recomputes the last prompt token, which such a state already holds
    with pytest.raises(PeerMetadataError, match="'remote_num_tokens' is 100 for a prompt of 100 tokens; with Mamba"):
        parse_ticket(ticket(num_tokens=100), block_size=BLOCK, max_tokens=len(PROMPT), groups=GROUPS)
    # one attention group (not hybrid): the whole prompt, as before
    assert parse_ticket(ticket(groups=([4, 5, 9, 10],), num_tokens=100), block_size=BLOCK,
                        max_tokens=len(PROMPT)).block_ids == (4, 5, 9, 10)


def test_block_pairs_per_group():
    attention, mamba = GROUPS
    parsed = parse_ticket(ticket(groups=([4, 5, 9, 11], [17])), groups=GROUPS)
    spec = LoadSpec("r1", {}, (30, 31, 40), 0, True,
                    groups=(GroupLoad(attention, (30, 31), 2), GroupLoad(mamba, (40,))))
    assert block_pairs(spec, parsed) == ([9, 11, 17], [30, 31, 40])  # past a 2-block local hit; slot to slot
    short = LoadSpec("r1", {}, (), 0, True, groups=(GroupLoad(attention, (30, 31), 3), GroupLoad(mamba, (40,))))
    assert "names 4 blocks of KV cache group 0, the request needs blocks 3..4" in block_pairs(short, parsed)
    no_slot = LoadSpec("r1", {}, (), 0, True, groups=(GroupLoad(attention, (30,)), GroupLoad(mamba, ())))
    assert "group 1 (Mamba state) pairs 1 prefill slot(s) with 0 decode slot(s)" in block_pairs(no_slot, parsed)


def hybrid_handshake(layout) -> Handshake:
    return Handshake("p1", "i1", "ucx", layout, ((),), ({},), None)


def test_check_compatible_refuses_other_mamba_facts_and_tp_without_layout_facts():
    _, _, _, region = hybrid_pool(16, fill=False)
    local = engine_layout([region], 16, hybrid=True)
    check_compatible(local, "ucx", hybrid_handshake(local))
    for field, value in (("conv_layout", "DS"), ("mamba_cache_mode", "align"), ("shapes", [[3, 1000], [2, 2400]])):
        model = copy.deepcopy(dict(local.model))
        model["kv_groups"][1][field] = value
        theirs = replace(local, model=model)
        with pytest.raises(LayoutError) as info:
            check_compatible(local, "ucx", hybrid_handshake(theirs))
        text = str(info.value)
        assert "different model" in text and "hybrid KV cache groups" in text and repr(value)[:6] in text
    tp2 = replace(local, tp_size=2)
    with pytest.raises(LayoutError) as info:
        check_compatible(local, "ucx", hybrid_handshake(tp2))
    # a peer whose facts lack the attention layout (and the Mamba type): never read by parts (tests/integrations/vllm/test_vllm_hybrid_tp.py)
    assert ("tensor parallelism with a hybrid attention+Mamba model (prefill: attention layout ['None']; a head range "
            "is one byte range only on LBHNC; prefill TP 2, decode TP 1)") in str(info.value)
    single = engine_layout([region], 16)  # a peer running the model with one attention group
    with pytest.raises(LayoutError, match="different model"):
        check_compatible(local, "ucx", hybrid_handshake(single))


def test_pages_region_is_vllms_allocation_byte_exact():
    blocks = 16
    raw, kv_caches, placements, region = hybrid_pool(blocks)
    assert region.layout == "HMA-pages" and region.head_slabs == 1
    assert region.view.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    assert region.view.numel() == raw.numel() == HYBRID_SLOTS * blocks * HYBRID_PAGE
    assert region.signature == {"layers": 2 * HYBRID_SLOTS, "layer_shape": [HYBRID_SLOTS, None, HYBRID_PAGE],
                                "blocks_axis": 1, "layout": "HMA-pages", "dtype": "uint8"}
    pages = region.view.reshape(HYBRID_SLOTS, blocks, HYBRID_PAGE)
    for layer in range(HYBRID_SLOTS):
        attn, mamba = kv_caches[f"model.layers.{2 * layer + 1}.attn"], kv_caches[f"model.layers.{2 * layer}.mixer"]
        for b in range(blocks):  # page b of slot l is attention block b of layer l, and Mamba slot b of layer l
            assert torch.equal(pages[layer, b], attn[b].contiguous().view(torch.uint8).flatten())
            assert torch.equal(pages[layer, b, :HYBRID_STATE], mamba[b].flatten().view(torch.uint8))
    outermost = [TensorPlacement(p.layers, p.size, 0, HYBRID_PAGE, HYBRID_SLOTS * HYBRID_PAGE) for p in placements]
    with pytest.raises(GeometryError, match="not layer-outermost .*block-outermost layout"):
        hma_pages_region(kv_caches, outermost, blocks)
    with pytest.raises(GeometryError, match="block strides"):
        hma_pages_region(kv_caches, [placements[0], TensorPlacement(placements[1].layers, raw.numel(), 0,
                                                                    blocks * 12_288, 12_288)], blocks)
    with pytest.raises(GeometryError, match="live in 2 allocations"):
        hma_pages_region({**kv_caches, "other": torch.zeros(4, dtype=torch.int8)}, placements, blocks)


def test_attention_blocks_and_mamba_slot_move_byte_exact_over_ucx():
    src_blocks, dst_blocks = 24, 40
    attention_src, mamba_src = [3, 7, 9], [12]  # odd: attention pages in the source pool, even: Mamba state
    attention_dst, mamba_dst = [21, 5, 33], [38]
    with ExitStack() as stack:
        producer = Producer(stack, "ucx", blocks=src_blocks, hybrid=True)
        decode = Decode(stack, "ucx", blocks=dst_blocks, hybrid=True)
        params = producer.ticket([], "req-h", num_tokens=3 * BLOCK - 1, groups=[attention_src, mamba_src])
        attention, mamba = GROUPS
        decode.submit("req-h", params, attention_dst + mamba_dst,
                      groups=[GroupLoad(attention, tuple(attention_dst)), GroupLoad(mamba, tuple(mamba_dst))])
        decode.run_until({"req-h"}, 30.0)
        assert decode.failed == set()
        record = decode.receiver.recent[-1]
    expected_src, _, _, _ = hybrid_pool(src_blocks)
    want = torch.zeros(HYBRID_SLOTS, dst_blocks, HYBRID_PAGE, dtype=torch.int8)
    source = expected_src.view(HYBRID_SLOTS, src_blocks, HYBRID_PAGE)
    for s, d in zip(attention_src + mamba_src, attention_dst + mamba_dst):
        want[:, d] = source[:, s]
    assert torch.equal(decode.buffer.view(HYBRID_SLOTS, dst_blocks, HYBRID_PAGE), want)  # nothing else written
    assert record["bytes"] == 4 * HYBRID_SLOTS * HYBRID_PAGE and record["blocks"] == 4


def test_a_release_only_load_of_a_hybrid_model_tells_the_producer_without_reading_a_block():
    """A request whose whole prompt the decode already holds (or that was aborted before it was
    scheduled) only releases the producer's pin. For a hybrid model the ticket carries a block list
    per group: the release-only spec now carries the groups too (it had none, so the ticket was
    refused as malformed and the producer kept its blocks and lease slot until ``pin_grace_s``)."""
    with ExitStack() as stack:
        producer = Producer(stack, "ucx", blocks=24, hybrid=True)
        decode = Decode(stack, "ucx", blocks=40, hybrid=True)
        params = producer.ticket([], "req-r", num_tokens=3 * BLOCK - 1, groups=[[3, 7, 9], [12]])
        decode.submit("req-r", params, [], awaiting=False, groups=[GroupLoad(g, ()) for g in GROUPS])
        for _ in range(400):
            decode.step()
            if not decode.receiver.in_flight:
                break
            time.sleep(0.005)
        assert decode.receiver.in_flight == 0 and decode.receiver.counters["refused"] == 0, decode.receiver.counters
        deadline = time.monotonic() + 10
        while "req-r" not in producer.source.ask("done")["read_done"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "req-r" in producer.source.ask("done")["read_done"]  # the producer may free the request now
    assert not decode.buffer.any()  # and not a byte was read
