"""The reference engine on a push backend (``nccl`` over Gloo): Megatron's push handoff order.

The decode reserves its blocks and posts its receives, asks its prefill to push through the
coordinator (``SendKV`` -> ``PushKV``, carrying its registered meta), the prefill pushes, and
its pins go when the send has completed *and* the decode reported read-done. Generation must
equal co-located generation token for token.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from engine_integration.control_plane.zmq import wire
from engine_integration.control_plane.zmq.client import CoordinatorClient
from engine_integration.descriptor import HandoffDescriptor
from engine_integration.launch import ClusterConfig, DisaggCluster, generate_colocated
from engine_integration.source import HandoffSource
from engine_integration.worker import EngineStartError
from kvxfer.errors import PeerMetadataError, TransferError
from kvxfer.handoff.poll import KVPoll

from engine_helpers import varied_prompts
from test_engine_coordinator import META as DESCRIPTOR_META
from test_engine_coordinator import DESCRIPTOR, SECRET, ScriptedEngine, _collect, coordinator  # noqa: F401

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def push_cluster():
    config = ClusterConfig(backend="nccl", decode_blocks=24, prefill_blocks=256, heartbeat_timeout_s=2.0,
                           request_timeout_s=60.0, transfer_timeout_s=20.0, device="cpu")
    with DisaggCluster(config) as c:
        yield c


def _settled(stats) -> bool:
    prefill = stats.engines.get("prefill-0", {})
    return stats.requests_in_flight == 0 and prefill.get("pins") == 0


def test_push_generation_matches_colocated_and_releases_every_pin(push_cluster):
    prompts = varied_prompts(8)
    want = generate_colocated(prompts, NEW_TOKENS, device="cpu")
    got = push_cluster.generate(prompts, NEW_TOKENS)
    assert [r.error for r in got] == [None] * len(prompts)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert sum(r.pulled_blocks for r in got) > 0  # the blocks were pushed, not recomputed
    # a cached prefix on the decode: only the rest is pushed (the prefill skips those blocks)
    first = [240 - i for i in range(14)]                       # 3 full blocks + a partial one
    second = first[:12] + [3, 1, 4, 1, 5, 9, 2]                # 19 tokens sharing the 3 full blocks
    expected = generate_colocated([first, second], 5, device="cpu")
    [a] = push_cluster.generate([first], 5)
    [b] = push_cluster.generate([second], 5)
    assert (a.cached_prefix_blocks, a.pulled_blocks) == (0, 4)
    assert (b.cached_prefix_blocks, b.pulled_blocks) == (3, 2)
    assert (a.tokens, b.tokens) == (expected[0].tokens, expected[1].tokens)
    stats = push_cluster.wait_for_stats(_settled, timeout_s=10)
    assert stats.engines["decode-0"]["quarantined_blocks"] == 0


def test_push_cluster_refuses_to_restart_an_engine(push_cluster):
    with pytest.raises(EngineStartError, match="fixed at launch"):
        push_cluster.start_engine(push_cluster.spec("decode", "decode-1"))


def test_generate_command_runs_nccl_token_exact(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(str(p) for p in varied_prompts(4, seed=3)) + "\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # host pools over Gloo, also on a one-GPU machine
    runs = [subprocess.run([sys.executable, "-m", "kvxfer.cli", "generate", "--prompts", str(path),
                            "--max-new-tokens", "5", *extra], capture_output=True, text=True, timeout=120, env=env)
            for extra in ([], ["--disagg", "--backend", "nccl"])]
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert runs[0].stdout == runs[1].stdout and len(runs[1].stdout.splitlines()) == 4


# --- the coordinator's SendKV -> PushKV, against scripted engines (no torch) ---------------------
def _handed_off(address):
    prefill = ScriptedEngine(address, "prefill", "p0", 1)
    decode = ScriptedEngine(address, "decode", "d0", 1, meta={**DESCRIPTOR_META, "nccl_rank": 1})
    client = CoordinatorClient(address, secret=SECRET)
    cid = client.submit([1, 2, 3, 4, 5], 4)
    add = prefill.recv(5.0, keepalive=[decode])
    assert isinstance(add, wire.AddRequest)
    prefill.send(wire.HandoffReady(add.request_id, {**DESCRIPTOR, "request_id": add.request_id}, 0.01))
    assert isinstance(decode.expect(wire.StartDecode, 5.0, keepalive=[prefill]), wire.StartDecode)
    return prefill, decode, client, cid, add.request_id


def test_send_kv_with_the_registered_meta_is_forwarded_to_the_prefill(coordinator):  # noqa: F811
    prefill, decode, client, cid, rid = _handed_off(coordinator)
    decode.send(wire.SendKV(rid, [{**DESCRIPTOR_META, "nccl_rank": 1}], 1))
    push = prefill.expect(wire.PushKV, 5.0, keepalive=[decode])
    assert push is not None and push.request_id == rid and push.skip_blocks == 1
    assert push.decode_identity == "d0" and push.decode_meta == [{**DESCRIPTOR_META, "nccl_rank": 1}]
    decode.send(wire.SendKV(rid, [{**DESCRIPTOR_META, "nccl_rank": 1}], 1))  # asked twice: refused, fails it
    result = _collect(client, cid, [prefill, decode])
    assert "asked twice" in (result.error or "")
    client.close()
    for eng in (prefill, decode):
        eng.close()


def test_send_kv_with_a_forged_meta_fails_the_request_and_releases_the_pins(coordinator):  # noqa: F811
    prefill, decode, client, cid, rid = _handed_off(coordinator)
    forged = {**DESCRIPTOR_META, "nccl_rank": 0}  # points the push at another rank than the decode registered
    decode.send(wire.SendKV(rid, [forged], 0))
    result = _collect(client, cid, [prefill, decode])
    assert result.tokens is None and "push refused" in result.error and "not its registered one" in result.error
    release = prefill.expect(wire.Release, 5.0, keepalive=[decode])  # never told to push: pins go at once
    assert release is not None and rid in release.request_ids
    assert isinstance(decode.expect(wire.Abort, 5.0, keepalive=[prefill]), wire.Abort)
    assert client.stats().dropped.get("refused", 0) >= 1
    client.close()
    for eng in (prefill, decode):
        eng.close()


# --- HandoffSource's push release rule, with a scripted backend ----------------------------------
@dataclass
class _Adapter:
    tokens_per_block: int = 4
    pinned: list = field(default_factory=list)

    def block_hashes(self, tokens):
        return list(range(len(tokens) // self.tokens_per_block))

    def pin_blocks(self, ids):
        self.pinned.extend(ids)

    def unpin_blocks(self, ids):
        for b in ids:
            self.pinned.remove(b)


class _Handle:
    def __init__(self):
        self.done, self.error = False, None

    def poll(self):
        if self.error:
            raise self.error
        return self.done


class _PushBackend:
    name, is_push = "scripted", True

    def __init__(self, refuse=None):
        self.refuse, self.pushes = refuse, []

    def begin_push_blocks(self, meta, ids, *, request_id=None):
        if self.refuse:
            raise self.refuse
        self.pushes.append((meta, list(ids), request_id))
        self.pushes[-1] += (_Handle(),)
        return self.pushes[-1][-1]

    def drain_read_done(self):
        return []

    def drain_read_failed(self):
        return []


def _source(backend):
    adapter = _Adapter()
    source = HandoffSource(adapter, backend, "p0")
    source.export(7, [3, 4, 5], list(range(10)), [1])
    return source, adapter


def test_source_frees_push_pins_only_after_send_done_and_reader_done():
    backend = _PushBackend()
    source, adapter = _source(backend)
    source.push(7, [{"transport": "nccl", "generations": {"x": 1}}], skip_blocks=1)
    meta, ids, rid, handle = backend.pushes[0]
    assert ids == [4, 5] and rid == 7 and meta == {"tp_metas": [{"transport": "nccl"}]}
    assert source.release(7) is False and adapter.pinned == [3, 4, 5]  # reader done, send not yet
    assert source.poll_transport() == [] and adapter.pinned == [3, 4, 5]
    handle.done = True
    assert source.poll_transport() == [(7, KVPoll.Success)] and adapter.pinned == []
    # the other order: send first, then the reader
    source.export(8, [6], [1, 2], [1])
    source.push(8, [{}])
    backend.pushes[-1][-1].done = True
    assert source.poll_transport() == [] and adapter.pinned == [6]
    assert source.release(8) is True and adapter.pinned == []
    with pytest.raises(KeyError):
        source.push(8, [{}])


def test_source_push_refused_or_failed_releases_pins_and_reports():
    source, adapter = _source(_PushBackend(refuse=PeerMetadataError("the peer meta names this rank")))
    with pytest.raises(PeerMetadataError):
        source.push(7, [{}])
    assert adapter.pinned == [] and source.state(7) is KVPoll.Failed
    backend = _PushBackend()
    source, adapter = _source(backend)
    source.push(7, [{}])
    with pytest.raises(ValueError, match="already pushed"):
        source.push(7, [{}])
    backend.pushes[0][-1].error = TransferError("Connection closed by peer")
    assert source.poll_transport() == [(7, KVPoll.Failed)] and adapter.pinned == []
    [(rid, reason)] = source.drain_push_failures()
    assert rid == 7 and "Connection closed by peer" in reason


def test_gpu_pools_need_one_gpu_per_engine():
    import torch

    from kvxfer.errors import BackendUnavailableError

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU per engine: the refusal of a GPU launch short of GPUs cannot happen here")
    with pytest.raises(BackendUnavailableError, match="its own GPU"):
        with DisaggCluster(ClusterConfig(backend="nccl", device="cuda")):
            pass
