"""Prefill side of a handoff: pin, publish, and release only when no read can be in flight.

The rule this module exists to keep: a source block is reused only after its reader
said so. Pins go when (a) the transport delivers read-done (``drain_read_done``),
(b) the transport delivers a read-failure report, which by contract means no read of
that request is still in flight (``drain_read_failed``), or (c) the control plane
calls ``release`` with the same guarantee (decode's engine-level read-done, or a
reader whose process is confirmed dead). There is deliberately no timer: a lease that
expires under a slow reader is how peer systems served garbage. Releasing twice is a
no-op, because (a) and (c) both arrive for every successful request.

With ``generations`` (a ``kvxfer.runtime.generations.BlockGenerations`` whose counters the
allocator bumps on every free and reallocation), each descriptor also carries the
counters of its blocks at pin time, so a reader can prove it read this request's bytes
even if a bug elsewhere freed a pinned block early. Verified reads deliver their
read-done on the counters' registration, so the reports are then drained through
``generations``, which merges both registrations.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from engine_integration.adapter import HandoffEngineAdapter
from engine_integration.descriptor import HandoffDescriptor, RequestId
from engine_integration.poll import KVPoll

_FINAL_HISTORY = 4096  # final states remembered, so late duplicate reports are recognised


@dataclass
class _Export:
    descriptor: HandoffDescriptor
    state: KVPoll = KVPoll.WaitingForInput


class HandoffSource:
    """Pins and releases one prefill instance's exported requests."""

    def __init__(self, adapter: HandoffEngineAdapter, backend: Any, identity: str, meta_index: int = 0, *,
                 generations: Any = None) -> None:
        self.adapter = adapter
        self.backend = backend
        self.generations = generations
        self._reports = generations if generations is not None else backend  # read-done / read-failed source
        self.identity = identity
        self.meta_index = meta_index
        self._live: dict[RequestId, _Export] = {}
        self._final: OrderedDict[RequestId, KVPoll] = OrderedDict()

    def export(self, request_id: RequestId, block_ids: Sequence[int], prompt: Sequence[int],
               resume_tokens: Sequence[int]) -> HandoffDescriptor:
        """Pin the prompt's blocks (a partial last block included) and describe them."""
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already exported")
        n_blocks = -(-len(prompt) // self.adapter.tokens_per_block)
        blocks = tuple(int(b) for b in block_ids[:n_blocks])
        if len(blocks) != n_blocks:
            raise ValueError(f"request {request_id!r}: {len(prompt)} prompt tokens need {n_blocks} blocks, got {len(blocks)}")
        hashes = tuple(self.adapter.block_hashes(prompt))
        descriptor = HandoffDescriptor(request_id, self.identity, self.meta_index, blocks, hashes,
                                       tuple(int(t) for t in prompt), tuple(int(t) for t in resume_tokens))
        self.adapter.pin_blocks(blocks)
        if self.generations is not None:  # pinned: the counters cannot move now unless something is wrong
            descriptor = replace(descriptor, generations=tuple(self.generations.snapshot(blocks)))
        self._live[request_id] = _Export(descriptor)
        return descriptor

    def release(self, request_id: RequestId, *, success: bool = True) -> bool:
        """Unpin the request's blocks; True if this call released them (False: already released/unknown)."""
        entry = self._live.pop(request_id, None)
        if entry is None:
            return False
        self.adapter.unpin_blocks(entry.descriptor.block_ids)
        self._final[request_id] = KVPoll.Success if success else KVPoll.Failed
        while len(self._final) > _FINAL_HISTORY:
            self._final.popitem(last=False)
        return True

    def poll_transport(self) -> list[tuple[RequestId, KVPoll]]:
        """Apply the transport's read-done and read-failed reports; returns what was released."""
        released = []
        for request_id in self._reports.drain_read_done():
            if self.release(request_id, success=True):
                released.append((request_id, KVPoll.Success))
        for failure in self._reports.drain_read_failed():
            if self.release(failure.request_id, success=False):
                released.append((failure.request_id, KVPoll.Failed))
        return released

    def state(self, request_id: RequestId) -> Optional[KVPoll]:
        if request_id in self._live:
            return self._live[request_id].state
        return self._final.get(request_id)

    @property
    def in_flight(self) -> list[RequestId]:
        """Requests whose blocks are still pinned."""
        return list(self._live)
