"""One ucx pull: a batch of gets (and, chained, a guard read) followed to its end; the read-done or
read-failed it owes its source is sent through the backend, the failure only once no get can still land."""

from __future__ import annotations

import time
from typing import Any, Optional

from kvxfer.backends.transfer import RequestId, TransferHandle
from kvxfer.backends.ucx import binding as _ucp
from kvxfer.backends.ucx.peer import Peer
from kvxfer.errors import TransferError

_CANCEL_GRACE_S = 0.5  # how long an abort waits for cancelled gets before force-closing the endpoint


class UcxHandle(TransferHandle):
    """One pull: a batch of gets on one endpoint; with ``guard_peer``, the guard read chained behind it
    on the endpoint to the guard's source (``begin_chained_pull``), which also hears the notices."""

    # ``backend`` is the UcxBackend that posted the pull (typed Any: backend.py imports this module).
    def __init__(self, request_id: RequestId, timeout_s: float, backend: Any, peer: Peer,
                 batch: _ucp.GetBatch, notify: bool = True, report_failure: bool = True,
                 guard_peer: Optional[Peer] = None) -> None:
        super().__init__(request_id, timeout_s)
        self._notify_done = notify
        self._report_failure = report_failure
        self._backend = backend
        self._peer = peer
        self._notice_peer = guard_peer or peer
        self._chained = guard_peer is not None  # a GetBatch with a GuardGet (``begin_chained_pull``)
        self._done_told = False  # the binding sent the read-done (a chained read whose guard landed)
        #: every endpoint a get of this handle goes through (the guard's too)
        self._peers = (peer,) if guard_peer is None or guard_peer is peer else (peer, guard_peer)
        self._batch = batch
        self._failure_reason: Optional[str] = None
        self._failure_sent = False

    @property
    def _in_flight_peers(self) -> tuple[Peer, ...]:
        """The endpoints a get of this handle may still be on: the guard's only once it was posted."""
        if len(self._peers) == 1 or self._batch.guard_in_flight:
            return self._peers
        return self._peers[:1]

    @property
    def _cannot_land(self) -> bool:
        return all(peer.gets_cannot_land for peer in self._in_flight_peers)

    def _release(self) -> None:
        """Release the batch. A chained read-done the binding sent is remembered (no "failed" follows
        it); one still leaving is handed to the backend, which tracks it like its own notices."""
        if self._chained:
            state, request = self._batch.take_notice()
            if request is not None:
                self._backend._adopt_notice(self._notice_peer, request, "done", self.request_id)
            self._done_told = state == 2 or request is not None
        self._backend._release_batch(self._peers, self._batch)

    @property
    def path(self) -> str:
        """"same-host" (zero-copy shared memory, death seen by pidfd) or "peer-error-mode"."""
        return self._peer.path

    def _progress(self) -> bool:
        batch = self._batch
        if not batch.done:
            if self._backend.closed:  # failed here, by the thread that polls: close() need not wait for its lock
                raise TransferError(f"request {self.request_id!r}: the ucx backend was closed")
            self._backend._worker.progress()
        if not batch.done:
            for peer in self._peers:
                if peer.source_exited:
                    raise TransferError(f"request {self.request_id!r}: the source process exited during the read")
                if peer.endpoint.error is not None:
                    raise TransferError(f"request {self.request_id!r}: the endpoint to the source failed "
                                        f"({_ucp.status_string(peer.endpoint.error)}) during the read")
            return False
        if not _ucp.is_ok(batch.status):
            what = ("UCX get of the guard (chained behind the data read, which landed)"
                    if self._chained and _ucp.is_ok(int(batch.counter.status)) else "UCX get")
            raise TransferError(
                f"request {self.request_id!r}: {what} failed: {_ucp.status_string(batch.status)}"
                + ("; the source endpoint reported an error (the source process may have died)"
                   if any(peer.failed for peer in self._peers) else "")
            )
        return True

    def _abort(self) -> bool:
        batch = self._batch
        if not batch.done:
            batch.cancel()
            self._wait_batch(_CANCEL_GRACE_S)
        if not batch.done:
            # Not cancellable in time: force-close the endpoints, which completes every get on them
            # (the guard endpoint, shared by every chained read from that source, only while this
            # guard read is on it: ``cancel`` already stopped the chain from posting one).
            for peer in self._in_flight_peers:
                self._backend._drop_peer(peer)
                peer.endpoint.close()
            self._wait_batch(_CANCEL_GRACE_S)
        if batch.done:
            self._release()
            return True
        return self._cannot_land or self._backend._worker_closed

    def _settle(self) -> bool:
        # batch done: every get completed or was cancelled (the progress thread releases it and
        # tells the source); or the endpoints are closed and the source gone, or the whole worker
        # destroyed (close()): none can complete.
        return self._batch.done or self._cannot_land or self._backend._worker_closed

    def _wait_batch(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._batch.done and time.monotonic() < deadline:
            self._backend._worker.progress()
            time.sleep(0.0005)

    def _on_done(self) -> None:
        self._release()
        self._backend._finish(self)
        if self._notify_done and not self._done_told:  # a chained read's went from the binding already
            self._backend._notify(self._notice_peer, "done", self.request_id)

    def _on_failed(self, error: TransferError) -> None:
        self._failure_reason = str(error)
        self._backend._finish(self)
        if self._batch.released:
            self._send_failure()
        else:
            self._backend._defer(self)  # sent by the progress thread once every get has completed

    def _send_failure(self) -> None:
        if self._failure_sent or not self._report_failure or self._done_told:
            return  # (told "done" already: the guard landed and the binding said so before this failure)
        self._failure_sent = True
        # Sent even if the endpoint failed: a cut link looks like a dead source, and the
        # source must hear of it when the link returns (kept and retried, bounded).
        self._backend._notify(self._notice_peer, "failed", self.request_id, self._failure_reason or "")
