"""Torn-read detection: per-block generation counters that a reader re-checks.

The worst failure in disaggregated serving is silent: the prefill side frees (or
reuses) blocks while a decode reader is still reading them, and decode answers
with someone else's KV cache. Here the source keeps one int64 counter per block,
registered with the transport beside the pool, and bumps it whenever it frees or
reallocates a block. A handoff carries the counters as they were when the blocks
were pinned. The reader pulls the data *without* a read-done, then reads those
counters with one small one-sided read that *does* carry the read-done, and fails
with ``TornReadError`` if any counter moved. Because the source only learns "read
done" after the counters were read, it cannot free a block between the data read
and the check: a mismatch is always a real reuse, never a false alarm. The order and
the comparison are the generation-counter flavour of ``kvxfer.handoff.guard``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from kvxfer.backends.base import KVTransportBackend, ReadFailure, RequestId, TransferHandle, TransferState, abort_parts
from kvxfer.errors import BlockIdError, PeerMetadataError, TornReadError
from kvxfer.handoff.guard import UNREAD, CounterGuard, GuardedRead, begin_data_read
from kvxfer.plan.descriptors import IdList
from kvxfer.meta.records import plan_from_meta, transfer_peer_records
from kvxfer.meta.seal import HOST_FIELD


class BlockGenerations:
    """Source side: the counters of one pool, registered on the pool's agent."""

    def __init__(self, kv_backend: KVTransportBackend) -> None:
        num_blocks = kv_backend.geometry.num_blocks
        self.kv = kv_backend
        self.table = torch.zeros(num_blocks, dtype=torch.int64)
        self.registration = kv_backend.new_registered_buffer(memory_buffer=self.table, expected_num_blocks=num_blocks)

    def bump(self, block_ids: IdList) -> None:
        """Call whenever blocks are freed or handed to a new owner, before they are rewritten."""
        ids = torch.as_tensor(np.atleast_1d(np.asarray(block_ids, dtype=np.int64)))
        self.table.index_add_(0, ids, torch.ones_like(ids))

    def snapshot(self, block_ids: IdList) -> list[int]:
        """The counters to put in a handoff descriptor when the blocks are pinned."""
        return self.table[torch.as_tensor(np.atleast_1d(np.asarray(block_ids, dtype=np.int64)))].tolist()

    def export_meta(self) -> dict[str, Any]:
        return self.registration.export_meta()

    def drain_read_done(self) -> list[RequestId]:
        """Read-dones of both plain pulls (on the pool) and verified pulls (on the counters)."""
        return self.kv.drain_read_done() + self.registration.drain_read_done()

    def drain_read_failed(self) -> list[ReadFailure]:
        return self.kv.drain_read_failed() + self.registration.drain_read_failed()

    def close(self) -> None:
        self.registration.close()


class GenerationChecker:
    """Decode side: verified pulls into one pool."""

    def __init__(self, kv_backend: KVTransportBackend) -> None:
        num_blocks = kv_backend.geometry.num_blocks
        self.kv = kv_backend
        # counters land at the *destination* block ids: those belong to exactly one
        # in-flight request, so concurrent checks never share a slot
        self.scratch = torch.full((num_blocks,), UNREAD, dtype=torch.int64)
        self.registration = kv_backend.new_registered_buffer(memory_buffer=self.scratch, expected_num_blocks=num_blocks)

    def begin_pull_verified(
        self,
        peer_kv_meta: Mapping[str, Any],
        peer_generations_meta: Mapping[str, Any],
        src_block_ids: IdList,
        dst_block_ids: IdList,
        expected_generations: Sequence[int],
        *,
        request_id: RequestId,
    ) -> TransferHandle:
        """Pull the blocks, then check their counters; the handle fails with ``TornReadError`` on reuse."""
        expected = np.asarray(expected_generations, dtype=np.int64)
        if expected.shape != (len(src_block_ids),):
            raise BlockIdError(f"{expected.size} expected generations for {len(src_block_ids)} blocks")
        self._check_counters_meta(peer_kv_meta, peer_generations_meta, src_block_ids, dst_block_ids)
        data = begin_data_read(self.kv, peer_kv_meta, src_block_ids, dst_block_ids, request_id=request_id)
        guard = CounterGuard(self.scratch, self.registration, peer_generations_meta, np.asarray(src_block_ids),
                             np.asarray(dst_block_ids), expected, request_id)
        return VerifiedPull(self, peer_kv_meta, data, guard, request_id)

    def _check_counters_meta(self, kv_meta: Mapping[str, Any], generations_meta: Mapping[str, Any],
                             src_block_ids: IdList, dst_block_ids: IdList) -> None:
        """Refuse a generations meta the counters read would refuse, before the data read is posted.

        The counters read is planned here exactly as it will be posted (seal, dtype, geometry,
        block range), and the table must be the data source's own: one record, of the agent,
        host and block count the data is read from. Refused after the data read, the read would
        have run for nothing and left the source waiting for its read-done; accepted from
        another pool, the check would compare counters of blocks that are not the ones read.
        """
        records = transfer_peer_records(generations_meta, src_block_ids)
        if len(records) != 1:
            raise PeerMetadataError(f"a generations meta names one counter table, this one names {len(records)}")
        plan_from_meta(generations_meta, src_block_ids, dst_block_ids, self.registration.local_pool,
                     self.registration.parse_peer_meta)
        sources = transfer_peer_records(kv_meta, src_block_ids)
        if len(sources) != 1:
            return  # several data sources: no one table can be theirs; the plan above is all there is to check
        data, table = sources[0][0], records[0][0]
        for name in ("agent_name", HOST_FIELD, "num_blocks"):
            if data.get(name) != table.get(name):
                raise PeerMetadataError(
                    f"the generations meta's {name!r} is {table.get(name)!r} but the data is read from "
                    f"{data.get(name)!r}: the counters must be the data source's own table")

    def close(self) -> None:
        self.registration.close()


class VerifiedPull(TransferHandle):
    """Data read, then the counters read (carrying the read-done), then the comparison
    (``kvxfer.handoff.guard.GuardedRead``); a moved counter fails it with ``TornReadError``."""

    def __init__(self, checker: GenerationChecker, kv_meta: Mapping[str, Any], data: TransferHandle,
                 guard: CounterGuard, request_id: RequestId) -> None:
        super().__init__(request_id, data.timeout_s)
        self._checker = checker
        self._kv_meta = kv_meta
        self._data = data
        self._read = GuardedRead([data], guard)

    def _progress(self) -> bool:
        if not self._read.poll():
            return False
        if self._read.verdict is not None:
            raise TornReadError(self._read.verdict)
        return True

    def _abort(self) -> bool:
        return abort_parts(self._read.handles, f"request {self.request_id!r}: verified pull aborted")

    def _settle(self) -> bool:
        return all(part.storage_safe for part in self._read.handles)

    def _on_failed(self, error: Exception) -> None:
        # The data read carries no read-done (the counters read does). If it completed and the
        # counters read never started, no transport tells the source: we do, or its pins would
        # wait for the grace.
        if self._read.guard_handles is None and self._data.state is TransferState.DONE:
            for meta, _ in transfer_peer_records(self._kv_meta, []):
                self._checker.kv._notify_source(meta, self.request_id, failure=str(error))
