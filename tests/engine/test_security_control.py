"""The control plane under attack: replay, reflection, forged and malformed messages, big frames, floods.

Written from the security review (issue 15, findings 1, 2, 4, 5, 7). The coordinator
runs in a thread of this process where a test needs its logs or speed, and as a real
process where argv and the wire matter.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import asdict

import pytest
import zmq

from engine_integration import procs
from engine_integration.control_plane.zmq import wire
from engine_integration.control_plane.zmq.channel import ClientChannel, InsecureNotRequested
from engine_integration.control_plane.zmq.client import CoordinatorClient
from engine_integration.control_plane.zmq.coordinator import (Coordinator, CoordinatorConfig, start_coordinator_process,
                                            stop_coordinator_process)
from kvxfer.errors import AuthenticationError
from kvxfer.security.auth import (CLIENT_TO_SERVER, FrameDropped, SessionClient, SessionServer)

SECRET = "security-test-secret-0123456789abcdef"
KEY = SECRET.encode()
META = {"schema_version": 1, "backend": "local", "dtype": "float32", "element_size": 4, "tokens_per_block": 4,
        "heads_per_partition": 2, "head_dim": 16, "num_outer": 4, "bytes_per_slice": 512}


def _register(identity: str, role: str = "decode", capacity: int = 64) -> wire.Register:
    return wire.Register(role, identity, "1", os.getpid(), socket.gethostname(), "fp", [META], capacity)


class RecordingChannel(ClientChannel):
    """A client channel that keeps every frame it sends and receives, exactly as on the socket."""

    def __init__(self, *args, **kwargs) -> None:
        self.sent: list[bytes] = []
        self.received: list[bytes] = []
        super().__init__(*args, **kwargs)

    def _handshake(self, client: SessionClient, timeout_s: float) -> None:
        self.sent.append(client.hello())
        super()._handshake(client, timeout_s)

    def send(self, msg: wire.Msg) -> None:
        frame = self.session.seal(wire.encode(msg))
        self.sent.append(frame)
        self.sock.send(frame)

    def receive(self):
        frame = self.sock.recv()
        self.received.append(frame)
        try:
            return wire.decode(self.session.open(frame))
        except FrameDropped:
            return None


@pytest.fixture()
def coordinator():
    """An in-process coordinator on a thread: (coordinator, address)."""
    coord = Coordinator(CoordinatorConfig(secret=SECRET, heartbeat_timeout_s=5.0, max_connections=6))
    thread = threading.Thread(target=coord.serve, daemon=True)
    thread.start()
    yield coord, coord.address
    coord.stop()
    thread.join(10)


def _stats(address: str) -> wire.Stats:
    client = CoordinatorClient(address, secret=SECRET)
    try:
        return client.stats(5.0)
    finally:
        client.close()


# --- sessions (finding 1) ------------------------------------------------------------------
def test_session_drops_replayed_reordered_reflected_and_foreign_frames():
    server = SessionServer(KEY)
    hello_client = SessionClient(KEY, b"engine/1")
    welcome, server_side = server.accept(b"engine/1", hello_client.hello())
    client_side = hello_client.finish(welcome)
    f1, f2, f3 = (client_side.seal(b"m%d" % i) for i in range(3))
    assert server_side.open(f1) == b"m0"
    assert server_side.open(f3) == b"m2"          # a skipped counter is fine (a dropped frame)...
    for frame, reason in ((f2, "replayed"), (f1, "replayed")):   # ...going back is not
        with pytest.raises(FrameDropped, match=reason):
            server_side.open(frame)
    back = server_side.seal(b"to the client")
    with pytest.raises(FrameDropped, match="reflected"):
        server_side.open(back)                     # the server's own frame, bounced back to it
    assert client_side.open(back) == b"to the client"
    # a second connection of the same peer (or a restarted server) has another key
    other_client = SessionClient(KEY, b"engine/1")
    welcome2, server_side2 = server.accept(b"engine/1", other_client.hello())
    with pytest.raises(FrameDropped, match="forged"):
        server_side2.open(client_side.seal(b"from the old session"))
    assert server_side.dropped == {"replayed": 2, "reflected": 1}
    # a hello replayed from another connection (another routing id) is refused outright
    with pytest.raises(FrameDropped, match="forged"):
        server.accept(b"attacker", hello_client.hello())
    with pytest.raises(AuthenticationError):  # a welcome for another hello does not finish ours
        SessionClient(KEY, b"engine/1").finish(welcome)


def test_captured_frames_replayed_from_a_fresh_connection_are_ignored(coordinator):
    coord, address = coordinator
    victim = RecordingChannel(address, KEY, identity=b"d0/1")
    victim.send(_register("d0"))
    assert isinstance(victim.recv(5.0), wire.Registered)
    victim.send(wire.Heartbeat(60, 0, 0, 0, 0))
    victim.send(wire.StatsRequest())
    assert isinstance(victim.recv(5.0), (wire.Registered, wire.Stats))
    shutdown = victim.session.seal(wire.encode(wire.Shutdown("captured")))  # sealed for d0's session only
    captured = victim.sent + [shutdown]

    # 1) without the secret: no CURVE handshake can complete, nothing reaches the coordinator
    raw = ClientChannel(address, None)
    for frame in captured:
        raw.send_frame(frame)
    assert raw.sock.poll(1000) == 0, "a replayed frame was answered"
    raw.close()
    # 2) a fresh connection that *does* hold the key (an insider, or a stolen one) gains nothing either
    insider = RecordingChannel(address, KEY, identity=b"mallory/1")
    for frame in captured:
        insider.send_frame(frame)
    assert insider.sock.poll(1000) == 0
    insider.close()
    # 3) within the victim's own connection: replays and reflections are dropped
    for frame in captured[1:4]:
        victim.send_frame(frame)
    victim.send_frame(victim.received[0])  # the coordinator's Registered, reflected
    time.sleep(0.3)
    stats = _stats(address)
    assert set(stats.engines) == {"d0"} and stats.engines["d0"]["alive"]
    assert not coord._stop, "a replayed shutdown stopped the coordinator"
    assert stats.dropped.get("forged", 0) == len(captured)  # the insider's replays, its replayed hello included
    assert stats.dropped.get("replayed") == 3 and stats.dropped.get("reflected") == 1
    assert stats.dropped.get("handshake failed", 0) >= 1  # the keyless CURVE attempt
    victim.close()


class _TcpRecorder:
    """A TCP proxy that records what the client sends, byte for byte (the attacker's wire tap)."""

    def __init__(self, target_port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target_port = target_port
        self.client_bytes = bytearray()
        threading.Thread(target=self._run, daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    self.client_bytes += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _run(self) -> None:
        conn, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        threading.Thread(target=self._pump, args=(conn, upstream, True), daemon=True).start()
        self._pump(upstream, conn, False)


def test_bytes_tapped_on_the_wire_replay_to_nothing_and_are_encrypted():
    """A whole client session, tapped on TCP, replayed byte for byte into a fresh connection."""
    proc, address = start_coordinator_process(CoordinatorConfig(secret=SECRET))
    try:
        port = int(address.rsplit(":", 1)[1])
        tap = _TcpRecorder(port)
        client = CoordinatorClient(f"tcp://127.0.0.1:{tap.port}", secret=SECRET)
        client.submit([11, 12, 13, 14, 15], 3)
        assert client.stats().requests_in_flight == 1
        client.close()
        time.sleep(0.2)
        assert b"submit" not in tap.client_bytes and b"stats_request" not in tap.client_bytes  # CURVE: ciphertext
        replay = socket.create_connection(("127.0.0.1", port))
        replay.sendall(bytes(tap.client_bytes))
        replay.settimeout(1.0)
        answer = b""
        try:
            while chunk := replay.recv(65536):
                answer += chunk
        except (socket.timeout, OSError):
            pass
        replay.close()
        assert len(answer) < 400, "the coordinator answered more than a handshake"
        stats = _stats(address)
        assert stats.requests_in_flight == 1, "the replayed submit was accepted again"
        assert stats.dropped.get("handshake failed", 0) >= 1
    finally:
        stop_coordinator_process(proc, timeout_s=5)


# --- secrets (finding 2) -------------------------------------------------------------------
def test_no_secret_means_no_coordinator_unless_insecure_by_name(monkeypatch, caplog):
    monkeypatch.delenv("KVXFER_SECRET_FILE", raising=False)
    with pytest.raises(InsecureNotRequested, match="insecure=True"):
        Coordinator(CoordinatorConfig())
    with pytest.raises(InsecureNotRequested):
        start_coordinator_process(CoordinatorConfig())
    with pytest.raises(InsecureNotRequested):
        CoordinatorClient("tcp://127.0.0.1:1")
    with caplog.at_level(logging.WARNING, logger="engine_integration"):
        coord = Coordinator(CoordinatorConfig(insecure=True))
    coord.channel.close()
    coord.ctx.term()
    assert "WITHOUT authentication" in caplog.text


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read()


def test_secrets_never_in_argv_of_spawned_processes(tmp_path):
    proc, address = start_coordinator_process(CoordinatorConfig(secret=SECRET))
    try:
        assert SECRET.encode() not in _cmdline(proc.pid)
        from engine_integration.worker import EngineSpec

        spec = EngineSpec(role="decode", identity="d-argv", num_blocks=8, secret=SECRET)
        host = procs.launch("engine_integration.worker", {"address": address, "specs": [asdict(spec)]})
        try:
            assert SECRET.encode() not in _cmdline(host.pid)
        finally:
            host.kill()
            host.wait(10)
            procs._READY_FDS.pop(host.pid, None)
    finally:
        stop_coordinator_process(proc, timeout_s=5)


def test_spawned_coordinator_gets_a_private_secret_file(monkeypatch):
    from engine_integration.engine import DisaggDynamicInferenceEngine
    from engine_integration.reference import ModelConfig, build_reference_engine

    monkeypatch.delenv("KVXFER_SECRET_FILE", raising=False)
    engine = build_reference_engine(ModelConfig(), 24, engine_cls=DisaggDynamicInferenceEngine)
    engine.set_disaggregation_config(role="prefill", identity="p-own", spawn_coordinator=True,
                                     coordinator_group=None)
    try:
        path = engine.coordinator_secret_file
        assert path is not None and os.stat(path).st_mode & 0o777 == 0o600
        secret = open(path).read().strip()
        assert secret.encode() not in _cmdline(engine.spawned_coordinator.process.pid)
        engine.connect(backend="local", register_timeout_s=20)
        with pytest.raises(AuthenticationError):  # no stats, no shutdown, for anyone without the file
            ClientChannel(engine.spawned_coordinator.url, b"not-the-cluster-secret-at-all", handshake_timeout_s=1.0)
        client = CoordinatorClient(engine.spawned_coordinator.url, secret_file=path)
        assert client.stats().engines["p-own"]["alive"]
        client.close()
    finally:
        engine.disconnect("test over")
    assert not os.path.exists(path)


# --- insiders (finding 4) and limits (finding 7) ----------------------------------------------
def test_malformed_messages_from_an_authenticated_engine_are_refused_and_counted(coordinator):
    coord, address = coordinator
    prefill = ClientChannel(address, KEY, identity=b"p0/1")
    prefill.send(_register("p0", role="prefill"))
    assert isinstance(prefill.recv(5.0), wire.Registered)
    client = CoordinatorClient(address, secret=SECRET)
    cid = client.submit([1, 2, 3, 4, 5], 3)
    add = prefill.recv(5.0)
    assert isinstance(add, wire.AddRequest)
    good = {"request_id": add.request_id, "source": "p0", "meta_index": 0, "block_ids": [3, 4],
            "block_hashes": [11], "prompt": [1, 2, 3, 4, 5], "resume_tokens": [9]}
    missing_hashes = {k: v for k, v in good.items() if k != "block_hashes"}
    bad = [missing_hashes, {**good, "prompt": []}, {**good, "resume_tokens": []}, {**good, "block_ids": [-1, 4]},
           {**good, "source": "p1"}, {**good, "block_ids": [3]}, {**good, "meta_index": 7}, {**good, "extra": 1}]
    for descriptor in bad:
        prefill.sock.send(prefill.session.seal(wire.encode(wire.HandoffReady(add.request_id, descriptor, 0.1))))
    for junk in (b"{", b'{"type": "handoff"}', b'{"type": "heartbeat", "free_blocks": -1, "pinned_blocks": 0, '
                 b'"pins": 0, "queued": 0, "running": 0}', b"[" * 5000):
        prefill.sock.send(prefill.session.seal(junk))
    prefill.send(wire.ReadDone(add.request_id))  # not the prefill's to say
    time.sleep(0.3)
    stats = client.stats()
    assert stats.dropped.get("invalid", 0) == 5 + 4 and stats.dropped.get("refused", 0) == 3 + 1
    assert not coord._stop and stats.requests_in_flight == 1
    # the coordinator still works: the real handoff goes through
    decode = ClientChannel(address, KEY, identity=b"d0/1")
    decode.send(_register("d0"))
    prefill.send(wire.HandoffReady(add.request_id, good, 0.1))
    got = [decode.recv(5.0) for _ in range(3)]
    assert any(isinstance(m, wire.StartDecode) and m.descriptor.block_hashes == [11] for m in got)
    for ch in (prefill, decode):
        ch.close()
    client.close()
    assert cid == 1


def test_wire_refuses_a_start_decode_with_an_empty_prompt():
    d = {"request_id": 1, "source": "p0", "meta_index": 0, "block_ids": [1], "block_hashes": [], "prompt": [],
         "resume_tokens": [3]}
    with pytest.raises(wire.WireError, match="prompt"):
        wire.decode(wire.encode(wire.StartDecode(1, d, 4)))
    with pytest.raises(wire.WireError, match="resume tokens"):
        wire.decode(wire.encode(wire.StartDecode(1, {**d, "prompt": [5], "resume_tokens": [3, 4]}, 1)))


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


def test_big_frames_are_dropped_before_buffering_and_the_loop_keeps_serving():
    proc, address = start_coordinator_process(CoordinatorConfig(secret=SECRET, max_frame_bytes=1 << 20))
    try:
        rss0 = _rss_kib(proc.pid)
        big = b"x" * (64 << 20)
        senders = [ClientChannel(address, KEY) for _ in range(2)]
        t0 = time.monotonic()
        for ch in senders:
            ch.send_frame(big)
        client = CoordinatorClient(address, secret=SECRET)
        client.stats(5.0)
        answered_s = time.monotonic() - t0
        time.sleep(0.5)
        growth_mib = (_rss_kib(proc.pid) - rss0) / 1024
        assert growth_mib < 16, f"the coordinator buffered the big frames: +{growth_mib:.0f} MiB"
        assert answered_s < 3.0
        for ch in senders:
            ch.close()
        client.close()
    finally:
        stop_coordinator_process(proc, timeout_s=5)


def test_connection_cap_refuses_more_with_a_log_line(coordinator, caplog):
    coord, address = coordinator  # max_connections=6
    with caplog.at_level(logging.ERROR, logger="engine_integration"):
        channels = [ClientChannel(address, KEY, handshake_timeout_s=2.0) for _ in range(6)]
        with pytest.raises(AuthenticationError):
            ClientChannel(address, KEY, handshake_timeout_s=1.0)
    assert "connection cap reached" in caplog.text
    channels.pop().close()
    time.sleep(0.3)
    ClientChannel(address, KEY, handshake_timeout_s=2.0).close()  # room again
    for ch in channels:
        ch.close()


def test_decode_engine_survives_malformed_and_unserviceable_start_decodes():
    """Finding 4, decode side: the refused message is counted, a request it names is failed, the loop lives."""
    from engine_integration.control_plane.zmq.channel import ServerChannel
    from engine_integration.engine import DisaggDynamicInferenceEngine
    from engine_integration.reference import ModelConfig, build_reference_engine

    ctx = zmq.Context()
    server = ServerChannel(ctx, "127.0.0.1", 0, KEY)
    engine = build_reference_engine(ModelConfig(), 24, engine_cls=DisaggDynamicInferenceEngine)
    engine.set_disaggregation_config(role="decode", identity="d-victim", spawn_coordinator=False,
                                     coordinator_group=f"tcp://127.0.0.1:{server.port}")
    connected = threading.Thread(target=engine.connect, kwargs=dict(backend="local", secret=SECRET,
                                                                     register_timeout_s=10))
    connected.start()
    peer, deadline = None, time.monotonic() + 10
    while peer is None and time.monotonic() < deadline:
        server.events()
        if server.sock.poll(50):
            got = server.receive()
            if got is not None and isinstance(got[1], wire.Register):
                peer = got[0]
                server.send(peer, wire.Registered(True))
    connected.join(10)
    try:
        empty = {"request_id": 7, "source": "p0", "meta_index": 0, "block_ids": [1], "block_hashes": [],
                 "prompt": [], "resume_tokens": [3]}
        server.send(peer, wire.StartDecode(7, empty, 4))                        # schema: refused
        ok = {**empty, "prompt": [1, 2, 3]}
        server.send(peer, wire.StartDecode(8, {**ok, "request_id": 8}, 4))      # fine, source unknown: queued
        server.send(peer, wire.Release([8], "a prefill's message sent to a decode"))  # its handler raises
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (len(engine.plane.refused_messages) < 2
                                               or not engine._handoff_sink.num_queued):
            engine.serve_step()
            time.sleep(0.01)
        assert engine.shutdown_reason is None
        refused = engine.plane.refused_messages
        assert refused.get("invalid") == 1 and refused.get("handler error") == 1
        assert engine._handoff_sink.num_queued == 1
    finally:
        engine.disconnect("test over")
        server.close()
        ctx.term()


def _nested(depth: int) -> list:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value  # type: ignore[return-value]


def test_an_insiders_deeply_nested_frame_costs_one_frame_not_the_coordinator():
    """Issue 21, A6: a 4 KB frame nested 2,000 deep, sealed with the cluster secret, used to make the
    coordinator process exit (RecursionError in the decoder). Every message's depth and size are now
    bounded before it is decoded (control_plane.limits): the frame is refused as invalid and counted."""
    proc, address = start_coordinator_process(CoordinatorConfig(secret=SECRET))
    try:
        insider = ClientChannel(address, KEY, identity=b"mallory/1")
        frames = []
        for depth in (2000, 30):   # far past, and just past, the bound (32 levels: 3 + 30 here)
            register = wire.encode(wire.Register("decode", "mallory", "1", os.getpid(), socket.gethostname(), "fp",
                                                 [{"deep": "X"}], 8))
            frames.append(register.replace(b'"X"', b"[" * depth + b"1" + b"]" * depth))
        frames.append(b'{"type":"submit","client_request_id":1,"prompt":' + b"[" * 3000 + b"]" * 3000
                      + b',"max_new_tokens":2}')
        assert 4000 < len(frames[0]) < 4200
        t0 = time.monotonic()
        for frame in frames:
            insider.sock.send(insider.session.seal(frame))
        stats = _stats(address)
        assert proc.poll() is None, f"the coordinator exited with status {proc.returncode}"
        assert stats.dropped.get("invalid", 0) == len(frames) and "mallory" not in stats.engines
        assert time.monotonic() - t0 < 3.0
        # a meta as deep as the bound allows still registers, and the coordinator keeps serving
        decode = ClientChannel(address, KEY, identity=b"d0/1")
        decode.send(wire.Register("decode", "d0", "1", os.getpid(), socket.gethostname(), "fp",
                                  [{**META, "nested": _nested(29)}], 8))   # 3 + 29 = 32: at the bound
        reply = decode.recv(5.0)
        assert isinstance(reply, wire.Registered) and reply.ok
        assert _stats(address).engines["d0"]["alive"]
        for ch in (insider, decode):
            ch.close()
    finally:
        stop_coordinator_process(proc, timeout_s=5)


def test_engine_and_client_refuse_a_deeply_nested_message_from_the_coordinator_side():
    """A6, the other direction: an insider posing as the coordinator sends a PeerMeta nested 2,000
    deep to a decode engine, and a Stats nested as deep to a client: each is refused and counted."""
    from engine_integration.control_plane.zmq.channel import ServerChannel
    from engine_integration.engine import DisaggDynamicInferenceEngine
    from engine_integration.reference import ModelConfig, build_reference_engine

    ctx = zmq.Context()
    server = ServerChannel(ctx, "127.0.0.1", 0, KEY)
    engine = build_reference_engine(ModelConfig(), 24, engine_cls=DisaggDynamicInferenceEngine)
    connected = threading.Thread(target=engine.connect, args=(f"tcp://127.0.0.1:{server.port}",),
                                 kwargs=dict(role="decode", name="d-victim", backend="local", secret=SECRET,
                                             register_timeout_s=10))
    connected.start()
    peers, deadline = {}, time.monotonic() + 10
    client = None
    try:
        while "engine" not in peers and time.monotonic() < deadline:
            server.events()
            if server.sock.poll(50):
                got = server.receive()
                if got is not None and isinstance(got[1], wire.Register):
                    peers["engine"] = got[0]
                    server.send(got[0], wire.Registered(True))
        connected.join(10)
        deep = b"[" * 2000 + b"]" * 2000
        peer_meta = b'{"type":"peer_meta","identity":"p0","incarnation":"1","transfer_meta":[{"a":' + deep + b"}]}"
        server._send_raw(peers["engine"], server._sessions[peers["engine"]].seal(peer_meta))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not engine.plane.refused_messages.get("invalid"):
            engine.serve_step()
            time.sleep(0.01)
        assert engine.plane.refused_messages.get("invalid") == 1 and engine.shutdown_reason is None

        client_thread = threading.Thread(target=lambda: peers.setdefault(
            "client", CoordinatorClient(f"tcp://127.0.0.1:{server.port}", secret=SECRET)))
        client_thread.start()
        while client_thread.is_alive():
            server.events()
            if server.sock.poll(50):
                server.receive()   # the client's hello: answered with the welcome
        client = peers["client"]
        client.channel.send(wire.StatsRequest())
        while not server.sock.poll(50):
            pass
        who, _, _ = server.receive()
        stats = b'{"type":"stats","engines":{"x":{"a":' + deep + b'}},"requests_in_flight":0}'
        server._send_raw(who, server._sessions[who].seal(stats))
        with pytest.raises(TimeoutError):
            client.stats(timeout_s=1.0)
        assert client.channel.dropped.get("invalid") == 1
    finally:
        if client is not None:
            client.close()
        engine.disconnect("test over")
        server.close()
        ctx.term()


def test_a_flood_of_idle_unauthenticated_connections_does_not_lock_clients_out():
    """Issue 21, A8: 600 idle TCP connections (no handshake, never a byte) used to fill the connection
    cap (512, counted over every TCP connection) and lock authenticated clients out until libzmq
    closed them at the handshake timeout. The cap now counts authenticated connections only; the
    flood costs a file descriptor each, for handshake_timeout_s at most, and is re-opened by the
    attacker as fast as it is shed."""
    handshake_s = 2.0
    proc, address = start_coordinator_process(CoordinatorConfig(secret=SECRET, handshake_timeout_s=handshake_s))
    port = int(address.rsplit(":", 1)[1])
    flood: list[socket.socket] = []
    stop = threading.Event()
    shed_after: list[float] = []   # how long the coordinator kept an idle connection open

    def keep_flooding() -> None:
        opened = {}
        for _ in range(600):
            s = socket.create_connection(("127.0.0.1", port))
            s.setblocking(False)
            flood.append(s)
            opened[s] = time.monotonic()
        while not stop.wait(0.05):
            for i, s in enumerate(flood):
                try:
                    if s.recv(1) == b"":   # closed by the coordinator: count it and come back
                        shed_after.append(time.monotonic() - opened.pop(s))
                        s.close()
                        fresh = socket.create_connection(("127.0.0.1", port))
                        fresh.setblocking(False)
                        flood[i], opened[fresh] = fresh, time.monotonic()
                except BlockingIOError:
                    pass
                except OSError:
                    pass

    attacker = threading.Thread(target=keep_flooding, daemon=True)
    attacker.start()
    try:
        while len(flood) < 600:
            time.sleep(0.05)
        latencies, peak_tcp, peak_authenticated = [], 0, 0
        t_end = time.monotonic() + 2.5 * handshake_s
        while time.monotonic() < t_end:
            t0 = time.monotonic()
            client = CoordinatorClient(address, secret=SECRET, handshake_timeout_s=5.0)
            stats = client.stats(5.0)
            latencies.append(time.monotonic() - t0)
            client.close()
            peak_tcp, peak_authenticated = max(peak_tcp, stats.tcp_connections), max(peak_authenticated,
                                                                                      stats.connections)
            time.sleep(0.25)
        latencies.sort()
        print(f"\nMEASURED A8: 600 idle connections (peak {peak_tcp} TCP, {peak_authenticated} authenticated); "
              f"{len(latencies)} clients answered in median {latencies[len(latencies) // 2] * 1e3:.0f} ms, "
              f"max {latencies[-1] * 1e3:.0f} ms; idle connections shed after "
              f"{min(shed_after or [0]):.2f}-{max(shed_after or [0]):.2f} s ({len(shed_after)} shed)")
        assert peak_tcp >= 600, "the flood did not reach the coordinator"
        assert peak_authenticated <= 2
        assert latencies[-1] < 2.0, latencies
        # libzmq closes what never handshakes; the slack covers a loaded 2-core machine (CI measured
        # 5.67 s here before the listen backlog was raised: connections queued behind the default 100)
        assert shed_after and max(shed_after) < 3 * handshake_s + 1.0
    finally:
        stop.set()
        attacker.join(10)
        for s in flood:
            s.close()
        stop_coordinator_process(proc, timeout_s=5)
