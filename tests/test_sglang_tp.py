"""Different attention TP between an SGLang prefill and decode, in real SGLang ranks (sglang 0.5.23,
``.venv-sglang``): prefill TP 1 -> decode TP 2 and TP 2 -> TP 1, MHA/GQA and MLA, each decode rank byte-exact
against what SGLang's layout holds on that rank.

Four processes (``sglang_peer.py``), each manager made by SGLang's own ``PrefillBootstrapQueue`` /
``DecodePreallocQueue`` with its attention-TP size and rank stated through SGLang's scoped ``override`` (no
process group of that size: a manager never uses one), senders from ``create_sender``, receivers from
``_create_receiver_and_enqueue``, pairings, ``required_dst_info_num`` and bootstrap infos from SGLang's
``CommonKVReceiver``:

* prefill A: TP-1 instances (MHA on ``kvxfer_ucx``, MLA on ``kvxfer_nixl``) and rank 0 of the TP-2 instances
  of each (rank 0 runs each TP-2 instance's bootstrap server);
* prefill B: rank 1 of the TP-2 instances (it registers with A's servers);
* decode A: rank 0 of the TP-2 decodes, and the TP-1 decodes;
* decode B: rank 1 of the TP-2 decodes.

An MHA pool holds 4 KV heads on a TP-1 rank and 2 on a TP-2 rank (SGLang's ``MHATokenToKVPool``: per layer
``[tokens, heads, head_dim]``, so a rank's heads are strided within a page); each rank's pool is random bytes
of its own (its heads), the aux rows the same on every rank of an instance. Per page and head the digests are
compared: a TP-2 decode rank ``d`` must hold the TP-1 prefill's heads ``2d, 2d+1``; the TP-1 decode heads
``0, 1`` of prefill rank 0 and ``2, 3`` of rank 1. An MLA page (one latent copy per rank) must equal the page
of the prefill rank SGLang pairs the decode with (for TP 2 -> 1, rank 0; rank 1 is SGLang's dummy pairing and
concludes without a read). Every room ``Success`` on every rank, kvxfer's tables empty after, no ``KVArgs``
field read that SGLang left unset; the descriptors each decode rank posted per room are printed (docs/sglang.md).

No control: SGLang's own ``nixl`` refuses different TP into host memory (its prefill's bootstrap thread raises
"NIXL heterogeneous-TP direct-to-host KV transfer is not implemented safely yet" when the decode registers, and
every room waits in ``Bootstrapping``), and its KV must be declared host memory here (``sglang_peer``); SGLang's
``mooncake`` is not installed by the suite. The reference is SGLang's layout itself: the heads each rank holds.
"""

from __future__ import annotations

import time

from sglang_support import Peer, free_port, peer_env, rooms_plan

SUCCESS = 4
#: The pools here (``sglang_support.POOL`` otherwise): 3 layers, page 4, head_dim 16; 4 KV heads in all.
HEADS = 4
MHA = ("u1", "u2")  # kvxfer_ucx MHA instances, TP 1 and TP 2
INSTANCES = {  # name: (backend, attention TP, mla)
    "u1": ("kvxfer_ucx", 1, False), "u2": ("kvxfer_ucx", 2, False),
    "m1": ("kvxfer_nixl", 1, True), "m2": ("kvxfer_nixl", 2, True),
}


def _cfg(name: str, rank: int, ports: dict[str, int]) -> dict:
    backend, tp, mla = INSTANCES[name]
    return {"backend": backend, "bootstrap_port": ports[name], "attn_tp_size": tp, "attn_tp_rank": rank,
            "heads": HEADS // tp, "mla": mla, "seed": 100 + list(INSTANCES).index(name)}


def _rank_peer(role: str, main: str, rank: int, further: dict[str, int], ports: dict[str, int], env,
               **modes: dict) -> Peer:
    cfg = _cfg(main, rank, ports)
    extra = {name: _cfg(name, r, ports) for name, r in further.items()}
    return Peer(role, cfg.pop("backend"), cfg.pop("bootstrap_port"), env=env, **cfg, **extra, **modes)


#: SGLang's modes kvxfer refuses when its manager is made (item 5 of issue 38), each a manager config: on the
#: decode, ``SGLANG_DISAGG_STAGING_BUFFER=1`` and ``--disaggregation-decode-host-receive-threshold 0.5`` (kvxfer's,
#: and SGLang's own nixl for comparison); on the prefill, the staging buffer.
DECODE_MODES = {
    "staging": {"backend": "kvxfer_ucx", "env": {"SGLANG_DISAGG_STAGING_BUFFER": "1"}},
    "host": {"backend": "kvxfer_ucx", "host_receive_threshold": 0.5},
    "host_nixl": {"backend": "nixl", "host_receive_threshold": 0.5},
}
PREFILL_MODES = {"staging_p": {"backend": "kvxfer_nixl", "env": {"SGLANG_DISAGG_STAGING_BUFFER": "1"}}}


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


def _head_faults(case: str, serve: list[dict], prefills: list[dict], decode: dict, heads_of) -> list[str]:
    """Each decode page's heads against the prefill rank's heads they must be (``heads_of(j)``: decode head
    ``j`` is head ``h`` of ``prefills[p]``, as ``(p, h)``), and each room Success on every rank."""
    faults, rooms = _ended(case, serve, prefills, decode)
    for key in rooms:
        for buf, pages in enumerate(decode["digests"][key]["heads"]):
            for page, heads in enumerate(pages):
                for j, digest in enumerate(heads):
                    p, h = heads_of(j)
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


def test_different_attention_tp_both_ways_mha_and_mla():
    env = peer_env(KVXFER_TRANSFER_TIMEOUT_S="15")
    ports = {name: free_port() for name in INSTANCES}
    one = [n for n, (_, tp, _) in INSTANCES.items() if tp == 1]
    two = [n for n, (_, tp, _) in INSTANCES.items() if tp == 2]
    # prefill A holds the TP-1 instances and rank 0 of the TP-2 ones; its main manager is "u1"
    prefill_a = _rank_peer("prefill", "u1", 0, {n: 0 for n in one[1:] + two}, ports, env,
                           **{k: {**v, "attn_tp_size": 1, "bootstrap_port": free_port()} for k, v in PREFILL_MODES.items()})
    prefill_b = _rank_peer("prefill", "u2", 1, {n: 1 for n in two[1:]}, ports, env)
    decode_a = _rank_peer("decode", "u2", 0, {**{n: 0 for n in two[1:]}, **{n: 0 for n in one}}, ports, env,
                          **{k: {**v, "attn_tp_size": 1, "heads": HEADS} for k, v in DECODE_MODES.items()})
    decode_b = _rank_peer("decode", "u2", 1, {n: 1 for n in two[1:]}, ports, env)
    peers = (prefill_a, prefill_b, decode_a, decode_b)
    faults, figures = [], {}
    began = time.monotonic()
    try:
        prefill_a.ready(), decode_a.ready(), decode_b.ready()
        for name in two:  # rank 0 runs each TP-2 instance's bootstrap server: rank 1 registers with it after
            prefill_a.ask(op="build", manager=name)
        prefill_b.ready()
        for name in two[1:]:
            prefill_b.ask(op="build", manager=name)
        ready_s = time.monotonic() - began

        def which(peer: Peer, name: str) -> dict:  # the manager of instance ``name`` on a rank's process
            main = {prefill_a: "u1", prefill_b: "u2", decode_a: "u2", decode_b: "u2"}[peer]
            return {} if name == main else {"manager": name}

        def exchange(name_p: str, prefills: list[Peer], name_d: str, decodes: list[Peer], serve, receive):
            for peer in prefills:
                peer.send(op="serve", rooms=serve, timeout=60, per_head=True, **which(peer, name_p))
            for peer in decodes:
                peer.send(op="receive", bootstrap=f"127.0.0.1:{ports[name_p]}", rooms=receive, timeout=60,
                          per_head=True, **which(peer, name_d))
            return [p.read() for p in prefills], [d.read() for d in decodes]

        def descriptors(peer: Peer, name: str) -> int:
            return peer.ask(op="sizes", **which(peer, name))["counters"]["descriptors"]

        serve, receive = rooms_plan(100, 3, pages_per_room=6, chunks=[(2, 4), (1, 2, 3)], src_base=3, dst_base=40)
        rooms = len(serve)
        # MHA, TP 1 -> 2: both decode ranks read other heads of the same prefill pages
        before = [descriptors(d, "u2") for d in (decode_a, decode_b)]
        served, got = exchange("u1", [prefill_a], "u2", [decode_a, decode_b], serve, receive)
        for d, decode in enumerate(got):
            faults += _head_faults(f"MHA 1->2 decode rank {d}", serve, served, decode, lambda j, d=d: (0, 2 * d + j))
        figures["MHA 1->2"] = [(descriptors(p, "u2") - b) / rooms for p, b in zip((decode_a, decode_b), before)]

        # MHA, TP 2 -> 1: one decode rank reads heads 0-1 from prefill rank 0 and 2-3 from rank 1
        before = descriptors(decode_a, "u1")
        served, got = exchange("u2", [prefill_a, prefill_b], "u1", [decode_a], serve, receive)
        faults += _head_faults("MHA 2->1", serve, served, got[0], lambda j: (j // 2, j % 2))
        figures["MHA 2->1"] = [(descriptors(decode_a, "u1") - before) / rooms]

        # the same rooms at the same TP (whole pages: what a staging read of the source's pages would post)
        before = descriptors(decode_a, "u1")
        served, got = exchange("u1", [prefill_a], "u1", [decode_a], serve, receive)
        faults += _head_faults("MHA 1->1", serve, served, got[0], lambda j: (0, j))
        figures["MHA 1->1 (whole pages)"] = [(descriptors(decode_a, "u1") - before) / rooms]

        # MLA: one latent copy per rank, whole pages, any TP; 2 -> 1 reads rank 0, rank 1 is SGLang's dummy
        served, got = exchange("m1", [prefill_a], "m2", [decode_a, decode_b], serve, receive)
        for d, decode in enumerate(got):
            faults += _page_faults(f"MLA 1->2 decode rank {d}", serve, served, decode, 0)
        served, got = exchange("m2", [prefill_a, prefill_b], "m1", [decode_a], serve, receive)
        faults += _page_faults("MLA 2->1", serve, served, got[0], 0)
        cases_s = time.monotonic() - began - ready_s

        # SGLang's modes kvxfer refuses, through SGLang's own queue constructors: the refusal comes from kvxfer's
        # manager, made by the queue's _init_kv_manager, naming the flag
        refusals = {name: decode_a.ask(op="try_build", manager=name) for name in DECODE_MODES}
        refusals.update({name: prefill_a.ask(op="try_build", manager=name) for name in PREFILL_MODES})
        for name, flag in (("staging", "SGLANG_DISAGG_STAGING_BUFFER"), ("staging_p", "SGLANG_DISAGG_STAGING_BUFFER"),
                           ("host", "--disaggregation-decode-host-receive-threshold")):
            got = refusals[name]
            if not (got["refused"] and flag in got["refused"] and "sglang/conn.py:__init__" in got["path"]
                    and any(f.endswith(":_init_kv_manager") for f in got["path"])):
                faults.append(f"{name}: not refused by kvxfer's manager in SGLang's _init_kv_manager naming {flag}: "
                              f"{got}")
        if "does not support decode host KV destinations" not in (refusals["host_nixl"]["refused"] or ""):
            faults.append(f"SGLang's own nixl accepted a host destination: {refusals['host_nixl']}")

        for peer in peers:  # kvxfer's tables empty on every kvxfer manager; no unset KVArgs field read by kvxfer
            for name in INSTANCES:
                if peer in (prefill_a, decode_a) or name in two:
                    sizes = peer.ask(op="sizes", settle_s=0.3 if peer.role == "prefill" else 0.0,
                                     **which(peer, name))["sizes"]
                    if any(sizes.values()):
                        faults.append(f"{peer.role} {name}: kvxfer's tables not empty: {sizes}")
            reads = peer.ask(op="unset_reads")["unset_reads"]
            faults += [f"{peer.role}: kvxfer read KVArgs.{r[0]}, unset by SGLang" for r in reads
                       if r[1].startswith("kvxfer")]
    finally:
        logs = "".join(f"\n--- {p.role} {p.info.get('endpoint')}:\n{p.log()}" for p in peers)
        for peer in peers:
            peer.close()
    print(f"different TP: ranks ready in {ready_s:.1f}s, the cases {cases_s:.1f}s; descriptors per room per "
          f"decode rank: {figures}; refused modes: " + "; ".join(f"{k}: {v['refused']}" for k, v in refusals.items()))
    assert not faults, f"{faults}{logs}"
