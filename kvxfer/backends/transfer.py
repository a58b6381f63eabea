"""What a transfer is, apart from the backend that posts it: the request and its handle.

``PullRequest`` is one planned read handed to a transport; ``TransferHandle`` is its
lifecycle (``TransferState``: PROC, DONE, ERR) with the failure rule every caller reads
(the class raised follows ``storage_safe``; docs/api.md). ``GroupHandle`` joins the parts of
one request. Transports and the staged reshard build on these; ``kvxfer.backends.base``
(the backend contract) imports this module, never the other way round.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Optional, Sequence

import numpy as np

from kvxfer.backends.stats import TransferStats
from kvxfer.errors import TransferCancelledError, TransferError, TransferTimeoutError
from kvxfer.plan.descriptors import CopyPlan
from kvxfer.plan.geometry import PeerGeometry
from kvxfer.plan.request import RecordPlan
from kvxfer.plan.staged_reshard import StagedChunk

logger = logging.getLogger(__name__)

RequestId = Hashable  # an int or a str in practice; it travels in notifications


class TransferStartError(TransferError):
    """Starting a transfer failed after part of it may already have been posted.

    The seed's ``transfer_backends.base.TransferStartError``: ``storage_safe`` says
    whether any byte can still land in the destination blocks (False: quarantine
    them), ``cleanup_handles`` are the parts that were posted (already aborted), and
    ``transfer_destinations_safe`` is the attribute Megatron's engine reads. A failure
    before anything was posted is an ordinary ``KVXferError`` and plainly safe.
    """

    def __init__(self, message: str, storage_safe: bool = False, resources: Any = None,
                 cleanup_handles: Sequence["TransferHandle"] = ()) -> None:
        super().__init__(message)
        self.storage_safe = bool(storage_safe)
        self.transfer_destinations_safe = self.storage_safe
        self.resources = resources
        self.cleanup_handles = list(cleanup_handles)


class TransferState(str, enum.Enum):
    """A handle's whole lifecycle: in progress, done, or failed (final)."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


class TransferHandle(ABC):
    """One pull, as seen by the decode side.

    ``poll()`` drives it without blocking; ``wait()`` blocks. A handle that fails
    (transport error or timeout) is final, and ``storage_safe`` says whether the
    destination blocks can be reused: True only once no byte can still land in them.

    The failure contract, as callers read it (Megatron frees the destination on any
    exception that is not a ``TimeoutError``; docs/api.md): a failed handle raises

    - ``TransferTimeoutError`` (a ``TimeoutError``) while ``storage_safe`` is False,
      whatever the cause: some read may still land, keep the blocks quarantined;
    - once ``storage_safe`` is True, the failure itself (a plain ``TransferError``),
      or ``TransferCancelledError`` for a timeout whose cancellation is proven.

    So the class raised follows the storage, not the cause: a handle that timed out
    with a read still posted raises ``TransferTimeoutError`` until the transport
    proves that read over (it completed late, failed, or its source died), then a
    plain error. ``error`` is the cause, as first seen.
    """

    def __init__(self, request_id: RequestId, timeout_s: float) -> None:
        self.request_id = request_id
        self.timeout_s = timeout_s
        self.started_at = time.monotonic()
        self.finished_at: Optional[float] = None
        self._state = TransferState.PROC
        self._error: Optional[TransferError] = None
        self._storage_safe = False
        # Re-entrant: raising reads ``storage_safe``, which may settle the transport under the same lock.
        self._lock = threading.RLock()
        self._raised: dict[bool, TransferError] = {}  # the error as raised, per storage state
        self._stats: Optional[TransferStats] = None  # set by the backend that posted it
        self._num_bytes = 0
        self._num_descriptors = 0

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def error(self) -> Optional[TransferError]:
        """The cause of the failure, as first seen (what is *raised* depends on ``storage_safe``)."""
        return self._error

    @property
    def storage_safe(self) -> bool:
        """True once no byte of this transfer can still land in the destination.

        A failed handle whose transport could not prove that at once is checked
        again on every read of this property (``_settle``), so it turns True as soon
        as the late read ends, fails, or its source is gone.
        """
        if self._state is TransferState.DONE:
            return True
        if self._state is TransferState.PROC:
            return False
        if not self._storage_safe:
            with self._lock:
                if not self._storage_safe and self._settle_safely():
                    self._storage_safe = True
                    if self._stats is not None:
                        self._stats.unsafe(-1)
                    self._on_settled()
        return self._storage_safe

    @property
    def elapsed_s(self) -> float:
        return (self.finished_at or time.monotonic()) - self.started_at

    def poll(self) -> bool:
        """True when complete, False while in flight; raises on failure (see the class docstring)."""
        with self._lock:
            if self._state is TransferState.PROC:
                self._advance()
            if self._state is TransferState.ERR:
                raise self._failure_to_raise()
            return self._state is TransferState.DONE

    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Block until done. Past ``timeout_s`` (default: the handle's own timeout) the
        transfer is aborted and the failure raised: ``TransferTimeoutError`` while a read
        may still land, ``TransferCancelledError`` once the cancellation is proven."""
        deadline = self.started_at + self.timeout_s if timeout_s is None else time.monotonic() + timeout_s
        pause = 1e-5
        while not self.poll():
            if time.monotonic() >= deadline:
                with self._lock:
                    if self._state is TransferState.PROC:
                        self._fail(TransferTimeoutError(
                            f"request {self.request_id!r}: transfer not complete after {self.elapsed_s:.3f}s (wait timeout)"
                        ))
                self.poll()  # raises the (possibly concurrent) error
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def _failure_to_raise(self) -> TransferError:
        """The failure in the class the storage calls for (made once per storage state)."""
        safe = self.storage_safe
        raised = self._raised.get(safe)
        if raised is None:
            raised = self._raised[safe] = failure_for_caller(self._error, safe)
        return raised

    @property
    def bytes_requested(self) -> int:
        """Bytes this pull reads (every part of it), as counted in the backend's ``stats()``."""
        return self._num_bytes

    @property
    def descriptors_posted(self) -> int:
        """Descriptors it posted after coalescing, as counted in the backend's ``stats()``."""
        return self._num_descriptors

    def _count_in(self, stats: TransferStats, num_bytes: int, num_descriptors: int = 0) -> None:
        """Attach the posting backend's counters; a handle already finished is counted now."""
        self._stats, self._num_bytes, self._num_descriptors = stats, num_bytes, num_descriptors
        if self._state is TransferState.DONE:
            stats.completed(num_bytes)
        elif self._state is TransferState.ERR:  # failed before it was counted (a start that failed)
            stats.failed(timed_out=False)
            if not self._storage_safe:
                stats.unsafe(+1)

    def _advance(self) -> None:
        try:
            done = self._progress()
        except TransferError as exc:
            self._fail(exc)
            return
        except Exception as exc:  # any other error still ends the handle: never PROC past its timeout
            failure = TransferError(f"request {self.request_id!r}: {type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            self._fail(failure)
            return
        if done:
            self._state = TransferState.DONE
            self.finished_at = time.monotonic()
            if self._stats is not None:
                self._stats.completed(self._num_bytes)
            self._on_done()
        elif time.monotonic() - self.started_at > self.timeout_s:
            self._fail(TransferTimeoutError(
                f"request {self.request_id!r}: transfer not complete within its {self.timeout_s}s timeout; "
                "the source may be dead or unreachable"
            ))

    def _fail(self, error: TransferError) -> None:
        self._state = TransferState.ERR
        self._error = error
        self.finished_at = time.monotonic()
        if self._stats is not None:
            self._stats.failed(timed_out=isinstance(error, TransferTimeoutError))
        try:
            try:
                self._storage_safe = bool(self._abort())
            except Exception:  # an abort that breaks proves nothing: the storage stays unsafe
                logger.exception("request %r: aborting the transfer failed; its destination stays quarantined",
                                 self.request_id)
                self._storage_safe = False
        finally:
            if not self._storage_safe and self._stats is not None:
                self._stats.unsafe(+1)
            try:
                self._on_failed(error)
            except Exception:  # telling the source is best effort; the handle's failure stands
                logger.exception("request %r: reporting the failure failed", self.request_id)

    def _settle_safely(self) -> bool:
        try:
            return bool(self._settle())
        except Exception:
            logger.exception("request %r: checking whether the failed transfer is over failed", self.request_id)
            return False

    # --- transport hooks ------------------------------------------------------------------
    @abstractmethod
    def _progress(self) -> bool:
        """Advance the transport; True when every byte has landed. Raise ``TransferError`` on failure."""

    def _abort(self) -> bool:
        """Cancel and release what is in flight; return True only if no byte can still land."""
        return True

    def _settle(self) -> bool:
        """After a failure that ``_abort`` could not prove safe: True once no byte can land now."""
        return False

    def _on_settled(self) -> None:
        """Called once when a failed handle's storage turns safe after ``_abort`` (e.g. tell the source)."""

    def _on_done(self) -> None:
        """Called once on success (e.g. tell the source its blocks are free)."""

    def _on_failed(self, error: TransferError) -> None:
        """Called once on failure (e.g. tell the source the request failed)."""


def failure_for_caller(error: Optional[TransferError], storage_safe: bool) -> TransferError:
    """``error`` in the class that tells a caller whether the destination may be reused.

    Unsafe storage is always a ``TransferTimeoutError`` (a ``TimeoutError``: "may
    still be active"); safe storage never is (a timeout whose cancellation is proven
    becomes ``TransferCancelledError``). Any other safe failure is raised as it is.
    """
    if error is None:
        error = TransferError("transfer failed")
    if storage_safe:
        if not isinstance(error, TransferTimeoutError):
            return error
        raised: TransferError = TransferCancelledError(
            f"{error}; it was cancelled and no byte of it can land any more (storage_safe=True)")
    else:
        raised = TransferTimeoutError(
            f"{error}; part of it may still land (storage_safe=False): keep the destination blocks "
            "quarantined until handle.storage_safe is True")
    raised.__cause__ = error
    return raised


class CompletedHandle(TransferHandle):
    """A pull with nothing to move (e.g. a peer holding none of our slices)."""

    def __init__(self, request_id: RequestId) -> None:
        super().__init__(request_id, timeout_s=0.0)
        self._state = TransferState.DONE
        self.finished_at = self.started_at

    def _progress(self) -> bool:
        return True


class GroupHandle(TransferHandle):
    """One request pulled from several peers: done when every part is, failed when any fails.

    Its storage is safe only when every part's is: a part that failed while another is
    still reading makes the group raise ``TransferTimeoutError`` until that one is over.
    """

    def __init__(self, request_id: RequestId, parts: Sequence[TransferHandle], timeout_s: float) -> None:
        super().__init__(request_id, timeout_s)
        self.parts = list(parts)

    def _progress(self) -> bool:
        return all([part.poll() for part in self.parts])  # poll all, even after one is pending

    def _abort(self) -> bool:
        return abort_parts(self.parts, f"request {self.request_id!r}: aborted with its group")

    def _settle(self) -> bool:
        return all(part.storage_safe for part in self.parts)


def abort_parts(parts: Sequence[Optional[TransferHandle]], reason: str) -> bool:
    """Fail every part still in flight; True if no byte of any part can still land."""
    safe = True
    for part in parts:
        if part is None:
            continue
        with part._lock:
            if part.state is TransferState.PROC:
                part._fail(TransferError(reason))
        safe &= part.storage_safe
    return safe


@dataclass(frozen=True)
class PullRequest:
    """One validated pull, handed to a transport's ``_post_read``."""

    peer_meta: Mapping[str, Any]
    peer: PeerGeometry
    src_ids: np.ndarray
    dst_ids: np.ndarray
    plan: CopyPlan
    request_id: RequestId
    notify: bool = True  # send the source a read-done when the read completes
    #: Tell the source when this read fails. False for a read that is part of a larger pull whose
    #: handle tells the source itself, once (the chunks of a staged reshard).
    report_failure: bool = True
    #: A staged reshard (``kvxfer.backends.staged``): chunks read into staging, then placed; ``plan`` is unused.
    staged: tuple[StagedChunk, ...] = ()
    #: Absolute address the plan's destination offsets are from, when not our pool (a staging range).
    local_base: Optional[int] = None

    @staticmethod
    def for_record(record: RecordPlan, request_id: RequestId, notify: bool) -> "PullRequest":
        return PullRequest(record.meta, record.peer, record.src_ids, record.dst_ids, record.copy, request_id, notify,
                           staged=record.staged)

    @property
    def total_bytes(self) -> int:
        return sum(c.read.total_bytes for c in self.staged) if self.staged else self.plan.total_bytes

    @property
    def num_descriptors(self) -> int:
        return sum(c.read.num_descriptors for c in self.staged) if self.staged else self.plan.num_descriptors


@dataclass(frozen=True)
class ChainedGuard:
    """The guard read a transport chains behind a data read (``begin_chained_pull``): block ``block``
    of a prepared source (``source``: a ``kvxfer.meta.records.PreparedPeer``) into this process's
    host memory at ``address``, which holds ``nbytes``: a source whose block is of another size is
    not chained (the caller's own guard read then refuses it as any read would)."""

    source: Any
    block: int
    address: int
    nbytes: int


@dataclass(frozen=True)
class ReadFailure:
    """A read-failure report received by a source: the request and why it failed."""

    request_id: RequestId
    reason: str
