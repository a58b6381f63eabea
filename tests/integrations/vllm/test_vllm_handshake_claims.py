"""No handshake holds a decode's engine step or grows its memory by what a peer claims (issue 39, item 3).

Round 5: a producer's handshake (no cluster key: any process of the host can serve one) claiming TP 2 and
``num_kv_heads`` 2**26 made one decode engine step take 7.1 s and 10.4 s and grew the decode by 5.1 GiB
before it was refused: ``from_dict`` bounded tp/pp/blocks but not heads, the TP mapping enumerated every
head, the compatibility check went on to TP after "model" already differed, and it all ran again on the
step thread. And TP 2 claimed with one rank's metas listed twice loaded, 3 of 3 blocks garbled.

Now every number of a handshake's layout is bounded before anything reads it, the compatibility check
stops at the first difference, the decode rank's verdict is worked out off the step thread (the step only
looks it up), and with several ranks each rank's metas must name that rank (its worker's agent name,
sealed in every meta it exports).

Connector level, with real objects: the receiver and handshake cache a decode worker builds
(``tests/vllm_support.Decode``), real sources and rank processes (``vllm_support.Producer``,
``vllm_tp_ranks``), handshakes served over TCP by the connector's own listener.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from contextlib import ExitStack
from typing import Any

import pytest
import torch

from kvxfer.errors import LayoutError, PeerMetadataError
from kvxfer.integrations.vllm import handshake as hs
from kvxfer.integrations.vllm.handshake import EngineLayout, build_handshake, check_compatible, parse_handshake
from kvxfer.integrations.vllm.receiver import Receiver
from kvxfer.integrations.vllm.side_channel import HandshakeListener
from kvxfer.integrations.vllm.tickets import sign_ticket
from tests.support.ucx_served_source import rss_mib
from tests.support.vllm_support import Decode, Producer
from tests.support.vllm_tp_ranks import BLOCK, Prefill, Rank, heads_of, load, submit, values

#: The longest an engine step may spend in the connector while a peer's handshake is refused (a step is
#: milliseconds; round 5's were 7.1 s and 10.4 s).
STEP_BOUND_S = 0.5
#: What the decode may grow by while refusing such a handshake (round 5: +5.1 GiB).
RSS_BOUND_MIB = 64


def _ticket(engine_id: str, instance: str, backend: str, port: int, key: bytes, request_id: str, blocks: list[int],
            tp_size: int, slot: int = 1, lease: int = 1) -> dict[str, Any]:
    """A ticket as a producer signs it, naming the handshake served on ``port``."""
    params = dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=[list(blocks)],
                  remote_engine_id=engine_id, remote_request_id=request_id, remote_host="127.0.0.1", remote_port=port,
                  tp_size=tp_size, remote_num_tokens=len(blocks) * BLOCK, transfer_mode="pull")
    return sign_ticket(params, {"instance": instance, "slot": slot, "lease": lease, "backend": backend,
                                "prompt": "0" * 64}, key)


def test_a_handshake_claiming_2_26_kv_heads_is_refused_without_holding_a_step() -> None:
    """Round 5's attack, at the connector: a real source's metas served in a handshake that claims TP 2 and
    2**26 KV heads. The load is refused naming the field; no engine step spends STEP_BOUND_S in the
    connector, and the decode does not grow by RSS_BOUND_MIB."""
    with ExitStack() as stack:
        producer = Producer(stack, "ucx", blocks=16)
        decode = Decode(stack, "ucx", blocks=16)
        real = EngineLayout.from_dict(producer.source.info["layout"])
        claim = EngineLayout(model={**real.model, "num_kv_heads": 2 ** 26}, tp_size=2, pp_size=1,
                             block_size=real.block_size, regions=real.regions, num_blocks=real.num_blocks)
        rank = {"kv": producer.source.info["kv"], "lease": producer.source.info["lease"]}
        key = os.urandom(32)
        document = build_handshake(engine_id="eng-claims", instance="i1", backend="ucx", layout=claim,
                                   ranks={0: rank, 1: rank}, ticket_key=key, cluster_key=None)
        listener = HandshakeListener("127.0.0.1", 0, lambda: document, local_peers_only=True)
        stack.callback(listener.close)
        before = rss_mib()
        decode.submit("claims", _ticket("eng-claims", "i1", "ucx", listener.port, key, "claims", [1, 2, 3], 2),
                      [4, 5, 6])
        decode.run_until({"claims"}, 60)
        grown = rss_mib() - before
        held = decode.longest_call_s
        assert held < STEP_BOUND_S, f"an engine step spent {held:.2f}s in the connector"
        assert grown < RSS_BOUND_MIB, f"the decode grew by {grown:.0f} MiB"
        assert decode.failed == {"claims"}
        reason = decode.receiver.recent[-1]["failed"]
        assert "'model.num_kv_heads' must be an int in [1, 65536], got 67108864" in reason, reason
        assert torch.count_nonzero(decode.buffer) == 0  # nothing was read
        print(f"refused; longest step in the connector {decode.longest_call_s * 1e3:.1f} ms, decode RSS "
              f"+{grown:.1f} MiB")


def _attention_layout(**changes: Any) -> dict[str, Any]:
    model = {"num_layers": 4, "num_kv_heads": 8, "head_size": 64, "dtype": "bfloat16", "kv_dtype": "auto"}
    doc = {"model": model, "tp_size": 1, "pp_size": 1, "block_size": 16, "num_blocks": 64,
           "regions": [{"layers": 4, "layer_shape": [None, 8, 16, 128], "blocks_axis": 0, "layout": "LBHNC",
                        "dtype": "bfloat16"}]}
    for path, value in changes.items():
        where, *rest = path.split(".")
        if rest:
            doc[where][rest[0]] = value
        else:
            doc[where] = value
    return doc


@pytest.mark.parametrize("path,value,words", [
    ("model.num_kv_heads", 2 ** 26, "'model.num_kv_heads' must be an int in [1, 65536]"),
    ("model.num_layers", 2 ** 20, "'model.num_layers' must be an int in [1, 16384]"),
    ("model.head_size", 2 ** 30, "'model.head_size' must be an int in [1, 65536]"),
    ("model.mamba_ngroups", 2 ** 40, "'model.mamba_ngroups' must be an int in [1, 65536]"),
    ("model.num_kv_heads", "8", "'model.num_kv_heads' must be an int"),
    ("tp_size", 2 ** 20, "'tp_size' must be an int in [1, 1024]"),
    ("pp_size", 4096, "'pp_size' must be an int in [1, 1024]"),
    ("block_size", 2 ** 30, "'block_size' must be an int in [1, 16777216]"),
    ("num_blocks", 2 ** 41, "'num_blocks' must be a positive int"),
    ("regions", [{"layer_shape": [None, 1, 16, 128]}] * 20000, "20000 items"),
    ("model.kv_groups", [{"spec": "FullAttentionSpec", "layers": 1}] * 300, "300 KV cache groups"),
    ("model.kv_groups", [{"spec": "FullAttentionSpec", "layers": 2 ** 20}], "'model.kv_groups[].layers'"),
    ("model.architectures", ["x" * 5000], "a string of 5000 characters"),
    ("model.page", 2 ** 60, "over 2**50"),
    ("model.deep", [[[[[[[[[1]]]]]]]]], "nested deeper than 8"),
    ("model.many", [[0] * 10000] * 40, "more than 262144 values"),
])
def test_every_number_of_a_layout_is_bounded_before_any_work(path: str, value: Any, words: str) -> None:
    """Each number work could be proportional to has a named bound (``handshake.MAX_*``), and the layout's
    shape too; a layout past one is refused naming it, in milliseconds."""
    doc = _attention_layout(**{path: value})
    began = time.perf_counter()
    with pytest.raises(PeerMetadataError) as refused:
        EngineLayout.from_dict(doc)
    assert words in str(refused.value), str(refused.value)
    assert time.perf_counter() - began < 0.5
    EngineLayout.from_dict(_attention_layout())  # the same layout within its bounds is taken


def _handshake(layout: dict[str, Any], tp: int) -> Any:
    ranks = {r: {"kv": [{"m": r, "agent_name": hs.rank_agent_name("e1", r, tp)}],
                 "lease": {"agent_name": None}} for r in range(tp)}
    for r in range(tp):
        ranks[r]["lease"]["agent_name"] = ranks[r]["kv"][0]["agent_name"]
    return parse_handshake(json.loads(build_handshake(engine_id="e1", instance="i1", backend="nixl",
                                                      layout=EngineLayout.from_dict(layout), ranks=ranks,
                                                      ticket_key=b"k" * 32, cluster_key=None)), None)


def test_the_compatibility_check_stops_at_the_first_difference() -> None:
    """A peer whose model differs is refused for its model, whatever else it claims: nothing about its TP
    (the per-head mapping) is worked out. The largest claim within the bounds costs milliseconds."""
    local = EngineLayout.from_dict(_attention_layout())
    claim = _attention_layout(tp_size=1024, **{"model.num_kv_heads": hs.MAX_KV_HEADS,
                                               "regions": [{"layers": 4, "layer_shape": [None, 64, 16, 128],
                                                            "blocks_axis": 0, "layout": "LBHNC",
                                                            "dtype": "bfloat16"}]})
    remote = _handshake(claim, 1024)
    began = time.perf_counter()
    with pytest.raises(LayoutError) as refused:
        check_compatible(local, "nixl", remote)
    assert time.perf_counter() - began < 0.1
    text = str(refused.value)
    assert "different model facts (num_kv_heads: prefill 65536, decode 8)" in text, text
    assert "tensor parallelism" not in text
    # the same model with TP 2 on LBHNC: read (the per-head mapping), decided in one pass
    same = _attention_layout(tp_size=2, regions=[{"layers": 4, "layer_shape": [None, 4, 16, 128], "blocks_axis": 0,
                                                  "layout": "LBHNC", "dtype": "bfloat16"}])
    check_compatible(local, "nixl", _handshake(same, 2))


def test_each_ranks_metas_must_be_that_ranks() -> None:
    """With several ranks, rank r's metas (its regions' and its lease's) must come from TP rank r's worker:
    one rank's metas listed for two, ranks swapped, a rank's metas from two agents, or metas that name no
    rank are refused as the handshake is parsed."""
    layout = EngineLayout.from_dict(_attention_layout(tp_size=2, regions=[
        {"layers": 4, "layer_shape": [None, 4, 16, 128], "blocks_axis": 0, "layout": "LBHNC", "dtype": "bfloat16"}]))
    names = [hs.rank_agent_name("e1", r, 2) for r in range(2)]
    meta = lambda r: {"m": r, "agent_name": names[r]}  # noqa: E731

    def parsed(ranks: dict) -> Any:
        return parse_handshake(json.loads(build_handshake(engine_id="e1", instance="i1", backend="nixl", layout=layout,
                                                          ranks=ranks, ticket_key=b"k" * 32, cluster_key=None)), None)

    assert parsed({r: {"kv": [meta(r)], "lease": meta(r)} for r in range(2)}).rank_kv_metas[1][0]["m"] == 1
    for ranks, words in (
            ({0: {"kv": [meta(0)], "lease": meta(0)}, 1: {"kv": [meta(0)], "lease": meta(0)}}, "rank 1 of TP 2"),
            ({0: {"kv": [meta(1)], "lease": meta(1)}, 1: {"kv": [meta(0)], "lease": meta(0)}}, "rank 0 of TP 2"),
            ({0: {"kv": [meta(0)], "lease": meta(1)}, 1: {"kv": [meta(1)], "lease": meta(1)}}, "rank 0 of TP 2"),
            ({0: {"kv": [{"m": 0}], "lease": {"l": 0}}, 1: {"kv": [meta(1)], "lease": meta(1)}}, "rank 0 of TP 2"),
            ({0: {"kv": [meta(0)], "lease": meta(0)},
              1: {"kv": [{"m": 1, "agent_name": hs.rank_agent_name("e1", 1, 4)}],
                  "lease": {"agent_name": "x"}}}, "rank 1 of TP 2")):
        with pytest.raises(PeerMetadataError, match=f"handshake {words}: its metas were exported by"):
            parsed(copy.deepcopy(ranks))


def test_each_stage_entrys_metas_must_be_that_stages() -> None:
    """With pipeline stages, rank entry (stage p, TP rank t)'s metas must come from stage p's TP rank t: the
    stage is sealed in the agent name beside the rank (``-pp{p}of{pp}``), so two stages' metas swapped, one
    stage's listed for both, or metas naming no stage (PP 1's names) are refused as the handshake is parsed,
    naming the entry's stage and the exporting agent's. At PP 1 names carry no stage, as before."""
    two = [{"layers": 2, "layer_shape": [None, 8, 16, 128], "blocks_axis": 0, "layout": "LBHNC", "dtype": "bfloat16"}]
    layout = EngineLayout.from_dict(_attention_layout(pp_size=2, regions=two * 2, stages=[[0, 2, 1], [2, 2, 1]]))
    names = [hs.rank_agent_name("e1", 0, 1, p, 2) for p in range(2)]
    assert "-pp1of2-tp0of1-" in names[1] and "-pp" not in hs.rank_agent_name("e1", 0, 1)
    assert hs.agent_stage(names[1]) == (1, 2) and hs.agent_rank(names[1]) == (0, 1)
    assert hs.agent_stage(hs.rank_agent_name("e1", 1, 2)) == (0, 1)
    meta = lambda p: {"m": p, "agent_name": names[p]}  # noqa: E731

    def parsed(ranks: dict) -> Any:
        return parse_handshake(json.loads(build_handshake(engine_id="e1", instance="i1", backend="nixl", layout=layout,
                                                          ranks=ranks, ticket_key=b"k" * 32, cluster_key=None)), None)

    assert parsed({p: {"kv": [meta(p)], "lease": meta(p)} for p in range(2)}).rank_kv_metas[1][0]["m"] == 1
    pp1 = {"m": 0, "agent_name": hs.rank_agent_name("e1", 0, 1)}
    for ranks, words in (
            ({0: {"kv": [meta(1)], "lease": meta(1)}, 1: {"kv": [meta(0)], "lease": meta(0)}},
             "stage 0 of PP 2, rank 0 of TP 1: its metas were exported by agent '.*-pp1of2-tp0of1-.*', of pipeline "
             "stage 1 of 2, not by stage 0's TP rank 0"),
            ({0: {"kv": [meta(0)], "lease": meta(0)}, 1: {"kv": [meta(0)], "lease": meta(0)}},
             "stage 1 of PP 2, rank 0 of TP 1: .*of pipeline stage 0 of 2"),
            ({0: {"kv": [meta(0)], "lease": meta(0)}, 1: {"kv": [meta(1)], "lease": meta(0)}},
             "stage 1 of PP 2, rank 0 of TP 1: its metas were exported by agent\\(s\\)"),
            ({0: {"kv": [pp1], "lease": pp1}, 1: {"kv": [meta(1)], "lease": meta(1)}},
             "stage 0 of PP 2, rank 0 of TP 1: .*of no pipeline stage \\(PP 1\\)"),
            ({0: {"kv": [{"m": 0}], "lease": {"l": 0}}, 1: {"kv": [meta(1)], "lease": meta(1)}},
             "stage 0 of PP 2, rank 0 of TP 1")):
        with pytest.raises(PeerMetadataError, match=f"handshake {words}"):
            parsed(copy.deepcopy(ranks))


def test_the_verdict_on_a_handshake_is_worked_out_off_the_step_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compatibility check and the reads it decides run on the handshake cache's pool once per handshake;
    the engine's step thread (this one) only looks the answer up, for every load through it."""
    threads: list[str] = []
    decide = Receiver._decide_reads

    def recorded(self: Receiver, handshake: Any) -> Any:
        threads.append(threading.current_thread().name)
        return decide(self, handshake)

    monkeypatch.setattr(Receiver, "_decide_reads", recorded)
    with ExitStack() as stack:
        producer = Producer(stack, "ucx", blocks=16)
        decode = Decode(stack, "ucx", blocks=16)
        for i in range(3):
            decode.submit(f"r{i}", producer.ticket([i + 1], f"r{i}"), [i + 4])
        decode.run_until({"r0", "r1", "r2"}, 60)
        assert not decode.failed
    assert len(threads) == 1 and threads[0] != threading.main_thread().name, threads


def _refused_then_genuine(stack: ExitStack, prefill: Prefill, forged: bytes, request: str, tmp_path: Any) -> str:
    """Serve ``forged`` (the handshake of ``prefill``'s real ranks, tampered with), have a decode of TP 1 load
    a request through it (every rank pinned, as for a genuine ticket: only the handshake is forged), check it
    failed and wrote no block, then load through ``prefill``'s genuine handshake, byte-exact. The refusal."""
    src_blocks, dst_blocks = [3, 7, 8], [5, 6, 30]
    listener = HandshakeListener("127.0.0.1", 0, lambda: forged, local_peers_only=True)
    stack.callback(listener.close)
    decode = Rank("decode", "0", "1", prefill.backend, "40")
    stack.callback(decode.close)

    for rank in prefill.ranks:
        rank.send(f"pin {request} 1 1 {','.join(map(str, src_blocks))}")
    params = _ticket(prefill.engine_id, prefill.instance, prefill.backend, listener.port, prefill.key, request,
                     src_blocks, prefill.tp)
    event = submit(decode, request, params, dst_blocks)
    assert event.get("failed") == request, event
    path = tmp_path / "refused.pt"
    decode.send(f"dump {path}")
    assert decode.next(30.0) == {"dumped": str(path)}
    assert torch.count_nonzero(torch.load(path).view(torch.int16)) == 0

    load(decode, "genuine", prefill.export("genuine", src_blocks, slot=2, lease=2), dst_blocks)
    path = tmp_path / "genuine.pt"
    decode.send(f"dump {path}")
    assert decode.next(30.0) == {"dumped": str(path)}
    want = torch.zeros(3, 40, len(heads_of(0, 1)), BLOCK, 32, dtype=torch.bfloat16)
    want[:, dst_blocks] = values(24, heads_of(0, 1))[:, src_blocks]
    assert torch.equal(torch.load(path).view(torch.int16), want.view(torch.int16))
    return event["recent"][0]["failed"]


def test_one_ranks_metas_listed_for_two_ranks_are_refused_and_no_block_is_written(tmp_path) -> None:
    """Real rank processes, TP 2 -> TP 1 over ucx without a key: a handshake listing rank 0's metas for both
    ranks (each of them a real, confirmable meta) used to load, 3 of 3 blocks garbled (rank 0's heads read
    as rank 1's). Now it is refused when parsed and the decode's blocks stay untouched; the genuine
    handshake of the same ranks then loads byte-exact."""
    with ExitStack() as stack:
        prefill = Prefill(stack, 2, "ucx", 24, 3.0)
        layout = EngineLayout.from_dict(prefill.ranks[0].info["layout"])
        rank0 = {"kv": prefill.ranks[0].info["kv"], "lease": prefill.ranks[0].info["lease"]}
        forged = build_handshake(engine_id=prefill.engine_id, instance=prefill.instance, backend="ucx", layout=layout,
                                 ranks={0: rank0, 1: rank0}, ticket_key=prefill.key, cluster_key=None)
        reason = _refused_then_genuine(stack, prefill, forged, "dup", tmp_path)
        assert "handshake rank 1 of TP 2: its metas were exported by" in reason, reason


def test_two_stages_metas_swapped_are_refused_and_no_block_is_written(tmp_path) -> None:
    """Real rank processes, a prefill of PP 3 (one layer each) -> PP 1 over nixl without a key: a handshake
    listing stage 1's metas for stage 0 and stage 0's for stage 1 (real, confirmable metas of the same shape:
    without the stage sealed in them this loaded, layers 0 and 1 swapped) is refused when parsed, naming both
    stages, and the decode's blocks stay untouched; the genuine handshake of the same ranks then loads
    byte-exact."""
    from kvxfer.integrations.vllm.pp_stages import compose_stages

    stages = [(0, 1), (1, 1), (2, 1)]
    with ExitStack() as stack:
        prefill = Prefill(stack, 1, "nixl", 24, 3.0, stages=stages)
        layout = compose_stages({p: EngineLayout.from_dict(prefill.ranks[p].info["layout"]) for p in range(3)},
                                dict(enumerate(stages)))
        entry = [{"kv": rank.info["kv"], "lease": rank.info["lease"]} for rank in prefill.ranks]
        forged = build_handshake(engine_id=prefill.engine_id, instance=prefill.instance, backend="nixl", layout=layout,
                                 ranks={0: entry[1], 1: entry[0], 2: entry[2]}, ticket_key=prefill.key,
                                 cluster_key=None)
        reason = _refused_then_genuine(stack, prefill, forged, "swap", tmp_path)
        assert "handshake stage 0 of PP 3, rank 0 of TP 1: its metas were exported by agent 'vllm-prefill0-" in reason
        assert "-pp1of3-tp0of1-" in reason and "of pipeline stage 1 of 3, not by stage 0's TP rank 0" in reason, reason
