"""The handoff state machines and the reference engine, in one process (fast, no sockets)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine_integration.control_plane.zmq import wire
from engine_integration.control_plane.policy import compatibility_problem
from engine_integration.control_plane.zmq.coordinator import member
from engine_integration.descriptor import HandoffDescriptor
from engine_integration.handoff_engine import StateHandoffDynamicInferenceEngine
from engine_integration.reference_adapter import ReferenceEngineAdapter
from engine_integration.launch import generate_colocated
from engine_integration.reference import BlockAllocator, ModelConfig, block_hashes, build_reference_engine
from engine_integration.sink import HandoffSink
from engine_integration.source import HandoffSource
from kvxfer.backends.base import ReadFailure
from kvxfer.errors import TransferError
from kvxfer.handoff.poll import KVPoll

from engine_helpers import MODEL, drive_pair, make_pair, successes, varied_prompts

torch.set_num_threads(1)


# --- reference engine ----------------------------------------------------------------------
def test_allocator_refs_pins_prefix_and_lru_eviction():
    alloc = BlockAllocator(4)
    a = alloc.allocate(2)
    hashes = block_hashes(list(range(8)), 4)
    alloc.register(a, hashes)
    alloc.pin(a)
    alloc.release(a)
    assert alloc.num_free == 2 and alloc.num_pinned == 2  # pinned blocks are not free
    alloc.unpin(a)
    assert alloc.num_free == 4 and alloc.num_cached == 2  # free, but still findable
    assert alloc.acquire_prefix(hashes) == a
    alloc.release(a)
    assert alloc.allocate(3) is not None  # 2 clean + 1 evicted (the LRU cached one)
    assert alloc.num_cached == 1
    assert alloc.allocate(2) is None  # nothing taken when it does not fit
    with pytest.raises(RuntimeError):
        alloc.unpin([a[0]])


def test_block_hashes_cover_full_blocks_only_and_chain():
    assert len(block_hashes(list(range(7)), 4)) == 1
    h1 = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    h2 = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert h1[1] != h2[1]  # same tokens, different parent


def test_model_is_deterministic_and_prefix_reuse_skips_recompute():
    prompts = [list(range(1, 14)), list(range(1, 13)) + [99, 98]]
    a = generate_colocated(prompts, 5)
    b = generate_colocated(prompts, 5)
    assert [r.tokens for r in a] == [r.tokens for r in b] and all(len(r.tokens) == 5 for r in a)
    engine = build_reference_engine(MODEL, 64)
    for i, p in enumerate(prompts):
        engine.add_request(i, p, 3)
    engine.step()
    assert engine.running[1].cached_prefix_blocks == 3


def test_model_config_validates():
    with pytest.raises(ValueError):
        ModelConfig(vocab_size=100)
    with pytest.raises(ValueError):
        ModelConfig(num_q_heads=4, num_kv_heads=3)


# --- prefill -> decode through the neutral engine ----------------------------------------------
def test_neutral_handoff_matches_colocated_and_releases_every_pin():
    prompts = varied_prompts(12)
    expected = generate_colocated(prompts, 6)
    prefill, decode = make_pair()
    results, events = drive_pair(prefill, decode, prompts, 6)
    assert [tuple(results[i]["tokens"]) for i in range(len(prompts))] == [r.tokens for r in expected]
    assert prefill.context.allocator.num_pins == 0
    assert prefill._handoff_source.in_flight == []
    assert all(prefill._handoff_source.state(i) is KVPoll.Success for i in range(len(prompts)))
    assert decode.context.allocator.num_free == decode.context.num_blocks  # all released (some still cached)


def test_decode_pulls_only_blocks_missing_from_its_prefix_cache():
    first = list(range(10, 24))                                   # 14 tokens: 3 full blocks + a partial one
    second = first[:12] + [200, 201, 202, 203, 204, 205, 206]     # 19 tokens: shares those 3 full blocks
    expected = generate_colocated([first, second], 4)
    prefill, decode = make_pair()
    res1, ev1 = drive_pair(prefill, decode, [first], 4)
    res2, ev2 = drive_pair(prefill, decode, [second], 4, first_id=1)
    [a], [b] = successes(ev1), successes(ev2)
    assert (a.cached_prefix_blocks, a.pulled_blocks) == (0, 4)
    assert (b.cached_prefix_blocks, b.pulled_blocks) == (3, 2)    # 5 prompt blocks, 3 found by hash
    assert (tuple(res1[0]["tokens"]), tuple(res2[1]["tokens"])) == (expected[0].tokens, expected[1].tokens)
    assert prefill.context.allocator.num_pins == 0


def test_decode_short_of_blocks_queues_fifo_and_finishes_all():
    prompts = [[(i + j) % 256 for j in range(13)] for i in range(10)]  # each needs 5 decode blocks with 8 new
    expected = generate_colocated(prompts, 8)
    prefill, decode = make_pair(decode_blocks=12)  # room for two at a time
    results, events = drive_pair(prefill, decode, prompts, 8)
    assert [tuple(results[i]["tokens"]) for i in range(10)] == [r.tokens for r in expected]
    admitted = [e.request_id for e in successes(events)]
    assert admitted == list(range(10))  # FIFO
    assert decode.context.allocator.num_free == 12 and prefill.context.allocator.num_pins == 0


# --- failures -----------------------------------------------------------------------------------
class _FailingHandle:
    """A pull that fails with its destination not yet safe (a read may still land)."""

    def __init__(self) -> None:
        self.storage_safe = False

    def poll(self) -> bool:
        raise TransferError("peer went away")


@dataclass
class _StubBackend:
    handle: object = None
    failures: tuple = ()

    def begin_pull_blocks(self, meta, src, dst, *, request_id=None):
        return self.handle

    def drain_read_done(self):
        return []

    def drain_read_failed(self):
        out, self.failures = list(self.failures), ()
        return out


def test_failed_pull_quarantines_blocks_until_storage_safe():
    engine = build_reference_engine(MODEL, 8, engine_cls=StateHandoffDynamicInferenceEngine)
    handle = _FailingHandle()
    sink = HandoffSink(ReferenceEngineAdapter(engine), _StubBackend(handle), lambda src, i: {"stub": True})
    d = HandoffDescriptor(7, "p0", 0, (0, 1, 2), tuple(block_hashes(list(range(9)), 4)), tuple(range(9)), (5,))
    sink.submit(d, 4)
    [event] = sink.step()  # reserved, posted, polled: failed
    assert event.state is KVPoll.Failed and not event.source_safe and "peer went away" in event.reason
    assert sink.num_quarantined_blocks == 3 and engine.context.allocator.num_free == 5  # not reused
    assert sink.step() == []
    handle.storage_safe = True
    [cleared] = sink.step()
    assert cleared.quarantine_cleared and cleared.source_safe
    assert engine.context.allocator.num_free == 8 and engine.context.allocator.num_cached == 0


class _DoneHandle:
    storage_safe = True

    def poll(self) -> bool:
        return True


def test_a_repeated_request_is_refused_and_an_aborted_pull_registers_no_prefix():
    """From a review (2026-12-05): a second ``submit`` of a request id in flight overwrote the first
    entry, orphaning its blocks and pins; and a pull aborted while it ran (its source gone, the bytes
    perhaps another request's) registered its block hashes before the abort was seen, so a later prompt
    with that prefix would have decoded from them."""
    engine = build_reference_engine(MODEL, 8, engine_cls=StateHandoffDynamicInferenceEngine)
    sink = HandoffSink(ReferenceEngineAdapter(engine), _StubBackend(_DoneHandle()), lambda src, i: {"stub": True})
    d = HandoffDescriptor(9, "p0", 0, (0, 1, 2), tuple(block_hashes(list(range(9)), 4)), tuple(range(9)), (5,))
    sink.submit(d, 4)
    with pytest.raises(ValueError, match="already being handed off"):
        sink.submit(d, 4)
    sink.max_queued = 1  # a bounded queue: one more handoff is refused, not kept
    with pytest.raises(ValueError, match="max_queued=1"):
        sink.submit(HandoffDescriptor(10, "p0", 0, (0,), (), tuple(range(3)), (5,)), 4)
    sink.max_queued = 4096
    sink.abort(9, "the source is gone")  # queued: dropped at once
    sink.submit(d, 4)
    sink._start_pull = (lambda start: (lambda entry, meta: (start(entry, meta), sink.abort(9, "source gone"))[0]))(
        sink._start_pull)  # aborted right after its read was posted
    [event] = sink.step()
    assert event.state is KVPoll.Failed and "source gone" in event.reason
    assert engine.context.allocator.num_free == 8 and engine.context.allocator.num_cached == 0  # no prefix kept


def test_source_releases_on_read_done_or_safe_failure_once():
    engine = build_reference_engine(MODEL, 8, engine_cls=StateHandoffDynamicInferenceEngine)
    backend = _StubBackend()
    source = HandoffSource(ReferenceEngineAdapter(engine), backend, "p0")
    blocks = engine.context.allocator.allocate(2)
    d = source.export(1, blocks, list(range(6)), [3])
    engine.context.allocator.release(blocks)
    assert d.block_ids == tuple(blocks) and len(d.block_hashes) == 1  # the partial block is pinned, not hashed
    assert engine.context.allocator.num_pins == 2 and engine.context.allocator.num_free == 6
    backend.failures = (ReadFailure(1, "reader aborted"),)
    assert source.poll_transport() == [(1, KVPoll.Failed)]
    assert source.release(1) is False  # twice is harmless
    assert engine.context.allocator.num_pins == 0 and engine.context.allocator.num_free == 8


# --- wire and registration checks ------------------------------------------------------------------
def test_wire_round_trip_rejects_garbage():
    d = wire.Descriptor(3, "p0", 0, [1, 2], [7], [1, 2, 3, 4, 5], [9])
    msg = wire.StartDecode(3, d, 5)
    assert wire.decode(wire.encode(msg)) == msg
    with pytest.raises(wire.WireError):
        wire.decode(b'{"type": "nope"}')


def test_compatibility_problem_names_the_field():
    def reg(tpb, fp="x"):
        meta = {"backend": "local", "dtype": "float32", "tokens_per_block": tpb, "num_outer": 4}
        return wire.Register("decode", "d", "i", 1, "h", fp, [meta], 8)

    assert compatibility_problem(member(reg(4)), member(reg(4))) is None
    assert "'tokens_per_block' is 8 here but 4" in compatibility_problem(member(reg(8)), member(reg(4)))
    assert "fingerprint" in compatibility_problem(member(reg(4, "y")), member(reg(4)))
