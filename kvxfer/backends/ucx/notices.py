"""Read-done / read-failed notices over UCX active messages: ours sent to a source (kept and retried when they
cannot leave), and peers' received until drained.

A notice that cannot leave (the send fails, or hangs: e.g. a new endpoint connecting through a cut cable) is
kept per source address and sent again, with a backoff, on a fresh endpoint until it goes or ``_NOTICE_KEEP_S``
has passed; so a source behind a long link cut still learns of the failure once it is reachable again, as
NIXL's notifications do. Kept notices are bounded (``_NOTICE_MAX_PENDING``); one that is dropped is logged.
Delivery means UCX completed the send: a repeat may reach the source twice (releases are idempotent).

``NoticeOutbox`` is mixed into ``UcxBackend``: it works on the backend's worker (each method says whether the
worker lock is held), its peer table (``_peer_for``, ``_drop_peer``) and its counters, and keeps the state
``UcxBackend._register`` creates (``_sends``, ``_outbox``, ``_notices``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from kvxfer.backends.transfer import RequestId
from kvxfer.backends.ucx import binding as _ucp
from kvxfer.backends.ucx.peer import Peer
from kvxfer.backends.ucx.source import unb64
from kvxfer.meta import notice as notify

logger = logging.getLogger(__name__)

AM_ID = 0x4B56  # "KV": the active-message id of read-done / read-failed notices
_NOTICE_RETRY_FIRST_S = 0.25  # first retry of a notice that could not leave; doubles per attempt...
_NOTICE_RETRY_MAX_S = 2.0     # ...up to this
_NOTICE_STALL_S = 4.0  # a notice send pending this long on an endpoint without gets is retried on a fresh one
_NOTICE_KEEP_S = 120.0  # a notice still undelivered after this is dropped (logged)
_NOTICE_MAX_PENDING = 4096
#: Peers' notices received and not yet drained: a source that never drains (or a flooding peer)
#: costs at most this many headers of at most ``notice.MAX_NOTIFY_BYTES`` each.
_MAX_RAW_NOTICES = 16384


@dataclass
class Notice:
    """A read-done / read-failed notice on its way to one source address."""

    payload: bytes
    what: str  # for log lines: "read-failed of request 7"
    created: float
    attempts: int = 0
    due: float = 0.0


@dataclass
class Send:
    """An active-message send UCX has not completed yet."""

    peer: Peer
    request: Any
    notice: Notice
    posted: float


class NoticeOutbox:
    """``UcxBackend``'s notices (see the module docstring): sent, kept, retried, received.

    Besides the state below (created by ``UcxBackend._register``) it uses the backend's ``_peer_for``,
    ``_drop_peer``, ``_shut``, ``_stats``, ``agent_name`` and the contract's ``_deliver_read_*``."""

    _worker: _ucp.Worker
    _sends: list[Send]  # our AM sends UCX has not completed yet
    _outbox: dict[bytes, deque[Notice]]  # source address -> notices waiting for a retry
    _outbox_size: int
    _notices: deque[bytes]  # peers' notices received, not yet drained
    notices_dropped: int  # ours given up on (too old, or too many kept)

    def _notify(self, peer: Peer, kind: notify.Kind, request_id: RequestId, reason: str = "") -> None:
        """Send a notice to ``peer``'s source; one that cannot leave now is kept and retried."""
        self._notify_address(peer.address, kind, request_id, reason, peer)

    def _notify_address(self, address: bytes, kind: notify.Kind, request_id: RequestId, reason: str = "",
                        peer: Optional[Peer] = None) -> None:
        """The shared notice format (``kvxfer.meta.notice``); each registration has a worker of its own,
        so the notice's buffer id is always 0 here."""
        payload = notify.encode(kind, request_id, 0, reason)
        notice = Notice(payload, f"read-{kind} of request {request_id!r}", time.monotonic())
        with self._worker.lock:
            self._post_notice(address, notice, peer)

    def _adopt_notice(self, peer: Peer, request: Any, kind: notify.Kind, request_id: RequestId) -> None:
        """A notice the binding posted (a chained read-done) still in flight: tracked like ours."""
        notice = Notice(notify.encode(kind, request_id, 0), f"read-{kind} of request {request_id!r}",
                         time.monotonic(), attempts=1)
        with self._worker.lock:
            self._sends.append(Send(peer, request, notice, time.monotonic()))
            self._worker.inflight += 1
        self._worker.signal(only_if_idle=True)

    def _notify_source(self, peer_meta: Mapping[str, Any], request_id: RequestId,
                       failure: Optional[str] = None) -> None:
        address = unb64(peer_meta, "ucx_worker_address")
        if failure is None:
            self._notify_address(address, "done", request_id)
        else:
            self._notify_address(address, "failed", request_id, failure)

    def _post_notice(self, address: bytes, notice: Notice, peer: Optional[Peer] = None) -> None:
        """Worker lock held. On ``peer``'s endpoint if still usable, else on the cached (or a new) one."""
        if self._shut:  # closed: nothing can leave any more (a staged pull failing after close, say)
            logger.debug("ucx %r: closed; %s not sent", self.agent_name, notice.what)
            return
        notice.attempts += 1
        try:
            if peer is None or peer.failed:
                peer = self._peer_for(address)
            request = _ucp.send_active_message(peer.endpoint, AM_ID, notice.payload)
        except _ucp.UcpError as exc:
            self._requeue(address, notice, str(exc))
            return
        if request is not None:
            self._sends.append(Send(peer, request, notice, time.monotonic()))
            self._worker.inflight += 1
            self._worker.signal(only_if_idle=True)
        elif notice.attempts > 1:
            logger.info("ucx %r: %s delivered to the source after %d attempts (%.1fs)", self.agent_name,
                        notice.what, notice.attempts, time.monotonic() - notice.created)

    def _requeue(self, address: bytes, notice: Notice, why: str) -> None:
        """Worker lock held: keep a notice that did not leave, for a later attempt."""
        if self._outbox_size >= _NOTICE_MAX_PENDING:
            self.notices_dropped += 1
            self._stats.notice_undelivered()
            logger.warning("ucx %r: dropped %s: %d notices already wait for unreachable sources",
                           self.agent_name, notice.what, self._outbox_size)
            return
        now = time.monotonic()
        notice.due = now + min(_NOTICE_RETRY_FIRST_S * 2 ** (notice.attempts - 1), _NOTICE_RETRY_MAX_S)
        log = logger.info if notice.attempts == 1 else logger.debug
        log("ucx %r: %s could not reach the source (%s); retrying for up to %.0fs",
            self.agent_name, notice.what, why, _NOTICE_KEEP_S - (now - notice.created))
        self._outbox.setdefault(address, deque()).append(notice)
        self._outbox_size += 1

    def _reap_sends(self) -> None:
        """Worker lock held: finish completed AM sends; keep failed ones; unstick hung ones."""
        now = time.monotonic()
        still = []
        for send in self._sends:
            status = _ucp.request_status(self._worker, send.request)
            if _ucp.in_progress(status):
                if now - send.posted > _NOTICE_STALL_S and not send.peer.batches:
                    # e.g. a new endpoint connecting through a cut cable: retire it (its force-close
                    # completes this send as cancelled, and the notice is kept); a later attempt
                    # connects afresh. An endpoint with gets in flight is left to their timeouts.
                    self._drop_peer(send.peer)
                still.append(send)
                continue
            self._worker.inflight -= 1
            if not _ucp.is_ok(status):
                self._requeue(send.peer.address, send.notice, _ucp.status_string(status))
            elif send.notice.attempts > 1:
                logger.info("ucx %r: %s delivered to the source after %d attempts (%.1fs)", self.agent_name,
                            send.notice.what, send.notice.attempts, now - send.notice.created)
        self._sends = still

    def _retry_notices(self) -> None:
        """Worker lock held: send again what is due, one attempt at a time per source; drop the too old."""
        now = time.monotonic()
        busy = {send.peer.address for send in self._sends}
        for address in list(self._outbox):
            queue = self._outbox[address]
            while queue and now - queue[0].created > _NOTICE_KEEP_S:
                notice = queue.popleft()
                self._outbox_size -= 1
                self.notices_dropped += 1
                self._stats.notice_undelivered()
                logger.warning("ucx %r: gave up on %s: the source stayed unreachable for %.0fs (%d attempts)",
                               self.agent_name, notice.what, now - notice.created, notice.attempts)
            if not queue:
                del self._outbox[address]
                continue
            if address in busy or queue[0].due > now:
                continue
            del self._outbox[address]
            self._outbox_size -= len(queue)
            for notice in queue:
                self._post_notice(address, notice)

    def _on_notice(self, header: bytes) -> None:
        """A peer's read-done / read-failed (worker lock held): kept raw until drained, bounded. A header
        larger than any notice, or one past ``_MAX_RAW_NOTICES`` undrained, is dropped and counted."""
        if len(header) > notify.MAX_NOTIFY_BYTES or len(self._notices) >= _MAX_RAW_NOTICES:
            self._stats.notice_dropped()
            return
        self._notices.append(header)

    def _collect_notifications(self) -> None:
        self._worker.progress()
        while self._notices:
            message = notify.decode(self._notices.popleft())
            if message is None:
                continue  # not one of ours (or another wire version): dropped, never raised
            if message.kind == "done":
                self._deliver_read_done(message.request_id)
            else:
                self._deliver_read_failed(message.request_id, message.reason)
