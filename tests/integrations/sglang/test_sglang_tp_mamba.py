"""A Mamba hybrid across attention TP sizes, in real SGLang ranks (sglang 0.5.23, ``.venv-sglang``): prefill TP 1 ->
decode TP 2 and prefill TP 2 -> decode TP 1, ``kvxfer_ucx``.

Two processes (``sglang_peer.py``), the prefill holding a TP-1 instance and both ranks of a TP-2 instance, the
decode both ranks of a TP-2 instance and a TP-1 instance; every manager made by SGLang's own queue with its TP size
and rank stated through SGLang's scoped ``override``, each rank with SGLang's ``HybridReqToTokenPool`` (its
``MambaPool``: per layer a conv and a temporal state, sharded for the rank's TP size by SGLang's
``Mamba2StateShape``; 2 Mamba2 groups, so they shard evenly), so ``KVArgs`` holds the state's sharded axes as
SGLang's ``setup_state_kv_args`` states them. Each prefill rank's KV and state bytes are its own (random, per
rank). Three rooms of 2-3 chunks, each with its Mamba slot sent as SGLang sends ``state_indices`` (the last chunk):
every room ``Success`` on every rank; every head of every page of every layer as the prefill rank holding it has
it (``test_sglang_tp``'s check); and each decode rank's slot of every state tensor equal, byte for byte, to what
SGLang's own byte blocks (``compute_mamba_state_slice_byte_blocks``, by which its nixl backend writes) assemble
from the prefill ranks it is paired with; no other decode slot written; kvxfer's tables empty, no unset ``KVArgs``
field read.
"""

from __future__ import annotations

from sglang_support import Peer, free_port, kvxfer_leftovers, peer_env, rooms_plan
from test_sglang_tp import _head_faults

HEADS = 4  # KV heads in all: 4 on a TP-1 rank, 2 on a TP-2 rank
MAMBA = {"mamba": 8, "mamba_groups": 2, "backend": "kvxfer_ucx"}
SRC_SLOTS, DST_SLOTS = (1, 2, 3), (7, 4, 5)


def _rooms(first: int) -> tuple[list[dict], list[dict]]:
    serve, receive = rooms_plan(first, 3, pages_per_room=5, chunks=[(2, 3), (1, 2, 2)], src_base=3, dst_base=20)
    for i, (s, r) in enumerate(zip(serve, receive)):
        s.update(req_row=i, mamba_slot=SRC_SLOTS[i])
        r.update(req_row=7 - i, mamba_slot=DST_SLOTS[i])
    return serve, receive


def _expected(oracle: Peer, prefills: list[tuple[int, list]], decode: list, tp_p: int, tp_d: int,
              rank_d: int) -> list[list[bytes]]:
    """A decode rank's slot of every state tensor as SGLang's own blocks assemble it from ``prefills``
    (``(prefill rank, its slot)``)."""
    out = []
    for c, comp in enumerate(decode):
        tensors = []
        for j, mine in enumerate(comp):
            got = bytearray(mine["item_len"])
            for rank_p, slot in prefills:
                src = slot[c][j]
                args = {"src_item_len": src["item_len"], "dst_item_len": mine["item_len"], "src_dim": src["dim"],
                        "dst_dim": mine["dim"], "outer_count": src["outer"], "src_attn_tp_size": tp_p,
                        "dst_attn_tp_size": tp_d, "dst_tp_rank_in_group": rank_d, "local_tp_rank_in_group": rank_p,
                        "conv_shard_groups": src["groups"]}
                data = bytes.fromhex(src["hex"])
                for s_off, d_off, n in oracle.ask(op="slice_oracle", args=args)["blocks"]:
                    got[d_off:d_off + n] = data[s_off:s_off + n]
            tensors.append(bytes(got))
        out.append(tensors)
    return out


def _state_faults(case: str, oracle: Peer, serve: list[dict], receive: list[dict], prefill_ranks: list,
                  decode_ranks: list, tp_p: int, tp_d: int) -> list[str]:
    """Each decode rank's state slot of each room against SGLang's blocks from its paired prefill ranks."""
    faults = []
    for s, r in zip(serve, receive):
        slots_p = [(rank, peer.ask(op="state_slot", slot=s["mamba_slot"], **which)["state"])
                   for rank, (peer, which) in enumerate(prefill_ranks)]
        for rank_d, (peer, which) in enumerate(decode_ranks):
            mine = peer.ask(op="state_slot", slot=r["mamba_slot"], **which)["state"]
            paired = ([slots_p[rank_d // (tp_d // tp_p)]] if tp_d >= tp_p else
                      slots_p[rank_d * (tp_p // tp_d):(rank_d + 1) * (tp_p // tp_d)])
            want = _expected(oracle, paired, mine, tp_p, tp_d, rank_d)
            for c, comp in enumerate(mine):
                for j, tensor in enumerate(comp):
                    if bytes.fromhex(tensor["hex"]) != want[c][j]:
                        faults.append(f"{case} room {s['room']} decode rank {rank_d}: state {c} tensor {j} is not "
                                      f"what SGLang's blocks give from prefill ranks {[p for p, _ in paired]}")
            if not any(int(ch, 16) for comp in mine for t in comp for ch in t["hex"][:64]):
                faults.append(f"{case} room {s['room']} decode rank {rank_d}: state slot still zero")
    return faults


def test_mamba_state_across_attention_tp_both_ways_byte_exact():
    env = peer_env(KVXFER_TRANSFER_TIMEOUT_S="15")
    p1, p2 = free_port(), free_port()
    prefill = Peer("prefill", "kvxfer_ucx", p1, env=env, heads=HEADS, mamba=8, mamba_groups=2, seed=5,
                   b0={**MAMBA, "bootstrap_port": p2, "attn_tp_size": 2, "attn_tp_rank": 0, "heads": 2, "seed": 6},
                   b1={**MAMBA, "bootstrap_port": p2, "attn_tp_size": 2, "attn_tp_rank": 1, "heads": 2, "seed": 6})
    decode = Peer("decode", "kvxfer_ucx", p1, env=env, heads=2, mamba=8, mamba_groups=2, attn_tp_size=2,
                  attn_tp_rank=0, d1={**MAMBA, "attn_tp_size": 2, "attn_tp_rank": 1, "heads": 2},
                  one={**MAMBA, "attn_tp_size": 1, "heads": HEADS})
    faults = []
    try:
        prefill.ready(), decode.ready()
        # TP 1 -> 2: the TP-1 prefill rank serves each room to both decode ranks
        serve, receive = _rooms(100)
        prefill.send(op="serve", rooms=serve, timeout=60, per_head=True)
        got = decode.ask(timeout_s=150, op="together", ops=[
            {"op": "receive", "bootstrap": f"127.0.0.1:{p1}", "rooms": receive, "timeout": 60, "per_head": True},
            {"op": "receive", "manager": "d1", "bootstrap": f"127.0.0.1:{p1}", "rooms": receive, "timeout": 60,
             "per_head": True}])["replies"]
        served = prefill.read(timeout_s=150)
        for rank, reply in enumerate(got):
            assert "error" not in reply, reply
            faults += _head_faults("1->2", serve, [served], reply, rank)
            assert reply["state_written_slots"] == sorted(DST_SLOTS), reply["state_written_slots"]
        faults += _state_faults("1->2", decode, serve, receive, [(prefill, {})],
                                [(decode, {}), (decode, {"manager": "d1"})], 1, 2)

        # TP 2 -> 1: the TP-1 decode rank reads each room from both prefill ranks, its state from both
        serve, receive = _rooms(200)
        prefill.send(op="together", ops=[{"op": "serve", "manager": m, "rooms": serve, "timeout": 60,
                                          "per_head": True} for m in ("b0", "b1")])
        one = decode.ask(timeout_s=150, op="receive", manager="one", bootstrap=f"127.0.0.1:{p2}", rooms=receive,
                         timeout=60, per_head=True)
        both = prefill.read(timeout_s=150)["replies"]
        assert all("error" not in r for r in both), both
        faults += _head_faults("2->1", serve, both, one, 0)
        assert one["state_written_slots"] == sorted(DST_SLOTS), one["state_written_slots"]
        faults += _state_faults("2->1", decode, serve, receive, [(prefill, {"manager": "b0"}),
                                                                 (prefill, {"manager": "b1"})],
                                [(decode, {"manager": "one"})], 2, 1)
        faults += kvxfer_leftovers([(prefill, "main"), (prefill, "b0"), (prefill, "b1"), (decode, "main"),
                                    (decode, "d1"), (decode, "one")], (prefill, decode))
    finally:
        logs = "".join(f"\n--- {p.role}'s log:\n{p.log()}" for p in (prefill, decode))
        for peer in (prefill, decode):
            peer.close()
    assert not faults, "\n".join(faults[:20]) + logs
