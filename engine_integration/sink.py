"""Decode side of a handoff: reserve, reuse the cached prefix, pull the rest, admit.

Requests wait in one FIFO queue and are admitted one at a time, so a big request at
the head is never starved by small ones behind it. Admission reserves every block
the request will ever use (its prompt plus its outputs; the reference engine does no
preemption), reuses the longest cached prefix found by block hash
(``cached_prefix_blocks``) and pulls only the remaining prompt blocks.

A pull that fails keeps its destination blocks out of reuse (``kvxfer.handoff.quarantine``)
until its handle is ``storage_safe``: a late byte landing in a block that now belongs to
another request would corrupt that request silently.

With a ``checker`` (``kvxfer.handoff.generations.GenerationChecker``) the pull is verified:
when the source's meta carries its generation counters and the descriptor their values
at pin time, the blocks are read, then the counters, and a moved counter fails the
import with ``TornReadError``: the source freed or reused a block the descriptor names,
so the bytes may be another request's. That failure takes the ordinary failure path
(request failed with the reason, destination blocks quarantined until ``storage_safe``);
it is never admitted. A source without counters is pulled unverified
(``PullStats.verified`` says which happened).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from engine_integration.adapter import HandoffEngineAdapter, ImportedRequest
from engine_integration.descriptor import HandoffDescriptor, RequestId, split_transfer_meta
from kvxfer.errors import KVXferError, TornReadError
from kvxfer.handoff.poll import KVPoll
from kvxfer.handoff.quarantine import Quarantine

log = logging.getLogger(__name__)

#: (source identity, meta index) -> that source's registered transfer meta, or None if not known yet.
PeerMetaLookup = Callable[[str, int], Optional[Mapping[str, Any]]]


@dataclass(frozen=True)
class SinkEvent:
    """Something the engine must act on: an admitted request, a failure, a cleared quarantine.

    ``source_safe`` says no read of this request can still be in flight, so the source
    may release its pins.
    """

    request_id: RequestId
    state: KVPoll
    source_safe: bool
    cached_prefix_blocks: int = 0
    pulled_blocks: int = 0
    reason: str = ""
    quarantine_cleared: bool = False
    error: Optional[BaseException] = None  #: the transport error of a failed pull (e.g. ``TornReadError``)


@dataclass(frozen=True)
class PullStats:
    """How one admitted request got here (for metrics and tests)."""

    pulled_blocks: int
    queue_s: float       #: waiting in the FIFO for blocks (and the source's meta)
    pull_s: float        #: from posting the read to seeing it complete in the engine loop
    admit_seq: int       #: order in which blocks were reserved on this instance (FIFO check)
    verified: bool = False  #: the source's generation counters were re-read after the data


@dataclass
class _Import:
    descriptor: HandoffDescriptor
    max_new_tokens: int
    enqueued_at: float
    state: KVPoll = KVPoll.Bootstrapping
    cached: list[int] = field(default_factory=list)
    fresh: list[int] = field(default_factory=list)
    handle: Any = None
    started_at: float = 0.0
    admit_seq: int = 0
    abort_reason: str = ""
    verified: bool = False


class HandoffSink:
    """Admits handed-off requests into one decode instance."""

    def __init__(self, adapter: HandoffEngineAdapter, backend: Any, peer_meta: PeerMetaLookup, *,
                 queue_timeout_s: float = 120.0, checker: Any = None, max_queued: int = 4096) -> None:
        self.adapter = adapter
        self.backend = backend
        self.checker = checker
        self.peer_meta = peer_meta
        self.queue_timeout_s = queue_timeout_s
        self.max_queued = max_queued  #: handoffs waiting for blocks at most (more are refused: prefills route them)
        self._queue: deque[_Import] = deque()
        self._transferring: dict[RequestId, _Import] = {}
        self._quarantine: Quarantine[RequestId, _Import] = Quarantine()
        self.pull_stats: dict[RequestId, PullStats] = {}  #: per admitted request; the engine pops it
        self._admitted = 0
        #: called with the request id before a completed pull is committed (hashes registered, request
        #: admitted); a returned reason fails the request instead (e.g. the etcd lease may have expired,
        #: so the source may already have freed the blocks, or the client gave this attempt up:
        #: ``control_plane.etcd.plane``)
        self.commit_guard: Optional[Callable[[RequestId], Optional[str]]] = None
        #: push backends (``backend.is_push``): called as ``on_posted(request_id, skip_blocks)`` once a
        #: request's receives are posted, to ask its prefill to push (Megatron's SEND_KV); ``skip_blocks``
        #: is the cached prefix that is not received. The pull path never calls it.
        self.on_posted: Optional[Callable[[RequestId, int], None]] = None

    # --- inputs -----------------------------------------------------------------------
    def submit(self, descriptor: HandoffDescriptor, max_new_tokens: int) -> None:
        request_id = descriptor.request_id
        if (request_id in self._transferring or request_id in self._quarantine
                or any(entry.descriptor.request_id == request_id for entry in self._queue)):
            # a repeat (a retried StartDecode, two prefills): taking it would orphan the first one's blocks
            raise ValueError(f"request {request_id!r} is already being handed off to this decode")
        if len(self._queue) >= self.max_queued:
            raise ValueError(f"request {request_id!r}: {len(self._queue)} handoffs already wait for blocks on this "
                             f"decode (max_queued={self.max_queued})")
        if max_new_tokens < len(descriptor.resume_tokens):
            raise ValueError(f"request {descriptor.request_id!r}: max_new_tokens {max_new_tokens} < "
                             f"{len(descriptor.resume_tokens)} resume tokens")
        self._queue.append(_Import(descriptor, max_new_tokens, time.monotonic()))

    def abort(self, request_id: RequestId, reason: str) -> Optional[SinkEvent]:
        """Drop a request: at once if still queued; after its pull settles if transferring."""
        for entry in self._queue:
            if entry.descriptor.request_id == request_id:
                self._queue.remove(entry)
                return SinkEvent(request_id, KVPoll.Failed, True, reason=reason)
        entry = self._transferring.get(request_id)
        if entry is not None:
            entry.abort_reason = reason
        return None

    # --- the engine-loop hook -------------------------------------------------------------
    def step(self) -> list[SinkEvent]:
        """Admit from the queue head, poll pulls (new ones too), clear quarantine; never blocks."""
        events = self._admit_from_queue()
        events += self._poll_transfers()
        events += self._clear_quarantine()
        return events

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_transferring(self) -> int:
        return len(self._transferring)

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(held.item.fresh) for held in self._quarantine)

    # --- internals ----------------------------------------------------------------------
    def _admit_from_queue(self) -> list[SinkEvent]:
        events = []
        now = time.monotonic()
        while self._queue:
            entry = self._queue[0]
            d = entry.descriptor
            if now - entry.enqueued_at > self.queue_timeout_s:
                self._queue.popleft()
                events.append(SinkEvent(d.request_id, KVPoll.Failed, True, reason=(
                    f"request {d.request_id!r} waited {now - entry.enqueued_at:.1f}s for decode blocks or for "
                    f"the transfer meta of {d.source!r} (queue timeout {self.queue_timeout_s}s)")))
                continue
            meta = self.peer_meta(d.source, d.meta_index)
            if meta is None:
                break
            if not self._reserve(entry):
                break
            self._queue.popleft()
            self._admitted += 1
            entry.admit_seq = self._admitted
            events += self._start_pull(entry, meta)
        return events

    def _reserve(self, entry: _Import) -> bool:
        d = entry.descriptor
        T = self.adapter.tokens_per_block
        cached = self.adapter.acquire_cached_prefix(d.block_hashes)
        total = -(-(d.num_prompt_tokens + entry.max_new_tokens - 1) // T)
        fresh = self.adapter.allocate_blocks(total - len(cached))
        if fresh is None:
            self.adapter.free_blocks(cached)
            return False
        entry.cached, entry.fresh = cached, fresh
        return True

    def _start_pull(self, entry: _Import, meta: Mapping[str, Any]) -> list[SinkEvent]:
        d = entry.descriptor
        src = list(d.block_ids[len(entry.cached):])
        dst = entry.fresh[: len(src)]
        entry.state = KVPoll.Transferring
        entry.started_at = time.monotonic()
        if not src:  # the whole prompt was cached here: nothing to read
            return [self._complete(entry)]
        try:
            kv_meta, generations_meta = split_transfer_meta(meta)
            expected = d.generations[len(entry.cached):]  # the cached prefix is not read, so not checked
            entry.verified = self.checker is not None and generations_meta is not None and bool(expected)
            if entry.verified:
                entry.handle = self.checker.begin_pull_verified(kv_meta, generations_meta, src, dst, expected,
                                                                request_id=d.request_id)
            else:
                entry.handle = self.backend.begin_pull_blocks(kv_meta, src, dst, request_id=d.request_id)
        except Exception as exc:  # nothing in flight: once a part is posted, a backend reports through a handle or
            # a TransferStartError(storage_safe=True) (``KVTransportBackend._post_pulls``); anything else came first
            if not isinstance(exc, KVXferError):
                log.exception("request %r: the pull could not start", d.request_id)
            self.adapter.free_blocks(entry.cached + entry.fresh)
            entry.state = KVPoll.Failed
            return [SinkEvent(d.request_id, KVPoll.Failed, True, reason=f"pull refused: {exc}")]
        self._transferring[d.request_id] = entry
        if self.on_posted is not None and getattr(self.backend, "is_push", False):
            self.on_posted(d.request_id, len(entry.cached))
        return []

    def _poll_transfers(self) -> list[SinkEvent]:
        events = []
        for request_id, entry in list(self._transferring.items()):
            try:
                done = entry.handle.poll()
            except TornReadError as exc:
                del self._transferring[request_id]
                events.append(self._fail(entry, f"torn read detected, KV discarded: {exc}", exc))
                continue
            except Exception as exc:  # KVXferError; anything else fails this request, not the engine loop
                del self._transferring[request_id]
                events.append(self._fail(entry, f"pull failed: {exc}", exc))
                continue
            if done:
                del self._transferring[request_id]
                events.append(self._complete(entry))
        return events

    def _complete(self, entry: _Import) -> SinkEvent:
        d = entry.descriptor
        n_cached = len(entry.cached)
        pulled = len(d.block_ids) - n_cached
        self.pull_stats[d.request_id] = PullStats(pulled, entry.started_at - entry.enqueued_at,
                                                  time.monotonic() - entry.started_at, entry.admit_seq,
                                                  entry.verified)
        table = entry.cached + entry.fresh
        fenced = (self.commit_guard(d.request_id) if self.commit_guard is not None and not entry.abort_reason
                  else None)
        if fenced:  # the read completed (nothing in flight), but the bytes may not be this request's
            self.adapter.free_blocks(table)
            entry.state = KVPoll.Failed
            return SinkEvent(d.request_id, KVPoll.Failed, True, n_cached, pulled, reason=fenced)
        if entry.abort_reason:  # before any hash is registered: an aborted read's bytes may not be this prompt's
            self.adapter.free_blocks(table)
            entry.state = KVPoll.Failed
            return SinkEvent(d.request_id, KVPoll.Failed, True, n_cached, pulled, reason=entry.abort_reason)
        n_full = len(d.block_hashes)
        self.adapter.register_block_hashes(table[n_cached:n_full], d.block_hashes[n_cached:n_full])
        self.adapter.admit_decode_request(ImportedRequest(
            d.request_id, d.prompt, d.resume_tokens, tuple(table), entry.max_new_tokens, n_cached, pulled))
        entry.state = KVPoll.Success
        return SinkEvent(d.request_id, KVPoll.Success, True, n_cached, pulled)

    def _fail(self, entry: _Import, reason: str, error: Optional[BaseException] = None) -> SinkEvent:
        d = entry.descriptor
        entry.state = KVPoll.Failed
        self.adapter.free_blocks(entry.cached)  # the prefix was never a destination
        entry.cached = []
        safe = entry.handle is None or entry.handle.storage_safe
        if safe:
            self.adapter.free_blocks(entry.fresh)
        else:
            self._quarantine.hold(d.request_id, [entry.handle], entry.abort_reason or reason, entry)
        return SinkEvent(d.request_id, KVPoll.Failed, safe, reason=entry.abort_reason or reason, error=error)

    def _clear_quarantine(self) -> list[SinkEvent]:
        events = []
        for held in self._quarantine.reclaim():
            self.adapter.free_blocks(held.item.fresh)
            events.append(SinkEvent(held.key, KVPoll.Failed, True, reason="quarantine cleared",
                                    quarantine_cleared=True))
        return events
