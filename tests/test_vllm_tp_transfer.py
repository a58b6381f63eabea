"""Different TP, moved for real: the connector's worker halves (``Sender``, ``Receiver``) in one
process per TP rank, two prefill ranks feeding one decode rank and one feeding two.

Each decode rank must hold exactly its heads of the prefill's blocks, byte for byte what vLLM's
own LBHNC layout holds on that rank, and nothing else; each prefill rank frees a request only
once every decode rank that reads it is done, and a reader that never comes costs only
``pin_grace_s``.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack

import pytest
import torch

from tests.vllm_tp_ranks import BLOCK, Rank, heads_of, values

BACKEND = "nixl"
PREFILL_BLOCKS, DECODE_BLOCKS = 24, 40  # pools sized differently, as vLLM's profiling does
GRACE_S = 3.0


class Prefill:
    """``tp`` prefill rank processes and the handshake their scheduler would serve."""

    def __init__(self, stack: ExitStack, tp: int) -> None:
        from kvxfer.integrations.vllm.handshake import EngineLayout, build_handshake
        from kvxfer.integrations.vllm.side_channel import HandshakeListener

        self.ranks = [Rank("prefill", str(r), str(tp), BACKEND, str(PREFILL_BLOCKS), str(GRACE_S)) for r in range(tp)]
        for rank in self.ranks:
            stack.callback(rank.close)
        self.engine_id, self.instance, self.key = f"eng-{os.urandom(4).hex()}", os.urandom(8).hex(), os.urandom(32)
        document = build_handshake(engine_id=self.engine_id, instance=self.instance, backend=BACKEND,
                                   layout=EngineLayout.from_dict(self.ranks[0].info["layout"]),
                                   ranks={r: {"kv": p.info["kv"], "lease": p.info["lease"]}
                                          for r, p in enumerate(self.ranks)},
                                   ticket_key=self.key, cluster_key=None)
        self.listener = HandshakeListener("127.0.0.1", 0, lambda: document, local_peers_only=True)
        stack.callback(self.listener.close)
        self.tp = tp

    def export(self, request_id: str, blocks: list[int], slot: int, lease: int) -> dict:
        """What the producer's scheduler and workers do when a request finishes: pin on every rank, sign a ticket."""
        from kvxfer.integrations.vllm.tickets import sign_ticket

        for rank in self.ranks:
            rank.send(f"pin {request_id} {slot} {lease} {','.join(map(str, blocks))}")
        params = dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=[list(blocks)],
                      remote_engine_id=self.engine_id, remote_request_id=request_id, remote_host="127.0.0.1",
                      remote_port=self.listener.port, tp_size=self.tp, remote_num_tokens=len(blocks) * BLOCK,
                      transfer_mode="pull")
        return sign_ticket(params, {"instance": self.instance, "slot": slot, "lease": lease, "backend": BACKEND,
                                    "prompt": "0" * 64}, self.key)


def load(decode: Rank, request_id: str, params: dict, blocks: list[int]) -> dict:
    decode.send(f"load {request_id} {json.dumps(params, separators=(',', ':'))} {','.join(map(str, blocks))}")
    event = decode.next(60.0)
    assert event.get("finished") == request_id, event
    return event


def released(rank: Rank, timeout_s: float) -> dict | None:
    try:
        return rank.next(timeout_s)
    except AssertionError:
        return None


def expected(rank: int, tp: int, src_blocks: list[int], dst_blocks: list[int]) -> torch.Tensor:
    """What vLLM's LBHNC pool holds on decode rank ``rank`` of ``tp`` once the blocks arrived."""
    out = torch.zeros(3, DECODE_BLOCKS, len(heads_of(rank, tp)), BLOCK, 32, dtype=torch.bfloat16)
    out[:, dst_blocks] = values(PREFILL_BLOCKS, heads_of(rank, tp))[:, src_blocks]
    return out


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2)])
def test_each_decode_rank_gets_its_heads_and_the_prefill_waits_for_every_reader(src_tp, dst_tp, tmp_path):
    src_blocks, dst_blocks = [3, 7, 8, 20, 0], [5, 6, 30, 1, 39]
    with ExitStack() as stack:
        prefill = Prefill(stack, src_tp)
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
