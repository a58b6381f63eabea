"""kvxfer as SGLang's PD transfer backend, driven by SGLang's own code (sglang 0.5.23, ``.venv-sglang``).

Each rank is a real process (``sglang_peer.py``): SGLang's plugin loading, its bootstrap server,
its real ``MHATokenToKVPool`` (page_size 4) and ``MetadataBuffers``, and kvxfer's manager made by
SGLang's own ``PrefillBootstrapQueue`` / ``DecodePreallocQueue`` (their ``__init__`` and
``_init_kv_manager``, so ``KVArgs`` holds what SGLang puts there on each role), senders made by the
queue's ``create_sender``, receivers by its ``_create_receiver_and_enqueue``. The prefill fills its
pool with random bytes; the decode reads them into other pages; every page of every layer and every
aux row is compared by digest. Nothing on the transfer path is faked; where SGLang's own queues drive
it, the scheduler around them is stood in for as SGLang's own CPU unit tests do.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from sglang_support import Peer, free_port, peer_env, push_frames, rooms_plan, sglang_python

from kvxfer.security.auth import new_secret_file

FAILED, SUCCESS = 0, 4
#: The prefill rank's transfer timeout in step 6 (the decodes keep peer_env's 5 s): its bound on a silent
#: decode is twice that. Every other step runs with twice ``CALM_TIMEOUT_S``: on a loaded machine a read-done
#: can be seconds late, and a hand-off that the prefill times out there fails a step that tests bytes.
PREFILL_TIMEOUT_S = 3
CALM_TIMEOUT_S = 15
MAX_ROOMS = 8

PLUGIN_CHECK = r"""
import argparse, sglang
from sglang.srt.disaggregation.utils import TransferBackend, KVClassType, get_kv_class as before
import sglang.srt.disaggregation.prefill as prefill, sglang.srt.disaggregation.decode as decode
import sglang.srt.managers.disagg_service as service
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.disaggregation.utils as utils
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.base.conn import BaseKVManager, BaseKVSender, BaseKVReceiver, BaseKVBootstrapServer
from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
from sglang.srt.server_args import ServerArgs
bases = {KVClassType.MANAGER: BaseKVManager, KVClassType.SENDER: BaseKVSender, KVClassType.RECEIVER: BaseKVReceiver,
         KVClassType.BOOTSTRAP_SERVER: BaseKVBootstrapServer}
for name in ("kvxfer_nixl", "kvxfer_ucx", "kvxfer"):
    assert name in DISAGG_TRANSFER_BACKEND_CHOICES, name
    backend = TransferBackend(name)
    for kind, base in bases.items():
        got = {m.get_kv_class(backend, kind) for m in (utils, prefill, decode, service)}
        assert len(got) == 1, (name, kind, got)
        cls = got.pop()
        assert issubclass(cls, base) and cls.__module__.startswith("kvxfer."), (name, kind, cls)
        assert cls is utils.get_kv_class(TransferBackend("kvxfer_nixl"), kind)  if name == "kvxfer" else True
assert utils.get_kv_class(TransferBackend("kvxfer_ucx"), KVClassType.MANAGER).kvxfer_backend == "ucx"
assert hasattr(utils.get_kv_class(TransferBackend.KVXFER, KVClassType.MANAGER), "try_ensure_parallel_info")
from sglang.srt.disaggregation.nixl import NixlKVManager
from sglang.srt.disaggregation.mooncake import MooncakeKVManager
assert utils.get_kv_class(TransferBackend.NIXL, KVClassType.MANAGER) is NixlKVManager
assert utils.get_kv_class(TransferBackend.MOONCAKE, KVClassType.MANAGER) is MooncakeKVManager
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = parser.parse_args(["--model-path", "m", "--disaggregation-transfer-backend", "kvxfer_ucx"])
assert args.disaggregation_transfer_backend == "kvxfer_ucx"
from types import SimpleNamespace as NS
from kvxfer.integrations.sglang.conn import unsupported_options  # refused when a manager is made, naming the flag
assert unsupported_options(NS(disaggregation_decode_allocation_policy="early"), "decode") is None
assert "--disaggregation-decode-allocation-policy" in unsupported_options(
    NS(disaggregation_decode_allocation_policy="prefill_complete"), "prefill")
radix = NS(disaggregation_decode_allocation_policy="early", disaggregation_decode_enable_radix_cache=True)
assert unsupported_options(radix, "prefill") is None
assert "--disaggregation-decode-enable-radix-cache" in unsupported_options(radix, "decode")
print("PLUGIN-OK", sglang.__version__)
"""


def test_plugin_registers_backends_through_sglang_entry_point():
    """SGLang's load_plugins finds kvxfer's entry point; the three names resolve everywhere SGLang
    imported get_kv_class before plugins loaded; SGLang's own backends and the CLI are intact."""
    out = subprocess.run([sglang_python(), "-c", PLUGIN_CHECK], capture_output=True, text=True, timeout=120,
                         env=peer_env())
    assert "PLUGIN-OK 0.5.23" in out.stdout, out.stdout[-2000:] + out.stderr[-6000:]


@pytest.fixture
def secret_env(tmp_path):
    return peer_env(KVXFER_SECRET_FILE=new_secret_file(str(tmp_path)))


def _check_bytes(serve_rooms, prefill_reply, decode_reply, *peers: Peer) -> None:
    logs = "".join(f"\n--- {p.role}'s log:\n{p.log()}" for p in peers)
    for r in serve_rooms:
        key = str(r["room"])
        assert prefill_reply["rooms"][key] == {"status": SUCCESS, "reason": None}, (prefill_reply["rooms"][key], logs)
        assert decode_reply["rooms"][key]["status"] == SUCCESS, (decode_reply["rooms"][key], logs)
        src, dst = prefill_reply["digests"][key], decode_reply["digests"][key]
        for layer, (a, b) in enumerate(zip(src["pages"], dst["pages"])):
            assert a == b, f"room {key} buffer {layer}: pages differ"
        assert src["aux"] == dst["aux"] and src["aux"], f"room {key}: aux rows differ"
        assert src.get("state", []) == dst.get("state", []), f"room {key}: Mamba state slots differ"


def _exchange(prefill: Peer, decode: Peer, port: int, serve, receive, **extra) -> tuple[dict, dict]:
    prefill.send(op="serve", rooms=serve, timeout=40, **extra.get("serve", {}))
    decode.send(op="receive", bootstrap=f"127.0.0.1:{port}", rooms=receive, timeout=40)
    return prefill.read(), decode.read()


@pytest.mark.parametrize("backend,mismatch", [("kvxfer_nixl", {"heads": 4}), ("kvxfer_ucx", {"page_size": 8})])
def test_two_processes_chunks_rooms_reuse_mismatch_and_peer_deaths(backend, mismatch, secret_env):
    """One prefill rank and two decode ranks, all real SGLang ranks on one backend, every manager made by
    SGLang's own queue code with SGLang's staging buffer off (the second decode also holds a mismatched
    manager, so no fourth process pays SGLang's imports). kvxfer reads no ``KVArgs`` field that SGLang's
    code left unset on that role (checked when the managers are made and after the hand-offs below):

    1. three rooms at once, each sent in two chunks: every page of every layer, the aux rows and each
       room's Mamba state slot (every layer's conv and temporal state, SGLang's ``state_indices`` with
       the last chunk, to another slot) arrive byte for byte, no other state slot is written, both sides
       ``KVPoll.Success``;
    2. the same room ids again (reused), four rooms in flight of three chunks each, other pages: byte exact;
    2b. three rooms driven by SGLang's own queues (``PrefillBootstrapQueue``; ``DecodePreallocQueue``
       and ``DecodeTransferQueue``, which commit the first token from the aux row after SGLang's
       bootstrap-room check), the rank's queues as their ``__init__`` made them, the scheduler their
       methods call back into stood in for as SGLang's CPU unit tests do (``sglang_peer.py``):
       byte exact, every queue and metadata slot released;
    2c. token-exact generation: a tiny decoder made from a seed prefills a prompt into the prefill's
       SGLang pool (its first token into the aux row); kvxfer moves the pages and the row; the decode
       continues greedily from them (reading and writing its own pool) and produces exactly the
       tokens the prefill produced co-located, and other tokens without the prompt's KV;
    3. nothing left in any table on either side;
    4. a decode whose pool differs is refused, naming what differs (other heads: each layer's page
       length, from SGLang's item lengths); a decode of another attention TP size (rank 0 of TP 2) whose
       Mamba state does not split as the TP sizes say is refused at the HELLO naming the state tensor and both
       layouts (KV across TP sizes is ``test_sglang_tp.py``, Mamba state ``test_sglang_tp_mamba.py``), with
       nothing read or kept;
    5. the decode aborts two rooms at once: both sides conclude, the prefill's pages are freed and
       no table keeps an entry;
    6. the decode is SIGKILLed with its first page read in flight (one room mid-read, one published
       and offered but unread): the prefill frees neither room before its bound (2 x its transfer
       timeout after the offer), revokes each lease before SGLang sees ``Failed``, stays up, and then
       serves the other decode the same room ids byte for byte, with nothing left in any table;
    6b. a stranger, then a peer holding the secret, sends both ranks junk on their SGLang sockets
       (``_junk_then_serve``): each frame is dropped and counted (unsigned ones before they are
       read), the tables stay bounded, and both ranks then hand off byte for byte;
    7. the prefill is SIGKILLed after its first chunk: the decode's rooms are ``KVPoll.Failed``
       within seconds (not SGLang's 300 s), with a reason.
    """
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    # the prefill's bound for a silent decode is 2 x its transfer timeout: short here, to keep step 6 cheap
    # every rank also holds SGLang's Mamba request pool (8 rows): its conv and temporal state per layer
    # are KVArgs' state buffers (random bytes on the prefill, zeros on a decode)
    # KVXFER_SGLANG_MAX_ROOMS: lease slots, and metadata kept for rooms without a sender (step 6b)
    prefill = Peer("prefill", backend, port, env={**secret_env, "KVXFER_TRANSFER_TIMEOUT_S": str(CALM_TIMEOUT_S),
                                                  "KVXFER_SGLANG_MAX_ROOMS": str(MAX_ROOMS)}, mamba=8)
    decode = Peer("decode", backend, port, env=secret_env, mamba=8)
    other = Peer("decode", backend, port, env=secret_env, mamba=8, mismatch=mismatch,
                 tp2={"heads": 1, "attn_tp_size": 2})  # attention-TP rank 0 of 2: half the prefill's heads, and state
    try:
        prefill.ready(), decode.ready(), other.ready()
        _assert_no_unset_reads(prefill, decode, other)  # kvxfer's layout is read when the manager is made
        serve, receive = rooms_plan(100, 3)
        for i, (s, r) in enumerate(zip(serve, receive)):  # each room's Mamba slot, sent with its last chunk
            s.update(req_row=i, mamba_slot=1 + i)
            r.update(req_row=7 - i, mamba_slot=(7, 4, 5)[i])
        served, received = _exchange(prefill, decode, port, serve, receive)
        _check_bytes(serve, served, received, prefill, decode)
        assert all(served["digests"][str(r["room"])]["state"] for r in serve), served["digests"]
        assert received["state_written_slots"] == [4, 5, 7], received["state_written_slots"]  # no other slot

        serve, receive = rooms_plan(100, 4, pages_per_room=6, chunks=(1, 2, 3), src_base=30, dst_base=2)
        _check_bytes(serve, *_exchange(prefill, decode, port, serve, receive), prefill, decode)

        serve, receive = rooms_plan(700, 3, pages_per_room=5, chunks=(2, 3), src_base=3, dst_base=50)
        prefill.send(op="serve_queued", rooms=serve, timeout=60)  # through SGLang's own queues
        queued = decode.ask(op="receive_queued", bootstrap=bootstrap, rooms=receive, timeout=60)
        served = prefill.read()
        _check_bytes(serve, served, queued, prefill, decode)
        assert not any(served["left"].values()) and not any(queued["left"].values()), (served, queued)
        for r in serve:  # SGLang committed the first token from the aux row, after its bootstrap-room check
            assert queued["rooms"][str(r["room"])]["output_ids"] == [1000 + r["room"]], queued["rooms"]

        prompt, new_tokens = [(7 * i + 3) % 97 for i in range(13)], 12  # 13 tokens: 4 pages, the last part full
        colocated = prefill.ask(op="model_prefill", prompt=prompt, pages=[60, 61, 62, 63],
                                ref_pages=[40, 41, 42, 43, 44, 45, 46], aux_index=5, new_tokens=new_tokens)["tokens"]
        serve = [{"room": 800, "pages": [60, 61, 62, 63], "chunks": [2, 2], "aux_index": 5}]
        _check_bytes(serve, *_exchange(prefill, decode, port, serve, [{"room": 800, "pages": [23, 20, 22, 21],
                                                                       "aux_index": 13}]), prefill, decode)
        moved = decode.ask(op="model_decode", pages=[23, 20, 22, 21, 30, 31, 32], prompt_len=len(prompt),
                           aux_index=13, new_tokens=new_tokens)["tokens"]
        assert moved == colocated and len(set(colocated)) > 2, (moved, colocated)
        blind = decode.ask(op="model_decode", pages=[50, 51, 52, 53, 54, 55, 56], prompt_len=len(prompt),
                           aux_index=13, new_tokens=new_tokens)["tokens"]
        assert blind != colocated, "the generation does not depend on the prompt's KV: the check above proves nothing"
        _assert_empty(prefill, decode)
        _assert_no_unset_reads(prefill, decode)

        serve, receive = rooms_plan(300, 1)  # refused: the prefill's room never bootstraps, so wait little
        prefill.send(op="serve", rooms=serve, timeout=3)
        refused = other.ask(op="receive", manager="mismatch", bootstrap=bootstrap, rooms=receive, timeout=15)
        prefill.read()
        if "page_size" in mismatch:  # SGLang's own check, at bootstrap, names both page sizes
            assert "page_size=4" in refused["refused"] and "page_size=8" in refused["refused"], refused
        else:  # kvxfer's layout check names each field with both values: 4 heads make each layer's page twice as long
            reason = refused["rooms"]["300"]["reason"]
            assert refused["rooms"]["300"]["status"] == FAILED, refused
            lens = ", ".join(["256"] * 6), ", ".join(["512"] * 6)
            assert f"kv_item_lens: prefill=[{lens[0]}] decode=[{lens[1]}]" in reason, reason

        # a decode of attention TP 2 (rank 0) whose Mamba state does not split as TP 1 -> 2 (one Mamba2 group: its
        # conv state's sharded axis is 48 on a TP-1 rank, 32 on a TP-2 rank) is refused at the HELLO, naming the
        # tensor and both layouts, with nothing read (Mamba state that splits: test_sglang_tp_mamba.py)
        began = time.monotonic()
        serve, receive = rooms_plan(310, 1)
        prefill.send(op="serve", rooms=serve, timeout=5)
        refused = other.ask(op="receive", manager="tp2", bootstrap=bootstrap, rooms=receive, timeout=15)
        prefill.read()
        reason = refused["rooms"]["310"]["reason"] or ""
        assert refused["rooms"]["310"]["status"] == FAILED, refused
        assert "mamba state tensor 0" in reason and "48 x TP 1" in reason and "32 x TP 2" in reason, reason
        assert "attn_tp_size=1" in reason and "attn_tp_size=2" in reason, reason
        tp2 = other.ask(op="sizes", manager="tp2")
        assert tp2["attn_tp_size"] == 2 and not any(tp2["sizes"].values()), tp2  # nothing kept
        assert tp2["counters"]["descriptors"] == 0 and tp2["counters"]["chunks_pulled"] == 0, tp2  # nothing read
        _assert_no_unset_reads(other)  # its mismatched and TP-2 managers, made by SGLang's decode queue too
        print(f"{backend}: TP 2 decode refused in {time.monotonic() - began:.2f}s (manager built on first use): "
              f"{reason}")

        serve, receive = rooms_plan(200, 2)  # the decode aborts right after publishing its pages
        prefill.send(op="serve", rooms=serve, timeout=20)
        aborted = decode.ask(op="receive", bootstrap=bootstrap, rooms=receive, timeout=20, abort_after_s=0.0)
        served = prefill.read()
        for key in ("200", "201"):
            assert aborted["rooms"][key]["status"] == FAILED, aborted["rooms"][key]
            assert served["rooms"][key]["status"] in (FAILED, SUCCESS), served["rooms"][key]  # freed either way
        _assert_empty(prefill, decode)

        serve, receive = rooms_plan(500, 2)  # the decode dies with its first read in flight
        prefill.ask(op="bound", seconds=2 * PREFILL_TIMEOUT_S)
        prefill.send(op="serve", rooms=serve, timeout=4 * PREFILL_TIMEOUT_S + 20, timing=True,
                     offer_together=True)  # else the decode could die before its second room's metadata left
        decode.send(op="receive", bootstrap=bootstrap, rooms=receive, timeout=30, die_on_read=True,
                    metadata_gap_s=0.5)  # its first room's read may start before the second room's metadata
        decode.proc.wait(timeout=30)
        assert decode.proc.returncode == -signal.SIGKILL, decode.log()
        served = prefill.read()
        assert served["leases_held"] == 2, served  # both rooms' pages were offered under a lease
        bound = 2 * PREFILL_TIMEOUT_S
        for key in ("500", "501"):
            room = served["rooms"][key]
            assert room["status"] == FAILED and "no read-done from the decode" in room["reason"], room
            assert room["lease_revoked"] is True, room  # before SGLang could see Failed and free the pages
            assert bound <= room["at_s"] < bound + 4.0, f"room {key} freed {room['at_s']:.2f}s after its offer"
        print(f"{backend}: decode killed mid-read -> prefill pages freed after "
              f"{max(r['at_s'] for r in served['rooms'].values()):.2f}s (bound {bound}s): {served['rooms']['500']['reason']}")
        prefill.ask(op="bound", seconds=2 * CALM_TIMEOUT_S)
        serve, receive = rooms_plan(500, 2, chunks=(2, 5), src_base=20, dst_base=3)  # same room ids, live decode
        _check_bytes(serve, *_exchange(prefill, other, port, serve, receive), prefill, other)
        _assert_empty(prefill, other)

        _junk_then_serve(prefill, other, port, secret_env["KVXFER_SECRET_FILE"])

        serve, receive = rooms_plan(400, 2, chunks=(3, 4))
        prefill.send(op="serve", rooms=serve, timeout=30, die_after_chunks=1)
        died = other.ask(op="receive", bootstrap=bootstrap, rooms=receive, timeout=30)
        prefill.proc.wait(timeout=10)
        assert prefill.proc.returncode == -signal.SIGKILL
        for key in ("400", "401"):
            room = died["rooms"][key]
            assert room["status"] == FAILED and room["reason"], room
            assert room["at_s"] < 10.0, f"room {key} failed only after {room['at_s']:.1f}s"
        print(f"{backend}: prefill killed -> decode KVPoll.Failed after "
              f"{max(r['at_s'] for r in died['rooms'].values()):.2f}s: {died['rooms']['400']['reason']}")
        sizes_d = other.ask(op="sizes", settle_s=0.2)["sizes"]
        assert not sizes_d["puller_rooms"] and not sizes_d["puller_unsafe"], sizes_d
    finally:
        for peer in (prefill, decode, other):
            peer.close()


def _junk_then_serve(prefill: Peer, decode: Peer, port: int, secret_file: str) -> None:
    """Frames on both ranks' SGLang sockets from a stranger (no secret: kvxfer's tags unsigned) and
    then from a peer holding the secret (signed): malformed JSON, wrong types, a body past the size
    bound, 100,000-deep nesting, a lone frame, three frames, a HELLO and a CHUNK from a prefill the
    decode never registered with (the chunk names a room the next step uses), metadata for 50 rooms
    the prefill has no sender for. Unsigned, every one is dropped before it is read; signed, each
    breaks the schema or the protocol and is dropped, or is kept within its bound. None may stop a
    listener, earn a reply or grow a table past its bound; the pair then hands off byte for byte."""
    from kvxfer.integrations.sglang import wire
    from kvxfer.security.auth import load_secret

    stranger = "127.0.0.1:9"
    chunk = {"room": 600, "prefill": stranger, "chunk": 0, "src": [1], "dst_start": 0, "dst_end": 1, "last": True,
             "slot": 0, "lease": 1, "aux_index": None, "state": None}
    junk = [[b"KVXFER_HELLO", b"{not json"], [b"KVXFER_CHUNK", b"[]"], [b"KVXFER_META", b'{"room": "x"}'],
            [b"KVXFER_FAILED", b'{"room": true}'], [b"KVXFER_REG", b'{"endpoint": "a", "layout": ' + b"[" * 100_000],
            [b"KVXFER_CHUNK", b" " * (9 << 20)], [b"KVXFER_CHUNK"], [b"KVXFER_META", b"{}", b"{}"], [b"not sglang's"]]
    # refused for what they say: a message for the other role, a prefill's "Success" (a kvxfer prefill
    # reports only failures; the decode's reads say Success), an endpoint that is not host:port
    wrong_decode = [[b"KVXFER_REG", b'{"endpoint": "127.0.0.1:9", "layout": {}}'],
                    [b"KVXFER_STATUS", b"600", str(SUCCESS).encode(), b"0", b""]]
    wrong_prefill = [[b"KVXFER_HELLO", json.dumps({"prefill": stranger}).encode()],
                     [b"KVXFER_META", b'{"room": 10049, "endpoint": "garbage"}']]
    to_decode = junk + wrong_decode + [
        [b"KVXFER_HELLO", json.dumps({"prefill": stranger, "refused": "a stranger says no"}).encode()],
        [b"KVXFER_CHUNK", json.dumps(chunk).encode()]]
    to_prefill = junk + wrong_prefill + [[b"KVXFER_META", json.dumps({"room": 10_000 + i, "endpoint": stranger})
                                          .encode()] for i in range(50)]
    key = wire.FrameKey(load_secret(secret_file=secret_file))

    send = push_frames

    def signed(messages: list[list[bytes]]) -> list[list[bytes]]:
        return [key.sign(m) if m[0] == b"KVXFER_STATUS" or (len(m) == 2 and m[0].startswith(b"KVXFER_")) else m
                for m in messages]

    send(decode, to_decode)  # the stranger's: every frame dropped before it is read
    send(prefill, to_prefill)
    sizes_p, sizes_d = prefill.ask(op="sizes"), decode.ask(op="sizes")
    assert sizes_p["junk"] == len(to_prefill) and sizes_d["junk"] == len(to_decode), (sizes_p, sizes_d)
    assert not any(sizes_p["sizes"].values()) and not any(sizes_d["sizes"].values()), (sizes_p, sizes_d)
    assert sizes_d["counters"]["strangers"] == 0, sizes_d

    send(decode, signed(to_decode))  # the same, signed with the cluster key
    send(prefill, signed(to_prefill))
    before_p, before_d = sizes_p["junk"], sizes_d["junk"]
    sizes_p, sizes_d = prefill.ask(op="sizes"), decode.ask(op="sizes")
    # every junk frame, and each message refused for what it says, dropped and counted
    assert sizes_p["junk"] - before_p == len(junk) + len(wrong_prefill), sizes_p
    assert sizes_d["junk"] - before_d == len(junk) + len(wrong_decode), sizes_d
    assert sizes_p["sizes"]["source_early"] == MAX_ROOMS, sizes_p  # 50 sent, MAX_ROOMS kept (until SGLang's timeout)
    assert sizes_p["sizes"]["source_rooms"] == MAX_ROOMS and sizes_p["sizes"]["source_leases_in_use"] == 0, sizes_p
    assert sizes_p["sizes"]["request_status"] == 0, sizes_p  # SGLang's table: no entry for a room without a sender
    assert sizes_d["counters"]["strangers"] == 2 and sizes_d["known_prefills"] == 1, sizes_d  # no stranger kept
    assert not any(sizes_d["sizes"].values()), sizes_d
    serve, receive = rooms_plan(600, 2, chunks=(2, 5), src_base=40, dst_base=10)
    _check_bytes(serve, *_exchange(prefill, decode, port, serve, receive), prefill, decode)
    after = decode.ask(op="sizes")
    assert not any(after["sizes"].values()) and after["counters"]["stale_chunks"] == sizes_d["counters"]["stale_chunks"]


def _assert_no_unset_reads(*peers: Peer) -> None:
    """No kvxfer code read a ``KVArgs`` field that SGLang's code left unset on the peer's role (each peer
    records every such read, with the reading module: ``kvxfer.drive.sglang_build.record_unset_kvargs_reads``)."""
    for peer in peers:
        reads = peer.ask(op="unset_reads")["unset_reads"]
        assert not [r for r in reads if r[1].startswith("kvxfer.integrations")], \
            f"{peer.role}: kvxfer read KVArgs fields SGLang left unset on this role: {reads}"


def _assert_empty(prefill: Peer, decode: Peer) -> None:
    sizes_p = prefill.ask(op="sizes", settle_s=0.3)["sizes"]
    sizes_d = decode.ask(op="sizes")["sizes"]
    assert not any(sizes_p.values()) and not any(sizes_d.values()), (sizes_p, sizes_d)
