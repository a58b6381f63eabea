"""Prefill side of a handoff: pin, publish, and release only when no read can be in flight.

The rule this module exists to keep: a source block is reused only after its reader
said so. Pins go when (a) the transport delivers read-done (``drain_read_done``),
(b) the transport delivers a read-failure report, which by contract means no read of
that request is still in flight (``drain_read_failed``), or (c) the control plane
calls ``release`` with the same guarantee (decode's engine-level read-done, or a
reader whose process is confirmed dead). There is deliberately no timer: a lease that
expires under a slow reader is how peer systems served garbage. Releasing twice is a
no-op, because (a) and (c) both arrive for every successful request.

With ``generations`` (a ``kvxfer.handoff.generations.BlockGenerations`` whose counters the
allocator bumps on every free and reallocation), each descriptor also carries the
counters of its blocks at pin time, so a reader can prove it read this request's bytes
even if a bug elsewhere freed a pinned block early. Verified reads deliver their
read-done on the counters' registration, so the reports are then drained through
``generations``, which merges both registrations.

A push backend (``backend.is_push``, e.g. ``nccl``) is driven in Megatron's order: the
decode posts its receives and asks, and ``push`` sends the request's blocks (from the
decode's cached prefix on). Then the pins go only when the send handle has finished
(polled here) *and* the control plane's ``release`` came (the decode's read-done);
whichever arrives second frees them. A push that fails frees them at once (the blocks
were gathered into staging before anything was posted, so nothing reads them) and is
reported by ``drain_push_failures``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from engine_integration.adapter import HandoffEngineAdapter
from engine_integration.descriptor import HandoffDescriptor, RequestId
from kvxfer.errors import KVXferError
from kvxfer.handoff.poll import KVPoll

_FINAL_HISTORY = 4096  # final states remembered, so late duplicate reports are recognised


@dataclass
class _Export:
    descriptor: HandoffDescriptor
    state: KVPoll = KVPoll.WaitingForInput
    push: Any = None             #: push backends: the send handle while it has not finished
    pushed: bool = False         #: push backends: a push was started for this request
    reader_done: bool = False    #: push backends: ``release`` came while the push was in flight


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
        self.is_push = bool(getattr(backend, "is_push", False))
        self._push_failures: list[tuple[RequestId, str]] = []

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

    def push(self, request_id: RequestId, decode_metas: Sequence[Any], skip_blocks: int = 0) -> None:
        """Push backends: send the request's blocks from ``skip_blocks`` on to the decode ranks of
        ``decode_metas`` (their registered transfer metas), which have posted their receives.

        Raises (``KeyError``, ``ValueError``, the backend's ``KVXferError``) when the push is
        refused before anything was posted; a refusal by the backend also releases the pins,
        since nothing can read the blocks then.
        """
        from engine_integration.descriptor import split_transfer_meta

        if not self.is_push:
            raise RuntimeError(f"the {getattr(self.backend, 'name', '?')} backend pulls; nothing is pushed")
        entry = self._live.get(request_id)
        if entry is None:
            raise KeyError(f"request {request_id!r} is not pinned here (released or unknown)")
        if entry.pushed:
            raise ValueError(f"request {request_id!r} was already pushed")
        blocks = list(entry.descriptor.block_ids)
        if not 0 <= skip_blocks < len(blocks):
            raise ValueError(f"request {request_id!r}: cannot skip {skip_blocks} of its {len(blocks)} blocks")
        entry.pushed = True
        try:
            metas = [split_transfer_meta(m)[0] for m in decode_metas]
            entry.push = self.backend.begin_push_blocks({"tp_metas": metas}, blocks[skip_blocks:],
                                                        request_id=request_id)
        except Exception:  # a decode's meta of the wrong shape too: nothing was posted, the pins go now
            self.release(request_id, success=False)
            raise
        entry.state = KVPoll.Transferring

    def drain_push_failures(self) -> list[tuple[RequestId, str]]:
        """Push backends: ``(request id, reason)`` of pushes that failed since the last call."""
        out, self._push_failures = self._push_failures, []
        return out

    def release(self, request_id: RequestId, *, success: bool = True) -> bool:
        """Unpin the request's blocks; True if this call released them (False: already released/unknown).

        With a push still in flight the release is deferred until its handle finishes."""
        entry = self._live.get(request_id)
        if entry is None:
            return False
        if entry.push is not None:
            entry.reader_done = True
            return False
        del self._live[request_id]
        self.adapter.unpin_blocks(entry.descriptor.block_ids)
        self._final[request_id] = KVPoll.Success if success else KVPoll.Failed
        while len(self._final) > _FINAL_HISTORY:
            self._final.popitem(last=False)
        return True

    def poll_transport(self) -> list[tuple[RequestId, KVPoll]]:
        """Apply the transport's read-done and read-failed reports; returns what was released."""
        if self.is_push:
            return self._poll_pushes()
        released = []
        for request_id in self._reports.drain_read_done():
            if self.release(request_id, success=True):
                released.append((request_id, KVPoll.Success))
        for failure in self._reports.drain_read_failed():
            if self.release(failure.request_id, success=False):
                released.append((failure.request_id, KVPoll.Failed))
        return released

    def _poll_pushes(self) -> list[tuple[RequestId, KVPoll]]:
        """Push backends: poll the send handles; a finished one frees its pins once the reader is done too."""
        self._reports.drain_read_done()  # the same completions, reported per request: the handles say it
        self._reports.drain_read_failed()
        released = []
        for request_id, entry in list(self._live.items()):
            if entry.push is None:
                continue
            try:
                if not entry.push.poll():
                    continue
            except KVXferError as exc:
                entry.push = None
                self._push_failures.append((request_id, f"push to the decode failed: {exc}"))
                if self.release(request_id, success=False):
                    released.append((request_id, KVPoll.Failed))
                continue
            entry.push = None
            if entry.reader_done and self.release(request_id, success=True):
                released.append((request_id, KVPoll.Success))
        return released

    def state(self, request_id: RequestId) -> Optional[KVPoll]:
        if request_id in self._live:
            return self._live[request_id].state
        return self._final.get(request_id)

    @property
    def pushes_in_flight(self) -> int:
        """Push backends: send handles not yet finished."""
        return sum(1 for e in self._live.values() if e.push is not None)

    @property
    def in_flight(self) -> list[RequestId]:
        """Requests whose blocks are still pinned."""
        return list(self._live)
