"""The coordinator's failure handling, against scripted engines over real sockets.

The engines here are plain ZeroMQ sockets speaking the wire protocol, so each test can
decide exactly when an engine stops talking or its process dies. The "decode process"
is a real child process that the test kills.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import zmq

from engine_integration.control_plane.zmq import wire
from engine_integration.control_plane.zmq.channel import ClientChannel
from engine_integration.control_plane.zmq.client import CoordinatorClient
from engine_integration.control_plane.zmq.coordinator import CoordinatorConfig, start_coordinator_process, stop_coordinator_process

META = {"schema_version": 1, "backend": "local", "dtype": "float32", "element_size": 4, "tokens_per_block": 4,
        "heads_per_partition": 2, "head_dim": 16, "num_outer": 4, "bytes_per_slice": 512}
DESCRIPTOR = {"request_id": 0, "source": "p0", "meta_index": 0, "block_ids": [3, 4], "block_hashes": [11],
              "prompt": [1, 2, 3, 4, 5], "resume_tokens": [9]}


SECRET = "coordinator-test-secret-0123456789"


class ScriptedEngine:
    """A registered engine whose every message the test sends by hand."""

    def __init__(self, address: str, role: str, identity: str, pid: int, meta: dict = META,
                 capacity: int = 64) -> None:
        self.channel = ClientChannel(address, SECRET.encode(), identity=f"{identity}/1".encode())
        self.sock = self.channel.sock
        self.identity = identity.removeprefix("d-")
        self.free = 60  # free blocks reported in heartbeats
        self.last_heartbeat = 0.0
        self.registered: "wire.Msg | None" = None
        self.send(wire.Register(role, identity, "1", pid, os.uname().nodename, "fp", [meta], capacity))
        self.registered = self.recv(5.0)

    def send(self, msg: wire.Msg) -> None:
        self.channel.send(msg)

    def heartbeat(self) -> None:
        """At most every 0.1 s, like a real engine (each one is answered with a keepalive)."""
        if time.monotonic() - self.last_heartbeat >= 0.1:
            self.last_heartbeat = time.monotonic()
            self.send(wire.Heartbeat(self.free, 0, 0, 0, 0))

    def recv(self, timeout_s: float, *, keepalive: "list[ScriptedEngine]" = ()) -> "wire.Msg | None":
        """Next message other than a keepalive; heartbeats for ``keepalive`` engines meanwhile."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for eng in keepalive:
                eng.heartbeat()
            if self.sock.poll(50):
                msg = self.channel.receive()
                if msg is not None and not (isinstance(msg, wire.Registered) and msg.ok and self.registered is not None):
                    return msg
        return None

    def expect(self, kind: type, timeout_s: float, *, keepalive: "list[ScriptedEngine]" = ()) -> "wire.Msg | None":
        """The first message of type ``kind`` within ``timeout_s`` (others are skipped), else None."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = self.recv(left, keepalive=keepalive)
            if isinstance(msg, kind):
                return msg
        return None

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture()
def coordinator():
    proc, address = start_coordinator_process(CoordinatorConfig(heartbeat_timeout_s=1.0, request_timeout_s=30,
                                                                secret=SECRET))
    yield address
    stop_coordinator_process(proc, timeout_s=5)


@pytest.fixture()
def decode_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait(10)


def _collect(client, cid, keepalive, timeout_s=5.0):
    """The client's result, while ``keepalive`` engines keep heartbeating (they must not look dead)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for eng in keepalive:
            eng.heartbeat()
        [result] = client.collect([cid], timeout_s=0.1)
        if result.error is None or "no result" not in result.error:
            return result
    raise AssertionError("no result")


def _handoff_to_decode(address, decode_pid):
    prefill = ScriptedEngine(address, "prefill", "p0", os.getpid())
    decode = ScriptedEngine(address, "decode", "d0", decode_pid)
    client = CoordinatorClient(address, secret=SECRET)
    cid = client.submit([1, 2, 3, 4, 5], 4)
    add = prefill.recv(5.0, keepalive=[decode])
    assert isinstance(add, wire.AddRequest)
    prefill.send(wire.HandoffReady(add.request_id, {**DESCRIPTOR, "request_id": add.request_id}, 0.01))
    assert isinstance(decode.recv(5.0, keepalive=[prefill]), wire.PeerMeta)
    assert isinstance(decode.recv(5.0, keepalive=[prefill]), wire.StartDecode)
    return prefill, decode, client, cid, add.request_id


def test_dead_decode_process_fails_request_and_releases_source_pins(coordinator, decode_process):
    prefill, decode, client, cid, rid = _handoff_to_decode(coordinator, decode_process.pid)
    decode_process.kill()
    decode_process.wait(10)
    release = prefill.expect(wire.Release, 5.0, keepalive=[prefill])
    assert release is not None and release.request_ids == [rid]
    result = _collect(client, cid, [prefill])
    assert "decode 'd0'" in result.error and "exited" in result.error
    decode.send(wire.Heartbeat(60, 0, 0, 0, 0))  # a removed engine is told to go away
    assert decode.expect(wire.Shutdown, 3.0) is not None


def test_silent_but_alive_decode_keeps_pins_until_its_process_is_gone(coordinator, decode_process):
    prefill, decode, client, cid, rid = _handoff_to_decode(coordinator, decode_process.pid)
    # d0 stops heartbeating, but its process lives on: its reads might still be in flight
    result = _collect(client, cid, [prefill])
    assert "no heartbeat" in result.error
    assert prefill.expect(wire.Release, 1.5, keepalive=[prefill]) is None  # the reader may still be reading
    stats = client.stats()
    assert stats.engines["d0"]["alive"] is False
    decode_process.kill()
    decode_process.wait(10)
    release = prefill.expect(wire.Release, 5.0, keepalive=[prefill])
    assert release is not None and release.request_ids == [rid]


def test_closed_connection_removes_engine_at_once_but_keeps_pins_while_its_process_lives(coordinator,
                                                                                      decode_process):
    prefill, decode, client, cid, rid = _handoff_to_decode(coordinator, decode_process.pid)
    decode.close()  # the socket is gone; the process (which may hold posted reads) is not
    t0 = time.monotonic()
    result = _collect(client, cid, [prefill])
    assert "closed its connection" in result.error and time.monotonic() - t0 < 0.9  # before the heartbeat limit
    assert prefill.expect(wire.Release, 1.0, keepalive=[prefill]) is None
    decode_process.kill()
    decode_process.wait(10)
    assert prefill.expect(wire.Release, 5.0, keepalive=[prefill]).request_ids == [rid]


def test_registration_refused_with_reason_and_read_done_forwarded(coordinator):
    prefill = ScriptedEngine(coordinator, "prefill", "p0", os.getpid())
    bad = ScriptedEngine(coordinator, "decode", "d1", os.getpid(), meta={**META, "dtype": "bfloat16"})
    assert isinstance(bad.registered, wire.Registered) and not bad.registered.ok
    assert "'dtype' is 'bfloat16' here but 'float32'" in bad.registered.reason
    decode = ScriptedEngine(coordinator, "decode", "d0", os.getpid())
    client = CoordinatorClient(coordinator, secret=SECRET)
    cid = client.submit([1, 2, 3, 4, 5], 2)
    add = prefill.recv(5.0, keepalive=[decode])
    prefill.send(wire.HandoffReady(add.request_id, {**DESCRIPTOR, "request_id": add.request_id}, 0.01))
    decode.recv(5.0, keepalive=[prefill])
    start = decode.recv(5.0, keepalive=[prefill])
    decode.send(wire.TransferReady(start.request_id, 0, 2, 0.001))
    decode.send(wire.ReadDone(start.request_id))
    assert prefill.expect(wire.Release, 5.0, keepalive=[decode]) is not None
    decode.send(wire.Finished(start.request_id, [9, 8]))
    [result] = client.collect([cid], timeout_s=5)
    assert result.tokens == (9, 8) and result.pulled_blocks == 2


def test_engine_can_spawn_its_own_coordinator():
    from engine_integration.engine import DisaggDynamicInferenceEngine
    from engine_integration.reference import ModelConfig, build_reference_engine

    engine = build_reference_engine(ModelConfig(), 32, engine_cls=DisaggDynamicInferenceEngine)
    engine.set_disaggregation_config(role="prefill", identity="p-spawn", spawn_coordinator=True,
                                     coordinator_group=CoordinatorConfig(heartbeat_timeout_s=5.0, secret=SECRET))
    try:
        engine.connect(backend="local", register_timeout_s=20)
        client = CoordinatorClient(engine.spawned_coordinator.url, secret=SECRET)
        stats = client.stats()
        assert stats.engines["p-spawn"]["role"] == "prefill" and stats.engines["p-spawn"]["alive"]
        client.close()
        proc = engine.spawned_coordinator.process
    finally:
        engine.disconnect("test over")
    assert proc.poll() is not None  # the spawned coordinator is stopped with its engine


def test_decode_chosen_by_prefix_match_then_free_blocks(coordinator):
    prefill = ScriptedEngine(coordinator, "prefill", "p0", os.getpid())
    small = ScriptedEngine(coordinator, "decode", "d-small", os.getpid())
    big = ScriptedEngine(coordinator, "decode", "d-big", os.getpid())
    small.free, big.free = 10, 60
    everyone = [prefill, small, big]
    client = CoordinatorClient(coordinator, secret=SECRET)

    def route(hashes):
        prompt = list(range(1, 4 * len(hashes) + 2))  # len(hashes) full blocks and a partial one
        client.submit(prompt, 2)
        add = prefill.expect(wire.AddRequest, 5.0, keepalive=everyone)
        prefill.send(wire.HandoffReady(add.request_id, {**DESCRIPTOR, "request_id": add.request_id, "prompt": prompt,
                                                        "block_ids": list(range(3, 4 + len(hashes))),
                                                        "block_hashes": hashes}, 0.01))
        got = {e.identity: e.expect(wire.StartDecode, 0.5, keepalive=everyone) for e in (small, big)}
        return [name for name, msg in got.items() if msg is not None]

    prefill.expect(wire.Shutdown, 0.3, keepalive=everyone)  # (nothing comes) heartbeats carry the free counts
    assert route([11]) == ["big"]                # most free blocks
    small.free = 100                             # now the small one has more room...
    prefill.expect(wire.Shutdown, 0.3, keepalive=everyone)
    assert route([11, 12]) == ["big"]            # ...but the big one holds the prefix
    assert route([99]) == ["small"]              # no prefix anywhere: most free blocks


def test_unauthenticated_frames_are_dropped_and_counted(coordinator):
    """No secret, or the wrong one: the coordinator never parses the frame, never registers the engine."""
    register = wire.Register(role="decode", identity="intruder", incarnation="1", pid=os.getpid(), host="x",
                             model_fingerprint="m", transfer_meta=[META], capacity_blocks=8)
    plain = ClientChannel(coordinator, None, curve=False)  # no CURVE, no session: a plain JSON frame
    plain.send(register)
    assert plain.sock.poll(1000) == 0  # no answer at all
    plain.close()
    with pytest.raises(Exception, match="handshake"):  # the wrong secret cannot even complete CURVE
        ClientChannel(coordinator, b"another-secret-of-enough-bytes", handshake_timeout_s=1.0)
    client = CoordinatorClient(coordinator, secret=SECRET)
    stats = client.stats()
    assert "intruder" not in stats.engines and stats.dropped_frames >= 2
    client.close()


def test_request_no_decode_pool_can_hold_is_refused_at_submit_and_does_not_block_others(coordinator):
    """Finding 5: prompt 5 + 3000 new tokens needs 751 blocks; the only decode pool has 512."""
    prefill = ScriptedEngine(coordinator, "prefill", "p0", os.getpid(), capacity=1024)
    decode = ScriptedEngine(coordinator, "decode", "d0", os.getpid(), capacity=512)
    client = CoordinatorClient(coordinator, secret=SECRET)
    t0 = time.monotonic()
    blocker = client.submit([1, 2, 3, 4, 5], 3000)
    [result] = client.collect([blocker], timeout_s=5)
    assert time.monotonic() - t0 < 2.0
    assert "refused at submit" in result.error and "751 KV blocks" in result.error and "512 blocks" in result.error
    client.submit([1, 2, 3, 4, 5], 4)  # a normal request right behind it goes straight to the prefill
    assert isinstance(prefill.expect(wire.AddRequest, 2.0, keepalive=[decode]), wire.AddRequest)


def test_presumed_dead_reader_frees_checked_pins_after_the_grace_only():
    """Finding 6: a decode silent past ``pin_grace_s`` (death unconfirmed) frees the pins of requests
    whose reads are torn-read checked (generations in the descriptor), and only those."""
    proc, address = start_coordinator_process(CoordinatorConfig(heartbeat_timeout_s=2.0, pin_grace_s=1.0,
                                                                secret=SECRET))
    decode_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        prefill = ScriptedEngine(address, "prefill", "p0", os.getpid())
        decode = ScriptedEngine(address, "decode", "d0", decode_proc.pid)
        client = CoordinatorClient(address, secret=SECRET)
        rids = []
        for generations in ([5, 6], []):
            client.submit([1, 2, 3, 4, 5], 4)
            add = prefill.expect(wire.AddRequest, 5.0, keepalive=[decode])
            prefill.send(wire.HandoffReady(add.request_id, {**DESCRIPTOR, "request_id": add.request_id,
                                                            "generations": generations}, 0.01))
            assert decode.expect(wire.StartDecode, 5.0, keepalive=[prefill]) is not None
            rids.append(add.request_id)
        t0 = time.monotonic()  # d0 goes silent now; its process lives on (as a SIGSTOPped one would)
        assert prefill.expect(wire.Release, 1.0, keepalive=[prefill]) is None  # within the grace: kept
        release = prefill.expect(wire.Release, 5.0, keepalive=[prefill])
        assert release is not None and release.request_ids == [rids[0]] and time.monotonic() - t0 > 1.4
        assert prefill.expect(wire.Release, 1.0, keepalive=[prefill]) is None  # unchecked: kept until death
        decode_proc.kill()
        decode_proc.wait(10)
        assert prefill.expect(wire.Release, 5.0, keepalive=[prefill]).request_ids == [rids[1]]
    finally:
        decode_proc.kill()
        decode_proc.wait(10)
        stop_coordinator_process(proc, timeout_s=5)


@pytest.mark.parametrize("prompt, max_new, says", [
    ([1, -5, 3], 4, "token ids must be ints in [0, 2147483648); got [-5]"),
    ([1, 1 << 31], 4, "token ids must be ints in [0, 2147483648)"),
    ([1, 2, 3], (1 << 20) + 1, "max_new_tokens must be <= 1048576"),
])
def test_a_submit_the_prefill_would_drop_is_refused_at_submit_with_the_reason(coordinator, prompt, max_new, says):
    """Issue 21, A9: a Submit whose relayed AddRequest the prefill's schema would drop (negative token
    ids, ids past the wire's bound, too many new tokens) is answered at once with the reason; before,
    the client waited for its timeout ("stage: prefill") while the prefill silently dropped it."""
    prefill = ScriptedEngine(coordinator, "prefill", "p0", os.getpid(), capacity=1 << 20)
    decode = ScriptedEngine(coordinator, "decode", "d0", os.getpid(), capacity=1 << 20)
    client = CoordinatorClient(coordinator, secret=SECRET)
    t0 = time.monotonic()
    result = _collect(client, client.submit(prompt, max_new), [prefill, decode], timeout_s=3.0)
    answered_s = time.monotonic() - t0
    assert result.error is not None and "refused at submit" in result.error and says in result.error, result.error
    assert answered_s < 1.0
    assert prefill.expect(wire.AddRequest, 0.5, keepalive=[decode]) is None   # nothing relayed
    client.submit([1, 2, 3], 2)   # the next request goes through
    assert isinstance(prefill.expect(wire.AddRequest, 2.0, keepalive=[decode]), wire.AddRequest)
    client.close()


@pytest.mark.parametrize("meta", [{**META, "dtype": "bfloat16"}, META], ids=["incompatible", "compatible"])
def test_reregistering_a_live_decode_from_another_host_is_refused_and_frees_no_pin(coordinator, decode_process,
                                                                                   meta):
    """Issue 21, A7: an insider registers a live decode's identity "from another host". Before, the
    registration was refused (incompatible) or accepted (compatible), and either way the prefill got
    a Release for the live decode's routed request: its pins freed under a reader. Now it is refused
    before anything changes, and the live decode's handoff completes as if nothing happened."""
    prefill, decode, client, cid, rid = _handoff_to_decode(coordinator, decode_process.pid)
    insider = ClientChannel(coordinator, SECRET.encode(), identity=b"d0/2")
    insider.send(wire.Register("decode", "d0", "2", 4242, "another-host", "fp", [meta], 64))
    reply = insider.recv(5.0)
    assert isinstance(reply, wire.Registered) and not reply.ok, reply
    if meta is META:
        assert "'d0' is registered and alive" in reply.reason and "heartbeat_timeout_s" in reply.reason
    assert prefill.expect(wire.Release, 1.5, keepalive=[prefill, decode]) is None, "a live reader's pins were freed"
    stats = client.stats()
    assert stats.engines["d0"]["alive"] and stats.engines["d0"]["incarnation"] == "1"
    decode.send(wire.TransferReady(rid, 0, 2, 0.001))   # the real d0 finishes its pull
    decode.send(wire.ReadDone(rid))
    release = prefill.expect(wire.Release, 5.0, keepalive=[prefill, decode])
    assert release is not None and release.request_ids == [rid]
    decode.send(wire.Finished(rid, [9, 8, 7, 6]))
    assert _collect(client, cid, [prefill, decode]).tokens == (9, 8, 7, 6)
    insider.close()


def test_a_stuck_reader_costs_its_requests_pins_for_a_bounded_time_only():
    """Issue 21, "a stuck reader": a live decode (heartbeating) that never reads its routed requests
    kept their source pins forever: the request timed out and was aborted, but no Release ever came.
    Now, ``stuck_reader_grace_s`` after the abort, the pins of a torn-read-checked request are freed (a
    late read fails its check) and an unchecked one's are kept, counted in ``Stats.stuck_requests``."""
    timeout_s, grace_s = 1.0, 1.0
    proc, address = start_coordinator_process(CoordinatorConfig(heartbeat_timeout_s=2.0, request_timeout_s=timeout_s,
                                                                stuck_reader_grace_s=grace_s, secret=SECRET))
    try:
        prefill = ScriptedEngine(address, "prefill", "p0", os.getpid())
        decode = ScriptedEngine(address, "decode", "d0", os.getpid())
        client = CoordinatorClient(address, secret=SECRET)
        rids, cids = [], []
        for generations in ([5, 6], []):
            cids.append(client.submit([1, 2, 3, 4, 5], 4))
            add = prefill.expect(wire.AddRequest, 5.0, keepalive=[decode])
            prefill.send(wire.HandoffReady(add.request_id, {**DESCRIPTOR, "request_id": add.request_id,
                                                            "generations": generations}, 0.01))
            assert decode.expect(wire.StartDecode, 5.0, keepalive=[prefill]) is not None
            rids.append(add.request_id)
        t0 = time.monotonic()   # d0 heartbeats but never reads, never answers its Aborts
        results = [_collect(client, cid, [prefill, decode], timeout_s=5.0) for cid in cids]
        assert all("timed out" in r.error for r in results), results
        release = prefill.expect(wire.Release, 5.0, keepalive=[prefill, decode])
        freed_s = time.monotonic() - t0
        print(f"\nMEASURED stuck reader: request failed at its {timeout_s}s timeout, checked pins freed "
              f"{freed_s:.2f}s after the handoff (timeout {timeout_s}s + grace {grace_s}s)")
        assert release is not None and release.request_ids == [rids[0]]
        assert timeout_s + grace_s - 0.1 < freed_s < timeout_s + grace_s + 2.0
        assert prefill.expect(wire.Release, 1.0, keepalive=[prefill, decode]) is None   # unchecked: kept
        stats = client.stats()
        assert stats.stuck_requests == 1 and stats.engines["d0"]["alive"]
        decode.send(wire.ReadDone(rids[1]))    # the reader reports at last: the rest is released
        assert prefill.expect(wire.Release, 5.0, keepalive=[prefill, decode]).request_ids == [rids[1]]
        assert client.stats().stuck_requests == 0
        client.close()
    finally:
        stop_coordinator_process(proc, timeout_s=5)
