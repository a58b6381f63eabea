"""Pipeline parallelism on the SGLang prefill, in real SGLang ranks (sglang 0.5.23, ``.venv-sglang``): a prefill of
PP 2 into a decode of PP 1, each decode layer read from the stage that holds it, byte-exact per layer.

Two processes (``sglang_peer.py``): the prefill holds both stages of each instance (two ranks of one instance in
one process, as ``test_sglang_tp.py`` holds TP ranks), the decode one rank per instance. Every manager is made by
SGLang's own ``PrefillBootstrapQueue`` / ``DecodePreallocQueue`` with its PP size and rank stated through SGLang's
scoped ``override``; each stage's pool is SGLang's, holding the stage's layers of a 5-layer model as SGLang's
``get_pp_indices`` splits them (2 and 3: an uneven split) with the first and end layer SGLang's model runner gives
it, so ``KVArgs.prefill_start_layer`` / ``prefill_end_layer`` are what SGLang's ``_init_kv_manager`` sets. Both
stages register with the instance's bootstrap server (stage 0 runs it); SGLang's ``PPConsensusStore`` is made on
each stage (its group a stand-in carrying ``broadcast_object`` only: ``kvxfer.drive.sglang_build.StagePPGroup``); the decode's
bootstrap infos, ``target_pp_ranks`` and ``required_prefill_response_num`` are SGLang's ``CommonKVReceiver``'s.
Senders from ``create_sender`` (each stage serving the room from its own pool), receivers from
``_create_receiver_and_enqueue``; both stages' ``serve`` run at once, one thread each, as two schedulers would.

Per instance, four rooms in flight of two and three chunks: MHA/GQA on ``kvxfer_ucx``, MLA on ``kvxfer_nixl``. Every
page of every decode layer (K and V, or the latent) is compared by digest with the page of that layer on the stage
that holds it; every room ``Success`` on both stages and on the decode. The aux row: the two stages hold different
rows (a test device: the last stage is the one that samples the first token), and the decode must hold the last
stage's. Then one room aborted by the last stage's sender (SGLang's ``abort``) before its chunks: ``Failed`` on
the decode and on both stages, the first stage freeing it on the decode's report (``KVXFER_FAILED``), well before its
own bound. Then what kvxfer refuses at bootstrap, naming both layouts: a decode of PP 2, and a decode of another
attention TP, against the PP-2 prefill. kvxfer's tables are empty on every manager after, and no ``KVArgs`` field
SGLang left unset was read by kvxfer.

No control: SGLang's own ``nixl`` (run here on one room, its KV declared host memory as in
``test_sglang_control.py``) does PP 2 -> 1 into device memory only. A stage registers fewer KV regions than the
decode, which its prefill takes for decode-only speculative decoding, refused into anything but ``VRAM``
("NIXL PD transfer does not support HiSparse combined with decode-only speculative decoding", raised in the
bootstrap thread when the decode registers), so the room waits in ``Bootstrapping``; the test checks it says so
(and, should it ever move the room, holds it to the same byte checks). SGLang's ``mooncake`` is not installed by
the suite.

Not driven: SGLang's queues' PP poll path (``poll_and_all_reduce_prefill_pp``: stage 0 collecting the stages'
statuses and passing decisions down the PP group), which needs a real pipeline group; each stage's sender is
polled itself, as ``test_sglang_tp.py`` polls each TP rank's.
"""

from __future__ import annotations

import time

from sglang_support import Peer, free_port, kvxfer_leftovers, peer_env, rooms_plan

SUCCESS = 4
LAYERS = 5
#: SGLang's ``get_pp_indices(5, rank, 2)``: the last stage takes the extra layer.
STAGES = [(0, 2), (2, 5)]
#: What SGLang's own nixl says (its prefill's bootstrap thread) when a PP stage registers a decode of host memory.
NIXL_REFUSAL = "does not support HiSparse combined with decode-only speculative decoding"
#: How long the nixl room is given: SGLang's nixl refuses at once, the room then waits for SGLang's timeout.
NIXL_WAIT_S = 3
#: Seconds within which the other stage frees a room one stage aborted (its own bound: 2 x 15 s unread).
ABORT_BOUND_S = 10
#: name: (backend, MLA, whether the stages hold different aux rows)
ARMS = {"ucx": ("kvxfer_ucx", False, True), "mla": ("kvxfer_nixl", True, True), "nixl": ("nixl", False, False)}


def _stage(arm: str, rank: int, port: int, seed: int) -> dict:
    backend, mla, own_aux = ARMS[arm]
    return {"backend": backend, "mla": mla, "bootstrap_port": port, "pp_size": 2, "pp_rank": rank, "seed": seed,
            "aux_seed": seed + 500 * rank if own_aux else seed}


def _which(arm: str, rank: int) -> dict:
    return {} if (arm, rank) == ("ucx", 0) else {"manager": f"{arm}.{rank}"}


def _layer_faults(arm: str, serve: list[dict], stages: list[dict], decode: dict) -> list[str]:
    """Each decode buffer's pages against the pages of that layer on the stage that holds it, the aux row against
    the last stage's, and every room ``Success`` on both stages and the decode."""
    mla = ARMS[arm][1]
    faults = []
    for r in serve:
        key = str(r["room"])
        if any(s["rooms"][key]["status"] != SUCCESS for s in stages) or decode["rooms"][key]["status"] != SUCCESS:
            faults.append(f"{arm} room {key}: stages {[s['rooms'][key] for s in stages]}, decode {decode['rooms'][key]}")
            continue
        mine = decode["digests"][key]["pages"]
        if len(mine) != (1 if mla else 2) * LAYERS:
            faults.append(f"{arm} room {key}: the decode has {len(mine)} KV buffers")
            continue
        for rank, (start, stop) in enumerate(STAGES):
            theirs, n = stages[rank]["digests"][key]["pages"], stop - start
            for kind in range(1 if mla else 2):  # K layers then V layers (MHA), or one latent per layer (MLA)
                for layer in range(start, stop):
                    if mine[kind * LAYERS + layer] != theirs[kind * n + layer - start]:
                        faults.append(f"{arm} room {key}: decode layer {layer} {'latent' if mla else 'KV'[kind]} is "
                                      f"not stage {rank}'s")
        if decode["digests"][key]["aux"] != stages[-1]["digests"][key]["aux"]:
            faults.append(f"{arm} room {key}: the aux row is not the last stage's")
    return faults


def _exchange(prefill: Peer, decode: Peer, arm: str, port: int, serve: list, receive: list,
              timeout: float = 60) -> tuple[list, dict]:
    """The rooms served by both stages at once (one thread each) and received by the decode."""
    prefill.send(op="together", ops=[{"op": "serve", "rooms": serve, "timeout": timeout, **_which(arm, rank)}
                                     for rank in range(len(STAGES))])
    got = decode.ask(op="receive", bootstrap=f"127.0.0.1:{port}", rooms=receive, timeout=timeout,
                     **({} if arm == "ucx" else {"manager": f"{arm}_d"}))
    stages = prefill.read()["replies"]
    for rank, reply in enumerate(stages):
        if "error" in reply:
            raise AssertionError(f"stage {rank} of {arm}: {reply['error']}\n{reply.get('traceback')}\n{prefill.log()}")
    return stages, got


def test_prefill_pp2_into_decode_pp1_each_layer_from_its_stage():
    env = peer_env(KVXFER_TRANSFER_TIMEOUT_S="15")
    ports = {arm: free_port() for arm in ARMS}
    further_p = {f"{arm}.{rank}": _stage(arm, rank, ports[arm], 31 + 7 * i)
                 for i, arm in enumerate(ARMS) for rank in range(len(STAGES)) if (arm, rank) != ("ucx", 0)}
    main_p = _stage("ucx", 0, ports["ucx"], 31)
    prefill = Peer("prefill", main_p.pop("backend"), main_p.pop("bootstrap_port"), env=env, layers=LAYERS, **main_p,
                   **further_p)
    further_d = {"mla_d": {"backend": "kvxfer_nixl", "mla": True, "bootstrap_port": ports["mla"]},  # (a key "mla"
                 "nixl_d": {"backend": "nixl", "bootstrap_port": ports["nixl"]},  # would be a pool flag of the rank)
                 "pp2": {"pp_size": 2, "pp_rank": 0},  # refused: a decode of PP 2
                 "tp2": {"attn_tp_size": 2, "attn_tp_rank": 0, "heads": 1}}  # refused: PP 2 into another TP
    decode = Peer("decode", "kvxfer_ucx", ports["ucx"], env=env, layers=LAYERS, **further_d)
    peers = (prefill, decode)
    faults, figures, refusals, timings, control = [], {}, {}, {}, {}
    started_s = ready_s = 0.0
    failed: dict = {}
    began = time.monotonic()
    try:
        prefill.ready(), decode.ready()
        started_s = time.monotonic() - began
        for name in further_p:  # stage 0 of each instance first: it runs the bootstrap server and SGLang's PP store
            built = prefill.ask(op="build", manager=name)
            rank = int(name.rsplit(".", 1)[1])
            if built["layers"] != list(STAGES[rank]):
                faults.append(f"{name}: SGLang's get_pp_indices gave layers {built['layers']}, not {STAGES[rank]}")
            if built["layout"] and built["layout"]["layers"] != list(STAGES[rank]):
                faults.append(f"{name}: kvxfer's layout holds layers {built['layout']['layers']}")
        for name in ("mla_d", "nixl_d"):
            decode.ask(op="build", manager=name)
        ready_s = time.monotonic() - began

        for i, arm in enumerate(ARMS):
            t0 = time.monotonic()
            serve, receive = rooms_plan(200 + 10 * i, 4, pages_per_room=6, chunks=[(2, 4), (1, 2, 3)], src_base=3,
                                        dst_base=40)
            if arm == "nixl":  # SGLang's own: refuses a stage's fewer regions into host memory (module docstring)
                stages, got = _exchange(prefill, decode, arm, ports[arm], serve[:1], receive[:1], timeout=NIXL_WAIT_S)
                said = "".join(prefill.stderr)
                control = {"success": [got["rooms"][k]["status"] == SUCCESS for k in got["rooms"]],
                           "refused": NIXL_REFUSAL in said}
                if any(control["success"]):  # it moved the room: then it is the control, byte-exact or not
                    faults += _layer_faults(arm, serve[:1], stages, got)
                elif not control["refused"]:
                    faults.append(f"nixl: SGLang's own nixl neither moved the room nor said why: {got}")
            else:
                stages, got = _exchange(prefill, decode, arm, ports[arm], serve, receive)
                faults += _layer_faults(arm, serve, stages, got)
            timings[arm] = time.monotonic() - t0
            if got.get("descriptors") is not None:
                figures[arm] = got["descriptors"] / len(serve)

        # one stage fails its part (SGLang's sender abort on the last stage, before its chunks): the decode fails
        # the room and tells the other stage, which frees it then, not at its bound (twice the transfer timeout)
        serve, receive = rooms_plan(290, 1, pages_per_room=6, chunks=(2, 4), src_base=3, dst_base=40)
        prefill.send(op="together", ops=[{"op": "serve", "rooms": serve, "timeout": 40, "timing": True,
                                          **({"abort_rooms": [290]} if rank == 1 else {}), **_which("ucx", rank)}
                                         for rank in range(len(STAGES))])
        got = decode.ask(op="receive", bootstrap=f"127.0.0.1:{ports['ucx']}", rooms=receive, timeout=40)
        ends = [reply["rooms"]["290"] for reply in prefill.read()["replies"]]
        failed = {"decode": got["rooms"]["290"], "stage 0": ends[0], "stage 1": ends[1]}
        # stage 0 may have had its chunks read before stage 1's abort reached the decode (seen in a clean-clone
        # run): it then frees its pages on their read-done (Success: SGLang's PP consensus takes the minimum of the
        # stages, so the request still fails); otherwise it must fail on the decode's report, within the bound
        stage0_read_first = ends[0]["status"] == SUCCESS and ends[0].get("lease_revoked")
        stage0_told = ends[0]["status"] == 0 and "decode" in (ends[0]["reason"] or "") and \
            ends[0]["at_s"] <= ABORT_BOUND_S
        if failed["decode"]["status"] != 0 or ends[1]["status"] != 0 or not (stage0_read_first or stage0_told):
            faults.append(f"a stage's abort: not Failed on the decode and both stages, the other stage freeing it on "
                          f"the decode's report within {ABORT_BOUND_S}s: {failed}")

        # what kvxfer refuses at bootstrap, naming both sides: no receiver made, nothing read
        for name, words in (("pp2", ["decode of PP 1 only", "pp_size=2, this decode has attn_tp_size=1 pp_size=2"]),
                            ("tp2", ["same attention TP only", "pp_size=2, this decode has attn_tp_size=2 pp_size=1"])):
            got = decode.ask(op="receive", manager=name, bootstrap=f"127.0.0.1:{ports['ucx']}",
                             rooms=rooms_plan(300, 1, pages_per_room=2, chunks=(2,))[1], timeout=20)
            refusals[name] = got.get("refused")
            if not refusals[name] or not all(w in refusals[name] for w in words):
                faults.append(f"{name}: not refused at bootstrap naming {words}: {got}")

        faults += kvxfer_leftovers([(prefill, name) for name in ["main", *further_p] if not name.startswith("nixl")]
                                   + [(decode, name) for name in ("main", "mla_d", "pp2", "tp2")], peers)
    finally:
        logs = "".join(f"\n--- {p.role}:\n{p.log()}" for p in peers)
        for peer in peers:
            peer.close()
    print(f"PP 2 -> 1: ranks started in {started_s:.1f}s, their stages made by {ready_s:.1f}s; per arm {timings}; descriptors per room on the decode: "
          f"{figures}; SGLang's nixl: {control}; a stage's abort: {failed}; refused: {refusals}")
    assert not faults, f"{faults}{logs}"
