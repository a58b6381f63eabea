"""One posted NIXL READ: its state read from the agent, released only once NIXL reports it over."""

from __future__ import annotations

from typing import Any, Optional

from kvxfer.meta import notice as notify
from kvxfer.backends.nixl.agent import AgentShare
from kvxfer.backends.nixl.peer import NixlPeer
from kvxfer.backends.transfer import RequestId, TransferHandle
from kvxfer.errors import TransferError


class NixlHandle(TransferHandle):
    """One posted NIXL READ.

    ``path`` is ``"prepped"`` (indices into prepared lists) or ``"rows"`` (Nx3
    descriptor lists); ``num_descriptors``/``raw_descriptors`` are the coalesced
    and naive row counts; ``build_s`` the time spent building the request.
    The xfer is released only once NIXL reports it over (module docstring).
    """

    def __init__(self, request_id: RequestId, timeout_s: float, share: AgentShare, in_flight: set["NixlHandle"],
                 unsettled: set["NixlHandle"], xfer: Any, peer: NixlPeer, *, path: str, num_descriptors: int,
                 raw_descriptors: int, total_bytes: int, build_s: float, report_failure: bool = True) -> None:
        super().__init__(request_id, timeout_s)
        self._report_failure = report_failure
        self._share = share
        self._in_flight = in_flight  # the backend's handles in flight: this one leaves once released
        self._unsettled = unsettled  # the backend's failed handles whose READ may still move
        self._xfer = xfer
        self._peer = peer
        self._released = False
        self._read_completed = False
        self._failure_reason: Optional[str] = None
        self._failure_sent = False
        self.path = path
        self.num_descriptors = num_descriptors
        self.raw_descriptors = raw_descriptors
        self.total_bytes = total_bytes
        self.build_s = build_s

    def _xfer_state(self) -> str:
        """``DONE``, ``PROC``, ``ERR`` (over: failed, nothing of it moves any more) or ``UNKNOWN``."""
        if self._released:
            return "DONE" if self._read_completed else "ERR"
        share = self._share
        with share.lock:
            if share.agent is None:
                return "UNKNOWN"
            try:
                return share.agent.check_xfer_state(self._xfer)
            except Exception as exc:
                # A remote disconnect ends the READ (measured: nothing lands after it). Anything else
                # (e.g. NOT_FOUND after the peer was invalidated) says nothing about whether it moves.
                return "ERR" if type(exc).__name__ == "nixlRemoteDisconnectError" else "UNKNOWN"

    def _progress(self) -> bool:
        state = self._xfer_state()
        if state == "DONE":
            self._read_completed = True
            self._release()
            return True
        if state == "ERR":
            raise TransferError(
                f"request {self.request_id!r}: NIXL READ from peer {self._peer.name!r} failed "
                "(peer dead or unreachable, or its memory deregistered)"
            )
        return False

    def _release(self) -> bool:
        """Free the xfer handle; only ever called once NIXL reports the READ over."""
        if self._released:
            return True
        share = self._share
        with share.lock:
            try:
                share.agent.release_xfer_handle(self._xfer)
            except Exception:
                return False  # kept; retried when storage_safe is next read
        self._released = True
        # The binding's xfer handle keeps the native agent alive (its fds and threads):
        # a handle kept by the caller after close() must not keep it too.
        self._xfer = None
        self._in_flight.discard(self)
        share.read_closed(self._peer.name)
        return True

    def _abort(self) -> bool:
        """Safe only if the READ is over (then released); an active READ is never released."""
        state = self._xfer_state()
        if state not in ("DONE", "ERR"):
            return False
        # A read that completed right at the deadline has already sent its done notification.
        self._read_completed = state == "DONE"
        return self._release()

    def _settle(self) -> bool:
        return self._abort()

    def _on_failed(self, error: TransferError) -> None:
        self._failure_reason = str(error)
        if self._released:
            self._notify_failed()
        else:
            self._unsettled.add(self)

    def _on_settled(self) -> None:
        self._unsettled.discard(self)
        self._notify_failed()

    def _notify_failed(self) -> None:
        """Tell the source, once no byte of the read can still move."""
        if self._read_completed or self._failure_sent or not self._report_failure:
            return
        self._failure_sent = True
        message = notify.encode("failed", self.request_id, self._peer.buffer_id, self._failure_reason or "")
        self._share.send(self._peer.name, message)
