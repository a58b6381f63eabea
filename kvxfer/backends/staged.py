"""The handle of a staged reshard pull: read whole slices into staging, then place heads locally.

``kvxfer.plan.staged_reshard`` plans the chunks; this drives them one after another
through the transport's ordinary ``_post_read`` (its destination being a range of the
backend's staging region instead of the pool) and places each chunk's heads into the
pool with one tensor copy on the pool's device. The pool is only ever written by those
placements, after a chunk's read completed, so a failed or aborted pull leaves the pool
untouched past its last completed chunk: ``storage_safe`` is always True, and a staging
range whose read could not be stopped is quarantined instead, until that read is over
(``StagingArena.reclaim``), so no other pull is ever handed a range a late byte can hit.

The source hears of the pull once, from this handle, never from its chunk reads: read-done
when the last chunk is placed, or read-failed once none of its chunk reads can still move
(their quarantined ranges reclaimed). A chunk read cannot carry the read-done: one that
completes after the pull failed would tell the source "done" beside the "failed".
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from kvxfer.backends.staging import StagingArena
from kvxfer.backends.transfer import PullRequest, TransferHandle, TransferStartError, TransferState
from kvxfer.errors import TransferError
from kvxfer.plan.staged_reshard import Placement, StagedChunk


@dataclasses.dataclass(frozen=True)
class StagingPort:
    """All a staged pull needs of its backend, and nothing more: the staging region (made on first
    use), the transport's ordinary read, the source's notice, the pool the heads land in, the timeout."""

    arena: Callable[[], StagingArena]
    post_read: Callable[[PullRequest], TransferHandle]
    notify_source: Callable[..., None]  # (peer_meta, request_id, failure=None)
    pool: torch.Tensor
    timeout_s: float


#: Chunks a pull keeps posted at once: the next chunk's read overlaps the last one's placement.
PIPELINE_DEPTH = 2


@dataclasses.dataclass
class _Posted:
    chunk: StagedChunk
    offset: int
    part: TransferHandle


class StagedHandle(TransferHandle):
    """Chunks in order, up to ``PIPELINE_DEPTH`` posted: allocate staging, post the read;
    when the oldest completes, place it and release its range."""

    path = "staged"

    def __init__(self, port: StagingPort, pull: PullRequest) -> None:
        super().__init__(pull.request_id, port.timeout_s)
        self._port = port
        self._pull = pull
        self._chunks = list(pull.staged)
        self._next = 0
        self._posted: collections.deque[_Posted] = collections.deque()
        self._reads_left = 0  # after a failure: chunk reads still moving (their ranges quarantined)
        self._failure_reason: Optional[str] = None

    def _progress(self) -> bool:
        while True:
            while len(self._posted) < PIPELINE_DEPTH and self._next < len(self._chunks) and self._post_next():
                pass
            if not self._posted:
                return self._next == len(self._chunks)  # False: staging busy with other pulls, retry later
            if not self._posted[0].part.poll():  # raises TransferError on failure
                return False
            self._place(self._posted.popleft())

    def _post_next(self) -> bool:
        chunk = self._chunks[self._next]
        arena = self._port.arena()
        offset = arena.allocate(chunk.staging_bytes)
        if offset is None:
            return False
        sub = dataclasses.replace(self._pull, plan=chunk.read, staged=(), notify=False, report_failure=False,
                                  local_base=arena.base + offset)
        try:
            part = self._port.post_read(sub)
        except TransferStartError as exc:  # part of the read may be moving into that range
            if exc.storage_safe:
                arena.release(offset, chunk.staging_bytes)
            else:
                self._quarantine(offset, chunk.staging_bytes, exc.cleanup_handles)
            raise
        except BaseException:
            arena.release(offset, chunk.staging_bytes)
            raise
        self._posted.append(_Posted(chunk, offset, part))
        self._next += 1
        return True

    def _place(self, posted: _Posted) -> None:
        arena = self._port.arena()
        staging = arena.view(posted.offset, posted.chunk.staging_bytes)
        for placement in posted.chunk.placements:
            apply_placement(staging, self._port.pool, placement)
        if staging.is_cuda:  # the range is reused only after the copy out of it has run
            torch.cuda.current_stream(staging.device).synchronize()
        arena.release(posted.offset, posted.chunk.staging_bytes)

    def _abort(self) -> bool:
        arena = self._port.arena()
        while self._posted:
            posted = self._posted.popleft()
            part = posted.part
            with part._lock:
                if part.state is TransferState.PROC:
                    part._fail(TransferError(f"request {self.request_id!r}: aborted with its staged pull"))
            if part.storage_safe:
                arena.release(posted.offset, posted.chunk.staging_bytes)
            else:
                self._quarantine(posted.offset, posted.chunk.staging_bytes, [part])
        return True  # the pool is written only by placements, which run after a completed read

    def _quarantine(self, offset: int, nbytes: int, parts: Sequence[TransferHandle]) -> None:
        """Keep a range whose read may still land out of use; the source hears once all are over."""
        self._reads_left += 1
        self._port.arena().quarantine(
            offset, nbytes, read_over=lambda: all(p.storage_safe for p in parts), on_reclaimed=self._one_read_over)

    def _one_read_over(self) -> None:
        self._reads_left -= 1
        if self._reads_left == 0 and self._failure_reason is not None:
            self._tell_source()

    def _on_failed(self, error: TransferError) -> None:
        self._failure_reason = str(error)
        if self._reads_left == 0:
            self._tell_source()

    def _on_done(self) -> None:
        if self._pull.notify:
            self._port.notify_source(self._pull.peer_meta, self.request_id)

    def _tell_source(self) -> None:
        self._port.notify_source(self._pull.peer_meta, self.request_id, failure=self._failure_reason or "")


def apply_placement(staging: torch.Tensor, pool: torch.Tensor, placement: Placement) -> None:
    """Copy one transfer's heads from the staged bytes into the pool (on the pool's device)."""
    t = placement.transfer
    _, _, _, tokens, _, head_dim = pool.shape
    n = placement.dst_ids.size
    count = 2 * t.num_layers * n * tokens * placement.src_heads_local * head_dim
    size = pool.element_size()
    staged = (staging[placement.staging_offset:placement.staging_offset + count * size]
              .view(pool.dtype).view(2, t.num_layers, n, tokens, placement.src_heads_local, head_dim))
    ids = torch.from_numpy(np.ascontiguousarray(placement.dst_ids)).to(pool.device)
    # index_copy_ into the strided view writes the pool itself (faster than an advanced-index assignment)
    pool[:, t.dst_layers, :, :, t.dst_heads].index_copy_(2, ids, staged[:, :, :, :, t.src_heads])
