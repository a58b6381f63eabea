"""Different attention TP between an SGLang prefill and decode, in real SGLang ranks (sglang 0.5.23,
``.venv-sglang``): prefill TP 1 -> decode TP 2, 2 -> 1, 2 -> 4 and 4 -> 2 for MHA/GQA, 1 -> 2 and 2 -> 1 for MLA,
each decode rank byte-exact against what SGLang's layout holds on that rank.

Four processes (``sglang_peer.py``), two per role, each holding ranks of several instances: every manager made
by SGLang's own ``PrefillBootstrapQueue`` / ``DecodePreallocQueue`` with its attention-TP size and rank stated
through SGLang's scoped ``override`` (no process group of that size: a manager never uses one), senders from
``create_sender``, receivers from ``_create_receiver_and_enqueue``, the pairings, ``required_dst_info_num`` and
bootstrap infos SGLang's ``CommonKVReceiver``'s. Rank 0 of each prefill instance runs its bootstrap server; the
other ranks register with it, from the same process or the other one. Ranks of one instance in one process
run their command at once (``together``: one thread each), as separate schedulers would.

The MHA instances (``kvxfer_ucx``) hold 4 KV heads in all, ``4 / TP`` per rank (SGLang's ``MHATokenToKVPool``:
per layer ``[tokens, heads, head_dim]``, so a rank's heads are strided within a page); each rank's pool is
random bytes of its own, the aux rows the same on every rank of an instance. Per page and head the digests are
compared: decode rank ``d`` of TP ``D`` must hold global heads ``d*4/D ...``, each the head of the prefill rank
that holds it. An MLA page (``kvxfer_nixl``; one latent copy per rank) must equal the page of the prefill rank
SGLang pairs the decode with (TP 2 -> 1: rank 0; rank 1 is SGLang's dummy pairing and concludes without a
read). Every room ``Success`` on every rank, kvxfer's tables empty after, no ``KVArgs`` field read that SGLang
left unset; the descriptors each decode rank posted per room are printed (docs/sglang.md). Then SGLang's modes
that kvxfer refuses, through SGLang's own queue constructors.

No control: SGLang's own ``nixl`` refuses different TP into host memory (its prefill's bootstrap thread raises
"NIXL heterogeneous-TP direct-to-host KV transfer is not implemented safely yet" when the decode registers, and
every room waits in ``Bootstrapping``), and its KV must be declared host memory here (``kvxfer.drive.sglang_build``); SGLang's
``mooncake`` is not installed by the suite. The reference is SGLang's layout itself: the heads each rank holds.
"""

from __future__ import annotations

import time

from sglang_support import Peer, free_port, kvxfer_leftovers, peer_env, rooms_plan

SUCCESS = 4
#: The pools here (``sglang_support.POOL`` otherwise): 3 layers, page 4, head_dim 16; 4 KV heads in all.
HEADS = 4
INSTANCES = {  # name: (backend, attention TP, mla)
    "u1": ("kvxfer_ucx", 1, False), "u2": ("kvxfer_ucx", 2, False), "u4": ("kvxfer_ucx", 4, False),
    "m1": ("kvxfer_nixl", 1, True), "m2": ("kvxfer_nixl", 2, True),
}
#: Where each instance's ranks live, per role: ``(process, manager name)`` in rank order (process 0 or 1).
PREFILL_RANKS = {"u1": [(0, "main")], "u2": [(0, "u2"), (1, "main")],
                 "u4": [(0, "u4.0"), (0, "u4.1"), (1, "u4.2"), (1, "u4.3")],
                 "m1": [(0, "m1")], "m2": [(0, "m2"), (1, "m2")]}
DECODE_RANKS = {"u1": [(0, "u1")], "u2": [(0, "main"), (1, "main")],
                "u4": [(0, "u4.0"), (0, "u4.1"), (1, "u4.2"), (1, "u4.3")],
                "m1": [(0, "m1")], "m2": [(0, "m2"), (1, "m2")]}
#: SGLang's modes kvxfer refuses when its manager is made (item 5 of issue 38), each a manager config: on the
#: decode, ``SGLANG_DISAGG_STAGING_BUFFER=1`` and ``--disaggregation-decode-host-receive-threshold 0.5`` (kvxfer's,
#: and SGLang's own nixl for comparison); on the prefill, the staging buffer.
DECODE_MODES = {
    "staging": {"backend": "kvxfer_ucx", "env": {"SGLANG_DISAGG_STAGING_BUFFER": "1"}},
    "host": {"backend": "kvxfer_ucx", "host_receive_threshold": 0.5},
    "host_nixl": {"backend": "nixl", "host_receive_threshold": 0.5},
}
PREFILL_MODES = {"staging_p": {"backend": "kvxfer_nixl", "env": {"SGLANG_DISAGG_STAGING_BUFFER": "1"}}}


def _cfg(name: str, rank: int, ports: dict[str, int]) -> dict:
    backend, tp, mla = INSTANCES[name]
    return {"backend": backend, "bootstrap_port": ports[name], "attn_tp_size": tp, "attn_tp_rank": rank,
            "heads": HEADS // tp, "mla": mla, "seed": 100 + list(INSTANCES).index(name)}


def _processes(role: str, placement: dict, ports: dict[str, int], env, modes: dict) -> list[Peer]:
    """The role's two processes, each with its main manager and the further ones ``placement`` puts there."""
    peers = []
    for proc in (0, 1):
        managers = {name: _cfg(inst, rank, ports) for inst, where in placement.items()
                    for rank, (p, name) in enumerate(where) if p == proc}
        main = managers.pop("main")
        extra = modes if proc == 0 else {}
        peers.append(Peer(role, main.pop("backend"), main.pop("bootstrap_port"), env=env, **main, **managers, **extra))
    return peers


def _ended(case: str, serve: list[dict], prefills: list[dict], decode: dict) -> tuple[list[str], list[str]]:
    """(faults, rooms): a fault for each room not ``Success`` on every rank, and the rooms that are."""
    faults, rooms = [], []
    for r in serve:
        key = str(r["room"])
        if any(p["rooms"][key]["status"] != SUCCESS for p in prefills) or decode["rooms"][key]["status"] != SUCCESS:
            faults.append(f"{case} room {key}: prefill {[p['rooms'][key] for p in prefills]}, decode "
                          f"{decode['rooms'][key]}")
        else:
            rooms.append(key)
    return faults, rooms


def _head_faults(case: str, serve: list[dict], prefills: list[dict], decode: dict, rank: int) -> list[str]:
    """Decode rank ``rank``'s heads (of ``HEADS / its TP``) in every page against the prefill rank's head each
    must be (global head ``g`` on prefill rank ``g // per_rank``), the aux row, and every room Success."""
    faults, rooms = _ended(case, serve, prefills, decode)
    src_heads = HEADS // len(prefills)
    for key in rooms:
        for buf, pages in enumerate(decode["digests"][key]["heads"]):
            for page, heads in enumerate(pages):
                for j, digest in enumerate(heads):
                    g = rank * len(heads) + j
                    p, h = g // src_heads, g % src_heads
                    if prefills[p]["digests"][key]["heads"][buf][page][h] != digest:
                        faults.append(f"{case} room {key} buffer {buf} page {page}: head {j} is not prefill rank "
                                      f"{p}'s head {h}")
        if decode["digests"][key]["aux"] != prefills[0]["digests"][key]["aux"]:
            faults.append(f"{case} room {key}: aux rows differ")
    return faults


def _page_faults(case: str, serve: list[dict], prefills: list[dict], decode: dict, source: int) -> list[str]:
    """Each decode page and aux row against those of ``prefills[source]``, and each room Success on every rank."""
    faults, rooms = _ended(case, serve, prefills, decode)
    for key in rooms:
        mine, theirs = decode["digests"][key], prefills[source]["digests"][key]
        if mine["pages"] != theirs["pages"] or mine["aux"] != theirs["aux"]:
            faults.append(f"{case} room {key}: pages or aux rows differ from prefill rank {source}'s")
    return faults


def _which(name: str) -> dict:
    return {} if name == "main" else {"manager": name}


def test_different_attention_tp_both_ways_mha_and_mla():
    env = peer_env(KVXFER_TRANSFER_TIMEOUT_S="15")
    ports = {name: free_port() for name in INSTANCES}
    prefills = _processes("prefill", PREFILL_RANKS, ports, env,
                          {k: {**v, "attn_tp_size": 1, "bootstrap_port": free_port()} for k, v in PREFILL_MODES.items()})
    decodes = _processes("decode", DECODE_RANKS, ports, env,
                         {k: {**v, "attn_tp_size": 1, "heads": HEADS} for k, v in DECODE_MODES.items()})
    peers = (*prefills, *decodes)
    faults, figures, refusals = [], {}, {}
    began = time.monotonic()
    try:
        prefills[0].ready(), decodes[0].ready(), decodes[1].ready()
        # rank 0 of each prefill instance runs its bootstrap server: the ranks in the other process register after
        for inst, where in PREFILL_RANKS.items():
            for proc, name in where:
                if proc == 0 and name != "main":
                    prefills[0].ask(op="build", manager=name)
        prefills[1].ready()
        for inst, where in PREFILL_RANKS.items():
            for proc, name in where:
                if proc == 1 and name != "main":
                    prefills[1].ask(op="build", manager=name)
        ready_s = time.monotonic() - began
        serve, receive = rooms_plan(100, 3, pages_per_room=6, chunks=[(2, 4), (1, 2, 3)], src_base=3, dst_base=40)

        for src, dst in (("u1", "u2"), ("u2", "u1"), ("u1", "u1"), ("u2", "u4"), ("u4", "u2")):
            served, got = _exchange(prefills, decodes, ports, src, dst, serve, receive)
            case = f"MHA TP {INSTANCES[src][1]} -> {INSTANCES[dst][1]}"
            for rank, decode in enumerate(got):
                faults += _head_faults(f"{case} decode rank {rank}", serve, served, decode, rank)
            figures[case] = [reply["descriptors"] / len(serve) for reply in got]
        for src, dst in (("m1", "m2"), ("m2", "m1")):
            served, got = _exchange(prefills, decodes, ports, src, dst, serve, receive)
            tp_p, tp_d = INSTANCES[src][1], INSTANCES[dst][1]
            for rank, decode in enumerate(got):  # SGLang's pairing: the first (real) target rank
                source = rank // (tp_d // tp_p) if tp_d >= tp_p else rank * (tp_p // tp_d)
                faults += _page_faults(f"MLA TP {tp_p} -> {tp_d} decode rank {rank}", serve, served, decode, source)
        cases_s = time.monotonic() - began - ready_s

        # SGLang's modes kvxfer refuses, through SGLang's own queue constructors: the refusal comes from kvxfer's
        # manager, made by the queue's _init_kv_manager, naming the flag
        refusals = {name: decodes[0].ask(op="try_build", manager=name) for name in DECODE_MODES}
        refusals.update({name: prefills[0].ask(op="try_build", manager=name) for name in PREFILL_MODES})
        for name, flag in (("staging", "SGLANG_DISAGG_STAGING_BUFFER"), ("staging_p", "SGLANG_DISAGG_STAGING_BUFFER"),
                           ("host", "--disaggregation-decode-host-receive-threshold")):
            got = refusals[name]
            if not (got["refused"] and flag in got["refused"] and "sglang/conn.py:__init__" in got["path"]
                    and any(f.endswith(":_init_kv_manager") for f in got["path"])):
                faults.append(f"{name}: not refused by kvxfer's manager in SGLang's _init_kv_manager naming {flag}: "
                              f"{got}")
        if "does not support decode host KV destinations" not in (refusals["host_nixl"]["refused"] or ""):
            faults.append(f"SGLang's own nixl accepted a host destination: {refusals['host_nixl']}")

        faults += kvxfer_leftovers([(procs[p], name) for procs, placement in ((prefills, PREFILL_RANKS),
                                                                             (decodes, DECODE_RANKS))
                                    for where in placement.values() for p, name in where], peers)
    finally:
        logs = "".join(f"\n--- {p.role} {p.info.get('endpoint')}:\n{p.log()}" for p in peers)
        for peer in peers:
            peer.close()
    print(f"different TP: ranks ready in {ready_s:.1f}s, the cases {cases_s:.1f}s; descriptors per room per "
          f"decode rank: {figures}; refused modes: " + "; ".join(f"{k}: {v['refused']}" for k, v in refusals.items()))
    assert not faults, f"{faults}{logs}"


def _exchange(prefills: list[Peer], decodes: list[Peer], ports: dict[str, int], src: str, dst: str, serve: list,
              receive: list) -> tuple[list[dict], list[dict]]:
    """The rooms served by every rank of prefill instance ``src`` and received by every rank of decode instance
    ``dst``, all at once; the replies in rank order."""
    def commands(placement: dict, inst: str, cmd: dict) -> dict[int, list[dict]]:
        out: dict[int, list[dict]] = {}
        for p, name in placement[inst]:
            out.setdefault(p, []).append({**cmd, **_which(name)})
        return out

    sides = [(prefills, commands(PREFILL_RANKS, src, {"op": "serve", "rooms": serve, "timeout": 60,
                                                      "per_head": True})),
             (decodes, commands(DECODE_RANKS, dst, {"op": "receive", "bootstrap": f"127.0.0.1:{ports[src]}",
                                                    "rooms": receive, "timeout": 60, "per_head": True}))]
    for procs, by_proc in sides:
        for p, cmds in by_proc.items():
            procs[p].send(op="together", ops=cmds)
    replies = []
    for procs, by_proc in sides:
        mine = []
        for p, cmds in by_proc.items():
            for cmd, reply in zip(cmds, procs[p].read()["replies"]):
                if "error" in reply:
                    raise AssertionError(f"{procs[p].role} {cmd.get('manager', 'main')}: {reply['error']}\n"
                                         f"{reply.get('traceback')}\n{procs[p].log()}")
                mine.append(reply)
        replies.append(mine)  # processes in order, each's ranks in order: rank order (placements are so)
    return replies[0], replies[1]

