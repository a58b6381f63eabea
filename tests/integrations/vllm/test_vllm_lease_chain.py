"""The lease read chained behind the data read by the transport (ucx, ``begin_chained_pull``).

Connector-level with real processes (``tests.support.vllm_support``: a KV source process with its lease
table; this process's decode ``Receiver``): with equal TP a ucx decode no longer posts the lease
read itself after the data landed; the UCX completion of the last data get posts it, in C. The
safety rules stay: the lease is read strictly after the data (never when a data get failed), a
lease that moved fails the load and its bytes are discarded, and the read-done reaches the
producer only after the lease read. The binding-level cases build the chain directly.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import numpy as np
import pytest
import torch

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.backends.transfer import ChainedGuard
from kvxfer.backends.ucx import binding as ucp
from kvxfer.errors import BlockIdError, TransferError
from kvxfer.handoff.guard import UNREAD
from tests.support.vllm_support import Decode, Producer

pytestmark = pytest.mark.timeout(300)


def holds(decode: Decode, local: int, source: int) -> bool:
    return all(bool((decode.buffer[layer, local] == (7 * source + layer) % 100).all()) for layer in range(4))


def heard(producer: Producer, request_id: str, timeout_s: float = 10.0) -> dict:
    """What the source process was told of ``request_id``, once it heard of it."""
    deadline = time.monotonic() + timeout_s
    while True:
        told = producer.source.ask("done")
        if request_id in told["read_done"] + told["read_failed"] or time.monotonic() > deadline:
            return told
        time.sleep(0.05)


def test_ucx_reads_the_lease_behind_the_data_in_the_transport_and_a_moved_lease_still_fails():
    with ExitStack() as stack:
        producer = Producer(stack, "ucx")
        decode = Decode(stack, "ucx")
        decode.submit("first", producer.ticket([1, 2, 9], "first"), [3, 4, 5])
        decode.run_until({"first"}, 30)
        assert "first" not in decode.failed and holds(decode, 3, 1) and holds(decode, 4, 2) and holds(decode, 5, 9)
        # the lease was read by the region's own transport: the scratch registration posted nothing
        assert decode.scratch_backend.stats()["transfers_started"] == 0, decode.scratch_backend.stats()
        assert decode.region_backend.stats()["transfers_started"] >= 1
        assert "first" in heard(producer, "first")["read_done"]  # the read-done, after the lease read

        # the producer gave the blocks back before the read (its lease revoked): the load fails, the
        # bytes that landed are not admitted, and the producer still hears that this reader is done
        ticket = producer.ticket([6], "late")
        slot, lease = ticket["kvxfer"]["slot"], ticket["kvxfer"]["lease"]
        assert producer.source.ask(f"revoke {slot} {lease}") == {"revoked": slot}
        decode.submit("late", ticket, [7])
        decode.run_until({"late"}, 30)
        assert "late" in decode.failed
        assert f"released request 'late'" in decode.receiver.recent[-1]["failed"]
        assert "late" in heard(producer, "late")["read_done"]
        assert decode.receiver.slots.free == decode.receiver.slots.tensor.numel()  # every scratch slot back
        assert decode.scratch_backend.stats()["transfers_started"] == 0


def test_nixl_keeps_the_two_reads_of_the_handoff_lifecycle():
    """A transport that cannot chain (nixl) answers None, and the reader posts the lease read itself."""
    with ExitStack() as stack:
        producer = Producer(stack, "nixl")
        decode = Decode(stack, "nixl")
        decode.submit("first", producer.ticket([1, 2], "first"), [3, 4])
        decode.run_until({"first"}, 30)
        assert "first" not in decode.failed and holds(decode, 3, 1) and holds(decode, 4, 2)
        assert decode.scratch_backend.stats()["transfers_started"] == 1


@pytest.fixture
def pair():
    """A source pool and lease table, a reader pool: ucx registrations in this process (CMA)."""
    cls = construct_kv_transfer_backend_class("ucx")
    shape = (2, 16, 4, 32)
    src = cls("chain-src", torch.arange(np.prod(shape), dtype=torch.float32).view(shape), shape[1])
    table_tensor = torch.tensor([0, 0, 0, 42] + [0] * 12, dtype=torch.int64)
    table = src.new_registered_buffer(memory_buffer=table_tensor, expected_num_blocks=16)
    dst = cls("chain-dst", torch.zeros(shape), shape[1])
    yield src, table, dst
    for backend in (dst, table, src):
        backend.close()


def test_chained_guard_is_read_after_the_data_and_carries_the_read_done(pair):
    src, table, dst = pair
    data, lease = dst.prepare_peer(src.export_meta()), dst.prepare_peer(table.export_meta())
    scratch = torch.full((2,), UNREAD, dtype=torch.int64)
    requests_before = ucp.live_objects().get("request", 0)
    handle = dst.begin_chained_pull(data, [5, 6, 0], [1, 2, 3], ChainedGuard(lease, 3, scratch.data_ptr() + 8, 8),
                                    request_id="r1")
    assert handle is not None
    handle.wait()
    assert torch.equal(dst.memory_buffer[:, [1, 2, 3]], src.memory_buffer[:, [5, 6, 0]])
    assert scratch.tolist() == [UNREAD, 42]
    deadline = time.monotonic() + 5
    done = []
    while "r1" not in done and time.monotonic() < deadline:
        done += table.drain_read_done()
        time.sleep(0.01)
    assert done == ["r1"] and src.drain_read_done() == []  # told once, by the lease table's worker
    assert int(handle._batch.chain.notice_state) in (1, 2)  # ... and sent by the binding, behind the guard read
    assert ucp.live_objects().get("request", 0) == requests_before  # the guard's request (posted in C) freed
    with pytest.raises(BlockIdError, match="outside the pool"):  # the guard's slot is checked like any block id
        dst.begin_chained_pull(data, [1], [1], ChainedGuard(lease, 16, scratch.data_ptr(), 8), request_id="r2")
    assert dst.begin_chained_pull(data, [], [], ChainedGuard(lease, 3, scratch.data_ptr(), 8), request_id="r3") is None
    # a lease table whose slot is not the 8 bytes the reader's memory holds is never chained (the
    # guard would write past them); the reader's own lease read then refuses it as any read does
    assert dst.begin_chained_pull(data, [1], [1], ChainedGuard(lease, 3, scratch.data_ptr(), 4), request_id="r4") is None


def test_a_chained_pull_of_ids_given_as_arrays_takes_the_general_rows_and_copies_exactly(pair):
    """The short path checks and plans lists of Python ints; ids given as numpy arrays (or past its
    limits) take the copier's general planner: the same bytes either way."""
    src, table, dst = pair
    data, lease = dst.prepare_peer(src.export_meta()), dst.prepare_peer(table.export_meta())
    scratch = torch.full((1,), UNREAD, dtype=torch.int64)
    src_ids, dst_ids = np.array([9, 10, 11, 2]), np.array([4, 5, 6, 15])
    handle = dst.begin_chained_pull(data, src_ids, dst_ids, ChainedGuard(lease, 3, scratch.data_ptr(), 8),
                                    request_id="arrays")
    assert handle is not None
    handle.wait()
    assert torch.equal(dst.memory_buffer[:, dst_ids.tolist()], src.memory_buffer[:, src_ids.tolist()])
    assert scratch.tolist() == [42] and handle.bytes_requested == 2 * 4 * 4 * 32 * 4


def test_a_failed_data_get_never_reads_the_guard(pair):
    """A data get that fails (a row at an address the source never mapped) ends the chain: the guard
    is never posted, its scratch never written, the batch's status is the data's error."""
    src, table, dst = pair
    data, lease = dst.prepare_peer(src.export_meta()), dst.prepare_peer(table.export_meta())
    backend = dst
    source, guard_source = data.peer.transport, lease.peer.transport
    scratch = torch.full((1,), UNREAD, dtype=torch.int64)
    with backend._worker.lock:
        peer, guard_peer = backend._peer_for(source.address, data.meta), backend._peer_for(guard_source.address, lease.meta)
        rows = [np.array(a, dtype=np.int64) for a in ([0], [0], [64])]
        guard = ucp.GuardGet(guard_peer.endpoint, guard_peer.rkey(guard_source.rkey), scratch.data_ptr(),
                             lease.peer.geometry.buf_ptr + 3 * 8, 8)
        batch = ucp.GetBatch(peer.endpoint, peer.rkey(source.rkey), backend.geometry.buf_ptr, 4096, *rows,
                             cuda=False, guard=guard)  # remote address 4096: never mapped
    deadline = time.monotonic() + 5
    while not batch.done and time.monotonic() < deadline:
        backend._worker.progress()
    assert batch.done and not ucp.is_ok(batch.status) and not batch.guard_read
    assert int(scratch[0]) == UNREAD
    batch.release()


def test_a_stopped_chain_never_reads_the_guard(pair):
    """Stopped (as an abort or the guard endpoint's close does) before the data completed: the
    data gets still end, the guard is never posted, and the status says it was cancelled."""
    src, table, dst = pair
    data, lease = dst.prepare_peer(src.export_meta()), dst.prepare_peer(table.export_meta())
    source, guard_source = data.peer.transport, lease.peer.transport
    scratch = torch.full((1,), UNREAD, dtype=torch.int64)
    with dst._worker.lock:  # the progress thread cannot complete anything before the stop
        peer, guard_peer = dst._peer_for(source.address, data.meta), dst._peer_for(guard_source.address, lease.meta)
        rows = [np.array(a, dtype=np.int64) for a in ([0], [0], [dst.geometry.outer_stride_bytes])]
        guard = ucp.GuardGet(guard_peer.endpoint, guard_peer.rkey(guard_source.rkey), scratch.data_ptr(),
                             lease.peer.geometry.buf_ptr + 3 * 8, 8)
        batch = ucp.GetBatch(peer.endpoint, peer.rkey(source.rkey), dst.geometry.buf_ptr,
                             data.peer.geometry.buf_ptr, *rows, cuda=False, guard=guard)
        posted_at_once = batch.counter.pending == 0  # every get completed inside the post: the guard went too
        batch.stop_chain()
    deadline = time.monotonic() + 5
    while not batch.done and time.monotonic() < deadline:
        dst._worker.progress()
    assert batch.done
    if posted_at_once:
        pytest.fail("the data get completed inside ucp_get_nbx: this transport gives the stop nothing to stop")
    assert not batch.guard_read and int(scratch[0]) == UNREAD
    assert batch.status == ucp._lib.UCS_ERR_CANCELED
    batch.release()
