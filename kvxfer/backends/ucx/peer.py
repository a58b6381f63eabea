"""One source as the reader holds it: the endpoint to its worker, the rkeys unpacked on it, and (a source of
this host) the pidfd that watches it. ``UcxBackend`` keeps a bounded table of them (``_peer_for``)."""

from __future__ import annotations

import time
from typing import Any, Optional

from kvxfer.backends.same_host import SourceWatch, shared_memory_permitted
from kvxfer.backends.ucx import binding as _ucp
from kvxfer.backends.ucx import served as _served


class Peer:
    """One endpoint to a source worker and the rkeys unpacked on it."""

    # ``backend`` is the UcxBackend whose table holds this peer (typed Any: backend.py imports this module).
    def __init__(self, backend: Any, address: bytes, watch: Optional[SourceWatch] = None) -> None:
        self.address = address
        # A source on this host, watched by pidfd. It skips UCX's peer failure mode only where UCX may
        # use shared memory or CMA at all: that mode is what makes a force-close complete pending gets,
        # and without shared memory the same-host path would buy nothing for giving it up.
        self.watch = watch
        self._exit_seen = False
        error_handling = (backend.peer_error_handling if backend.peer_error_handling is not None
                          else watch is None or not shared_memory_permitted())
        self.path = "peer-error-mode" if error_handling else "same-host"
        self.endpoint = _ucp.Endpoint(backend._worker, address, backend._on_endpoint_error,
                                      peer_error_handling=error_handling)
        # No hardware GET on this endpoint (tcp): UCX would emulate gets with a handler in the
        # source that aborts it when we are gone by the time it answers; so reads are asked of
        # the source instead (served.py). Host memory only: a CUDA pool keeps ucp_get.
        self.served = error_handling and not backend._region.cuda and \
            _served.needs_serving(self.endpoint.transports())
        self.rkeys: dict[bytes, _ucp.RemoteKey] = {}
        self.batches: set[_ucp.GetBatch] = set()  # posted, not yet released
        self.abandoned = False  # closed with gets that can never complete (kept until close())
        self.last_used = time.monotonic()

    def rkey(self, packed: bytes) -> _ucp.RemoteKey:
        key = self.rkeys.get(packed)
        if key is None:
            key = self.rkeys[packed] = _ucp.RemoteKey(self.endpoint, packed)
        return key

    @property
    def failed(self) -> bool:
        return self.endpoint.error is not None or self.endpoint.handle is None or self.source_exited

    @property
    def source_exited(self) -> bool:
        """The pidfd saw the source exit (sticky: once seen, always True)."""
        if not self._exit_seen and self.watch is not None and self.watch.exited():
            self._exit_seen = True
        return self._exit_seen

    @property
    def gets_cannot_land(self) -> bool:
        """No get on this endpoint can write any more: it is closed and its source process is gone.

        Without UCX's peer failure mode a force-close does not complete pending gets (measured over
        tcp: they stay pending for good), so their completion cannot be what proves it.
        """
        return self.endpoint.handle is None and self.source_exited

    def close(self) -> bool:
        """Force-close the endpoint (completing its gets), then destroy the rkeys. True when fully closed.

        The pidfd stays open while a get is pending: it is what can still prove the source gone.
        """
        self.endpoint.close()
        if any(not batch.done for batch in self.batches):
            if not self.gets_cannot_land:
                return False
            # Gets that will never complete (see gets_cannot_land): their requests, rkeys and
            # counters stay allocated until the worker goes (``abandon``, at close()).
            self.abandoned = True
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if not self.abandoned:
            for key in self.rkeys.values():
                key.close()
            self.rkeys.clear()
        return True

    def abandon(self) -> list[_ucp.GetBatch]:
        """Worker closing: free what pending gets still hold (UCX releases a request freed before it
        completed when it does) and the rkeys, before the worker is destroyed. Returns the batches:
        the caller keeps them until the worker is gone (its teardown may still run their callbacks,
        which write their counters)."""
        batches = list(self.batches)
        for batch in batches:
            batch.abandon()
        self.batches.clear()
        for key in self.rkeys.values():
            key.close()
        self.rkeys.clear()
        return batches
