"""Non-blocking completion of posted point-to-point works, with the process group's error.

Measured on torch 2.13 (``docs/nccl.md``): a Gloo send/recv ``Work`` never reports
``is_completed()`` on its own -- it turns True only inside ``wait()``, even when the
bytes have long arrived -- and ``Work.exception()`` returns None (and warns that it
is deprecated) even when the peer is gone. ``wait()`` is what raises "Connection
closed by peer" at once when the peer died, and ``wait(timeout)`` must not be used
to poll: on expiry Gloo closes the pair, which breaks it for every later operation.

So each (process group, peer) with Gloo works in flight gets one daemon thread that
calls ``wait()`` on them in post order (operations between a pair complete in that
order anyway) and records success or the error; the first error is permanent for
the pair, as it is in Gloo. Polling a handle only reads those records. NCCL works
answer ``is_completed()`` from CUDA events, without a thread; a completed one is
then ``wait()``-ed to surface a communicator error.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Optional, Sequence

from kvxfer.errors import TransferError

logger = logging.getLogger(__name__)


def describe(exc: BaseException) -> str:
    """The process group's error, one line, as the user should see it."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:500]}"


class WorkState:
    """One ``Work`` and what is known of it: pending, done, or failed with the group's error."""

    def __init__(self, work: Any, peers: Sequence[int]) -> None:
        self.work = work
        self.peers = tuple(peers)
        self.done = False
        self.error: Optional[str] = None

    def succeed(self) -> None:
        self.done = True

    def fail(self, error: str) -> None:
        self.error = error


class _PeerWaiter:
    """Waits, in post order, on the Gloo works exchanged with one peer (see the module docstring)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.error: Optional[str] = None
        self._queue: deque[WorkState] = deque()
        self._lock = threading.Lock()
        self._running = False

    def submit(self, state: WorkState) -> None:
        with self._lock:
            if self.error is not None:
                state.fail(self.error)
                return
            self._queue.append(state)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name=f"kvxfer-nccl-wait-{self.label}", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                state = self._queue[0]
            error = None
            try:
                state.work.wait()
            except Exception as exc:  # the process group's error, reported, never swallowed
                error = describe(exc)
            with self._lock:
                self._queue.popleft()
                if error is None:
                    state.succeed()
                    continue
                self.error = error
                logger.warning("point-to-point with %s failed: %s", self.label, error)
                state.fail(error)
                while self._queue:
                    self._queue.popleft().fail(error)
                self._running = False
                return


_WAITERS: dict[tuple[int, int], _PeerWaiter] = {}
_WAITERS_LOCK = threading.Lock()


def _waiter(group_key: int, peer: int) -> _PeerWaiter:
    with _WAITERS_LOCK:
        waiter = _WAITERS.get((group_key, peer))
        if waiter is None:
            waiter = _WAITERS[(group_key, peer)] = _PeerWaiter(f"rank{peer}")
        return waiter


def peer_error(group_key: int, peer: int) -> Optional[str]:
    """The permanent Gloo error of a pair, if one was seen."""
    with _WAITERS_LOCK:
        waiter = _WAITERS.get((group_key, peer))
    return None if waiter is None else waiter.error


class Completion:
    """The works of one batch of point-to-point operations, checked without blocking."""

    def __init__(self, works: Sequence[Any], peers: Sequence[int], *, threaded: bool, group_key: int) -> None:
        works = list(works)
        if len(works) == len(peers):
            self.states = [WorkState(w, [p]) for w, p in zip(works, peers)]
        else:  # a coalesced batch (NCCL): one work for every peer of the batch
            self.states = [WorkState(w, peers) for w in works]
        self.threaded = threaded
        if threaded:
            for state in self.states:
                _waiter(group_key, state.peers[0]).submit(state)

    def check(self) -> bool:
        """True once every work is done; ``TransferError`` with the group's error if one failed."""
        for state in self.states:
            if state.error is not None:
                raise TransferError(f"point-to-point with rank(s) {list(state.peers)} failed: {state.error}")
        if self.threaded:
            return all(state.done for state in self.states)
        for state in self.states:
            if not state.done:
                if not state.work.is_completed():
                    return False
                try:
                    state.work.wait()  # completed: returns at once, or raises the communicator's error
                except Exception as exc:
                    state.fail(describe(exc))
                    raise TransferError(f"point-to-point with rank(s) {list(state.peers)} failed: {state.error}") from None
                state.succeed()
        return True

    def settled(self) -> bool:
        """True when no transport can still touch the buffers (done or failed); never raises."""
        if self.threaded:
            return all(state.done or state.error is not None for state in self.states)
        return all(state.done or state.error is not None or state.work.is_completed() for state in self.states)
