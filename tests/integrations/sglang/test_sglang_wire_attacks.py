"""Attacks from outside on kvxfer's SGLang backend, each with real ranks and real zmq frames (issue 38, item 6).

Each SGLang rank is a real process (``sglang_peer.py``: SGLang's own queues make the managers, as in
``test_sglang_backend.py``); the frames are made here with pyzmq and ``kvxfer.integrations.sglang.wire``
and sent to the rank endpoint each rank reports in its ready line, as a stranger on the network (no
key: unsigned) or a holder of the cluster key (signed) would send them. Nothing is mocked: the one
condition that needs a stopped process (a decode that cannot take frames) is a real ``SIGSTOP``.

Without the key (the default):
* a CHUNK naming a guessed lease slot and lease (the first a fresh prefill hands out) must not make a
  waiting room ``Success`` holding another request's pages, and a chunk that comes after a gap (chunk 1
  before chunk 0) fails its room at once, with nothing read;
* metadata from a stranger for rooms it will never own must not crowd a genuine room out of the
  prefill's early-metadata table;
* 1,500 replayed registrations must not make the prefill send a decode 1,500 HELLOs (none while the decode has
  no room in flight, one when its next room starts), and that room completes.

With the key (a signed frame can be captured and replayed, or made by any key holder):
* a genuine CHUNK replayed to another decode (which answers the prefill with a FAILED), and a
  lease-less FAILED, must not fail a live room: only the room's own decode, with the room's lease, can;
  nor a room's own CHUNK replayed to its own decode after its Success, before the prefill took the read-done
  (the decode's answer names the chunk: issue 49);
* a prefill's status frame (what kvxfer's prefill sent before) and a revocation from another prefill
  must not fail a waiting room at the decode;
* a chunk the prefill cannot hand to zmq (``zmq.Again``: a decode that is stopped, and thousands of
  HELLOs queued for it, with the prefill's HELLO pacing turned off so that replayed registrations can
  fill zmq's queue) fails its room on both sides at once, naming the chunk, instead of a Success with
  that chunk's pages never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

import pytest

zmq = pytest.importorskip("zmq")

from sglang_support import POOL, Peer, free_port, peer_env, push_frames  # noqa: E402

from kvxfer.integrations.sglang import wire  # noqa: E402
from kvxfer.security.auth import load_secret, new_secret_file  # noqa: E402

BACKEND = "kvxfer_ucx"
FAILED, SUCCESS = 0, 4
#: The bytes of one page of one layer in the test pool, all zero: what a decode page holds until written.
ZERO_PAGE = hashlib.sha256(bytes(POOL["page_size"] * POOL["heads"] * POOL["head_dim"] * 2)).hexdigest()[:16]


@dataclass
class Ranks:
    port: int
    prefill: Peer
    first: Peer
    second: Peer
    key: wire.FrameKey

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"


def _ranks(env: dict[str, str], prefill_env: dict[str, str], key: wire.FrameKey):
    port = free_port()
    peers = [Peer("prefill", BACKEND, port, env={**env, **prefill_env}), Peer("decode", BACKEND, port, env=env),
             Peer("decode", BACKEND, port, env=env)]
    try:
        for peer in peers:
            peer.ready()
        yield Ranks(port, *peers, key)
    finally:
        for peer in peers:
            if peer.proc.poll() is None:
                os.kill(peer.proc.pid, signal.SIGCONT)  # a test that failed with a rank stopped
            peer.close()


@pytest.fixture(scope="module")
def keyless():
    """A prefill and two decodes without the cluster key (kvxfer's default); the prefill serves at most
    four rooms at once (``KVXFER_SGLANG_MAX_ROOMS``: lease slots and early-metadata entries)."""
    yield from _ranks(peer_env(), {"KVXFER_SGLANG_MAX_ROOMS": "4"}, wire.UNSIGNED)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A prefill and two decodes holding one cluster key; this test process holds it too. The prefill answers
    every registration at once (HELLO pacing off, ``KVXFER_SGLANG_HELLO_PACE_S=0``): the one way left for a
    test to queue thousands of HELLOs for a stopped decode."""
    secret = new_secret_file(str(tmp_path_factory.mktemp("secret")))
    yield from _ranks(peer_env(KVXFER_SECRET_FILE=secret), {"KVXFER_SGLANG_HELLO_PACE_S": "0"},
                      wire.FrameKey(load_secret(secret_file=secret)))


def rank_key(peer: Peer) -> str:
    """A rank's name on kvxfer's wire (``ip:port``), from the endpoint its ready line reports."""
    return peer.info["endpoint"].removeprefix("tcp://")


def push(peer: Peer, messages: list[list[bytes]], settle_s: float = 0.5) -> None:
    push_frames(peer, messages, settle_s)


def wait_until(check: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    if what:
        raise AssertionError(f"timed out waiting for {what}")
    return False


def early(prefill: Peer) -> int:
    """Rooms whose metadata the prefill keeps without a sender."""
    return prefill.ask(op="sizes")["sizes"]["source_early"]


def counters(peer: Peer) -> dict[str, Any]:
    return peer.ask(op="sizes")["counters"]


def room(number: int, pages: list[int], aux: int, chunks: tuple[int, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"room": number, "pages": pages, "aux_index": aux}
    if chunks:
        out["chunks"] = list(chunks)
    return out


def chunk_body(prefill: Peer, room_id: int, number: int, src: list[int], *, slot: int, lease: int,
               last: bool = True) -> dict[str, Any]:
    return {"room": room_id, "prefill": rank_key(prefill), "chunk": number, "src": src, "dst_start": 0,
            "dst_end": len(src), "last": last, "slot": slot, "lease": lease, "aux_index": None, "state": None}


def check_same_pages(served: dict, received: dict, key: str, logs: str) -> None:
    assert served["rooms"][key]["status"] == SUCCESS, (served["rooms"][key], logs)
    assert received["rooms"][key]["status"] == SUCCESS, (received["rooms"][key], logs)
    assert served["digests"][key]["pages"] == received["digests"][key]["pages"], f"room {key}: pages differ"


def logs(*peers: Peer) -> str:
    return "".join(f"\n--- {p.role} {p.info.get('endpoint')}:\n{p.log()}" for p in peers)


# --- without the cluster key ---------------------------------------------------------------------------------
def test_keyless_guessed_lease_or_a_gap_cannot_make_a_waiting_room_succeed(keyless):
    """Room 1000 is offered to a decode that is stopped, so its lease stays pinned on the prefill. Two
    rooms wait at the other decode (their metadata sent, no sender on the prefill yet). A stranger sends
    that decode one unsigned CHUNK per waiting room, naming room 1000's source pages and the lease a
    fresh prefill used to hand out first (slot 0, lease 1): chunk 0 (last) for room 2000, and chunk 1
    (last) with no chunk 0 for room 2001. Neither room may end ``Success``: 2000's read fails its lease
    check (leases are random 63-bit values), 2001 fails at once naming the missing chunk 0, with nothing
    read into its pages. Room 1000 then completes byte for byte once its decode runs again."""
    ranks = keyless
    prefill, stopped, victim = ranks.prefill, ranks.first, ranks.second
    # the victim has had a room from the prefill, so it holds the prefill's HELLO (a decode gets it only with a
    # room in flight there, issue 49: before it, every chunk naming that prefill waits for it, the stranger's too)
    victim.send(op="receive", bootstrap=ranks.bootstrap, rooms=[room(1999, list(range(50, 57)), 9)], timeout=40)
    prefill.send(op="serve", rooms=[room(1999, list(range(20, 27)), 1, (3, 4))], timeout=40)
    served, received = prefill.read(), victim.read()
    check_same_pages(served, received, "1999", logs(prefill, victim))
    prefill.ask(op="bound", seconds=60)  # the stopped decode's room stays pinned well past this test
    src = list(range(1, 8))
    base = early(prefill)
    stopped.send(op="receive", bootstrap=ranks.bootstrap, rooms=[room(1000, list(range(40, 47)), 8)], timeout=90)
    wait_until(lambda: early(prefill) > base, what="room 1000's metadata at the prefill")
    os.kill(stopped.proc.pid, signal.SIGSTOP)
    try:
        victim.send(op="receive", bootstrap=ranks.bootstrap, timeout=30,
                    rooms=[room(2000, list(range(50, 57)), 9), room(2001, list(range(57, 64)), 10)])
        wait_until(lambda: early(prefill) > base + 2, what="the waiting rooms' metadata at the prefill")
        prefill.send(op="serve", rooms=[room(1000, src, 0, (3, 4))], timeout=90)
        time.sleep(1.5)  # room 1000's chunks are offered (queued for the stopped decode): its lease is pinned
        push(victim, [wire.encode(wire.CHUNK, chunk_body(prefill, 2000, 0, src, slot=0, lease=1)),
                      wire.encode(wire.CHUNK, chunk_body(prefill, 2001, 1, src, slot=0, lease=1))])
        attacked = victim.read(timeout_s=60)
    finally:
        os.kill(stopped.proc.pid, signal.SIGCONT)
    served, received = prefill.read(timeout_s=90), stopped.read(timeout_s=90)
    text = logs(prefill, stopped, victim)
    guessed, gap = attacked["rooms"]["2000"], attacked["rooms"]["2001"]
    assert guessed["status"] == FAILED and "lease check failed" in (guessed["reason"] or ""), (guessed, text)
    assert gap["status"] == FAILED and "chunk 0" in (gap["reason"] or ""), (gap, text)
    assert gap["at_s"] < 5.0, gap  # at once, not by a timeout
    assert all(d == ZERO_PAGE for layer in attacked["digests"]["2001"]["pages"] for d in layer), \
        ("room 2001's pages were written by a chunk that came after a gap", attacked["digests"]["2001"])
    check_same_pages(served, received, "1000", text)


def test_keyless_stranger_metadata_cannot_crowd_out_a_genuine_room(keyless):
    """A stranger sends the prefill unsigned metadata for eight rooms it will never own, four before and
    four after a genuine decode's room (the prefill keeps at most four rooms without a sender): the
    stranger's oldest entries are evicted (counted, logged), the genuine room is kept and completes byte
    for byte, instead of waiting for SGLang's bootstrap timeout."""
    ranks = keyless
    prefill, decode = ranks.prefill, ranks.first
    stranger = "127.0.0.1:9"

    def metas(first: int) -> list[list[bytes]]:
        return [wire.encode(wire.META, {"room": first + i, "endpoint": stranger}) for i in range(4)]

    push(prefill, metas(3000))
    evicted = counters(prefill).get("early_evicted", 0)
    decode.send(op="receive", bootstrap=ranks.bootstrap, rooms=[room(3100, list(range(20, 27)), 11)], timeout=40)
    wait_until(lambda: counters(prefill).get("early_evicted", 0) > evicted, timeout_s=15)  # the genuine room kept
    push(prefill, metas(3004))
    prefill.send(op="serve", rooms=[room(3100, list(range(10, 17)), 1, (3, 4))], timeout=30)
    served, received = prefill.read(), decode.read()
    text = logs(prefill, decode)
    check_same_pages(served, received, "3100", text)
    after = counters(prefill)
    assert after.get("early_evicted", 0) >= evicted + 5, after
    assert early(prefill) <= 4
    assert "evicted" in "".join(prefill.stderr), text


def test_keyless_replayed_registrations_cost_a_decode_one_hello_per_room_start(keyless):
    """A decode that registered with the prefill (a genuine room first) has its registration replayed to the
    prefill 1,500 times in a burst, unsigned, as a stranger can (issue 38: each REG used to queue a HELLO, and
    1,500 kept a decode busy for 1.5 s). The decode has no room in flight, so the prefill answers none of them
    (issue 49: a REG from an endpoint with no room costs the prefill one kept entry, nothing else); they are
    coalesced into one, answered once when the decode's next room starts, and that room completes byte for byte."""
    ranks = keyless
    prefill, decode = ranks.prefill, ranks.second
    decode.send(op="receive", bootstrap=ranks.bootstrap, rooms=[room(5000, list(range(20, 27)), 12)], timeout=40)
    prefill.send(op="serve", rooms=[room(5000, list(range(30, 37)), 2, (3, 4))], timeout=40)
    served, received = prefill.read(), decode.read()
    check_same_pages(served, received, "5000", logs(prefill, decode))

    def hellos() -> int:  # every HELLO the decode took apart: from a prefill it registered with, or not
        seen = counters(decode)
        return seen["hellos"] + seen["strangers"]

    before, pacing_before = hellos(), prefill.ask(op="sizes")["hellos"]
    reg = wire.encode(wire.REG, {"endpoint": rank_key(decode), "layout": decode.info["layout"]})
    push(prefill, [reg] * 1500, settle_s=0.0)
    time.sleep(2.5)  # two windows of the default pace: nothing is owed to a decode with no room here
    took = hellos() - before
    pacing = prefill.ask(op="sizes")["hellos"]
    text = logs(prefill, decode)
    assert took == 0, (f"the decode took {took} HELLOs for 1,500 replayed registrations with no room in flight",
                       pacing, text)
    assert pacing["hellos"] == pacing_before["hellos"], (pacing_before, pacing)
    assert pacing["coalesced"] - pacing_before["coalesced"] == 1499, pacing  # one kept, the rest coalesced
    assert pacing["hello_waiting"] == 0 and pacing["hello_busy"] == 0, pacing
    decode.send(op="receive", bootstrap=ranks.bootstrap, rooms=[room(5001, list(range(40, 47)), 13)], timeout=40)
    prefill.send(op="serve", rooms=[room(5001, list(range(10, 17)), 3, (3, 4))], timeout=40)
    served, received = prefill.read(), decode.read(timeout_s=60)
    check_same_pages(served, received, "5001", text)
    took = hellos() - before
    assert took == 1, f"the decode took {took} HELLOs for 1,500 replayed registrations and one room"
    print(f"1,500 replayed registrations: the decode took {took} HELLO, at its next room; prefill {pacing}")


# --- with the cluster key --------------------------------------------------------------------------------------
def test_signed_replayed_chunk_or_lease_less_failed_cannot_fail_a_live_room(keyed):
    """This process plays room 4000's decode (its metadata names a zmq socket here), so it receives the
    prefill's genuine signed CHUNKs. It replays chunk 0 unchanged to the other decode, which holds no such
    room and answers the prefill with a FAILED; and it sends a signed FAILED without a lease for the room
    (which has one). Neither may fail room 4000: the prefill takes a FAILED only from the room's decode
    with the room's lease. The room ends only with this decode's own FAILED (its endpoint, its lease),
    with that reason; room 4001, served at the same time to the other decode, completes byte for byte."""
    ranks = keyed
    prefill, other, key = ranks.prefill, ranks.second, ranks.key
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    mine = f"127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    give_up = "this test's decode gives up on room 4000"
    try:
        base = early(prefill)
        push(prefill, [key.sign(wire.encode(wire.META, {"room": 4000, "endpoint": mine}))])
        other.send(op="receive", bootstrap=ranks.bootstrap, rooms=[room(4001, list(range(40, 47)), 9)], timeout=40)
        wait_until(lambda: early(prefill) >= base + 2, what="both rooms' metadata at the prefill")
        prefill.send(op="serve", timeout=40, timing=True,
                     rooms=[room(4000, list(range(1, 8)), 0, (3, 4)), room(4001, list(range(10, 17)), 1, (3, 4))])
        captured = []
        while len(captured) < 2:
            assert pull.poll(20_000), "no CHUNK from the prefill for room 4000"
            captured.append(pull.recv_multipart())
        tag, body = wire.decode(captured[0], key)
        assert tag == wire.CHUNK and body["room"] == 4000 and body["chunk"] == 0, body
        push(other, [captured[0]])  # replayed unchanged: the other decode answers the prefill with a FAILED
        push(prefill, [key.sign(wire.encode(wire.FAILED, {"room": 4000, "endpoint": mine, "reason": "no lease"}))])
        time.sleep(0.5)
        push(prefill, [key.sign(wire.encode(wire.FAILED, {"room": 4000, "lease": body["lease"], "endpoint": mine,
                                                          "reason": give_up}))])
        served, received = prefill.read(), other.read()
    finally:
        pull.close(linger=0)
        context.term()
    text = logs(prefill, other)
    live = served["rooms"]["4000"]
    assert live["status"] == FAILED and give_up in (live["reason"] or ""), (live, text)
    check_same_pages(served, received, "4001", text)
    seen = counters(prefill)  # the other decode's answer names the chunk; the lease-less FAILED is foreign
    assert seen.get("chunk_answers", 0) >= 1 and seen.get("foreign_reports", 0) >= 1, (seen, text)


def test_signed_status_or_another_prefills_revocation_cannot_fail_a_waiting_room(keyed):
    """A room waits at a decode for its prefill. A key holder sends the decode a signed ``KVXFER_STATUS``
    ``Failed`` for it (the message kvxfer's prefill used to report failures with, bound to no peer), and
    a revocation for it in the name of another prefill: the decode drops both, and the room then
    completes byte for byte."""
    ranks = keyed
    prefill, decode, key = ranks.prefill, ranks.second, ranks.key
    base = early(prefill)
    decode.send(op="receive", bootstrap=ranks.bootstrap, rooms=[room(4100, list(range(50, 57)), 12)], timeout=40)
    wait_until(lambda: early(prefill) > base, what="room 4100's metadata at the prefill")
    revoked = [b"KVXFER_REVOKED", json.dumps({"room": 4100, "prefill": "127.0.0.1:9", "lease": None,
                                               "reason": "another prefill says the room failed"}).encode()]
    push(decode, [key.sign([b"KVXFER_STATUS", b"4100", str(FAILED).encode(), b"0", b"a forged prefill failure"]),
                  key.sign(revoked)], settle_s=1.0)
    prefill.send(op="serve", rooms=[room(4100, list(range(20, 27)), 2, (3, 4))], timeout=30)
    served, received = prefill.read(), decode.read()
    check_same_pages(served, received, "4100", logs(prefill, decode))


def test_a_chunk_the_prefill_cannot_send_fails_the_room_on_both_sides_at_once(keyed):
    """Room 4200's decode is stopped (``SIGSTOP``) after publishing its pages; a key holder then replays
    that decode's registration to the prefill thousands of times, and each answer (a HELLO) queues for
    the stopped decode until zmq refuses more (``zmq.Again``). The prefill then offers the room's two
    chunks, which zmq refuses too. The prefill fails the room at once (not at its bound, twice the
    transfer timeout), naming chunk 0, its lease revoked; once the decode runs again it learns the
    room failed, with that reason, instead of waiting for SGLang's timeout, and never says Success."""
    ranks = keyed
    prefill, decode, key = ranks.prefill, ranks.first, ranks.key
    base = early(prefill)
    decode.send(op="receive", bootstrap=ranks.bootstrap, rooms=[room(4200, list(range(30, 37)), 13)], timeout=90)
    wait_until(lambda: early(prefill) > base, what="room 4200's metadata at the prefill")
    reg = key.sign(wire.encode(wire.REG, {"endpoint": rank_key(decode), "layout": decode.info["layout"]}))
    os.kill(decode.proc.pid, signal.SIGSTOP)
    try:
        sent = 0
        while "b'KVXFER_HELLO'" not in "".join(prefill.stderr):  # the prefill's HELLOs no longer fit
            assert sent < 40_000, "zmq never refused a HELLO to the stopped decode" + logs(prefill)
            push(prefill, [reg] * 1000, settle_s=0.3)
            sent += 1000
        prefill.send(op="serve", rooms=[room(4200, list(range(30, 37)), 3, (3, 4))], timeout=40, timing=True)
        time.sleep(2.0)
    finally:
        os.kill(decode.proc.pid, signal.SIGCONT)
    served, received = prefill.read(timeout_s=90), decode.read(timeout_s=120)
    text = logs(prefill, decode)
    mine, theirs = served["rooms"]["4200"], received["rooms"]["4200"]
    assert mine["status"] == FAILED and "chunk 0" in (mine["reason"] or ""), (mine, text)
    assert mine["at_s"] < 3.0, (f"the prefill failed the room {mine['at_s']:.1f}s after the offer", mine)
    assert theirs["status"] == FAILED and "chunk 0" in (theirs["reason"] or ""), (theirs, text)
    print(f"{sent} replayed registrations; prefill failed the room after {mine['at_s']:.2f}s: {mine['reason']}; "
          f"decode: {theirs['reason']}")


def test_signed_chunk_replayed_to_its_own_decode_after_success_cannot_fail_the_room(keyed, tmp_path):
    """Issue 49: a room's own signed CHUNK, replayed to its own decode right after that decode's Success and before
    the prefill took the read-done, used to fail the room on the prefill (1/3, 4/6, 1/6 rooms over three runs):
    the decode, holding no live request for the room any more, answered with a FAILED from the room's own
    endpoint with the room's lease, and the prefill took it. The timing is made certain here: the prefill's
    read-dones are held back (a service loop running late) until the replay was taken, and the chunk is taken
    as a tap on the wire sees it. Now the decode, which read the room whole, drops the chunk (a FAILED that answers a
    chunk of a room it never held names the chunk, and the prefill does not take it: test_sglang_source_rooms.py):
    the room ends Success on both sides, byte for byte."""
    ranks = keyed
    prefill, decode, key = ranks.prefill, ranks.second, ranks.key
    tap, release = tmp_path / "chunks.jsonl", tmp_path / "release"
    stale = counters(decode)["stale_chunks"]
    prefill.ask(op="hold_read_done", tap=str(tap))
    decode.send(op="receive", bootstrap=ranks.bootstrap, rooms=[room(4300, list(range(33, 40)), 14)], timeout=60)
    prefill.send(op="together", ops=[{"op": "serve", "rooms": [room(4300, list(range(20, 27)), 4, (3, 4))],
                                      "timeout": 60},
                                     {"op": "release_read_done", "when": str(release), "timeout": 60}])
    try:
        received = decode.read(timeout_s=60)  # the decode's Success: every chunk read and its lease checked
        assert received["rooms"]["4300"]["status"] == SUCCESS, (received["rooms"], logs(prefill, decode))
        chunks = [json.loads(line) for line in tap.read_text().splitlines()]
        assert len(chunks) == 2 and all(c["endpoint"] == rank_key(decode) for c in chunks), chunks
        replay = key.sign([bytes.fromhex(part) for part in chunks[-1]["frames"]])  # as signed on the wire
        push(decode, [replay], settle_s=1.0)  # before: the decode answered the prefill with a FAILED for the room
    finally:
        release.touch()  # now the prefill takes the read-dones
    served = prefill.read(timeout_s=90)["replies"][0]
    text = logs(prefill, decode)
    assert served["rooms"]["4300"]["status"] == SUCCESS, (served["rooms"], text)
    assert served["digests"]["4300"]["pages"] == received["digests"]["4300"]["pages"], "room 4300: pages differ"
    assert counters(decode)["stale_chunks"] == stale + 1, (counters(decode), text)  # the replay came, and was dropped
