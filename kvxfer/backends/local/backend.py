"""``local``: pulls between two registrations in the same process.

It is the reference semantics and the test oracle for the real transports, so it
copies by block index with plain torch indexing (device to device on GPU, no host
staging) rather than through the byte-range planner the other backends use: a bug
in the planner cannot hide in the oracle too. Whole slices move as 8-byte words
(``copy_slices``), which is what keeps the oracle fast.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any, Optional

import torch

from kvxfer.backends.base import KVTransportBackend, PullRequest, RequestId, TransferHandle
from kvxfer.backends.local.reshard import copy_resharded
from kvxfer.errors import PeerMetadataError
from kvxfer.plan.reshard_descriptors import reshard_transfers_for_pull

_LIVE: dict[int, "LocalBackend"] = {}  # buffer id -> live registration in this process
_LIVE_LOCK = threading.Lock()
_NEXT_ID = itertools.count(1)


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _word_dtype(*backends: KVTransportBackend) -> torch.dtype:
    """The widest integer word that divides every slice and aligns every pool: copying 8-byte
    words instead of bytes is what makes the oracle fast (``docs/benchmarks.md``)."""
    for word in _WORDS:
        size = torch.empty((), dtype=word).element_size()
        if all(b.geometry.bytes_per_slice % size == 0 and b.memory_buffer.data_ptr() % size == 0 for b in backends):
            return word
    return torch.uint8


def _slices_view(backend: KVTransportBackend, word: torch.dtype = torch.uint8) -> torch.Tensor:
    """The pool as ``[num_outer, num_blocks, words_per_slice]`` of ``word``."""
    g = backend.geometry
    return backend.memory_buffer.view(torch.uint8).view(g.num_outer, g.num_blocks, g.bytes_per_slice).view(word)


def copy_slices(source: KVTransportBackend, dest: KVTransportBackend, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Whole slices ``src_ids`` of ``source`` into ``dst_ids`` of ``dest``, every outer index.

    One ``index_select`` + ``index_copy_`` per outer index on a wide-word view: a 2-D
    gather per outer is several times faster than one 3-D advanced-index assignment.
    """
    word = _word_dtype(source, dest)
    src, dst = _slices_view(source, word), _slices_view(dest, word)
    for outer in range(src.shape[0]):
        dst[outer].index_copy_(0, dst_ids, src[outer].index_select(0, src_ids).to(dst.device))


class LocalHandle(TransferHandle):
    """Complete when the copy's CUDA event has fired (immediately on CPU).

    The source learns of completion on its own (``_collect_notifications`` checks the
    same event), as it would from a real transport, not from the reader polling.
    """

    def __init__(self, request_id: RequestId, timeout_s: float, source: "LocalBackend",
                 event: Optional["torch.cuda.Event"]) -> None:
        super().__init__(request_id, timeout_s)
        self._source = source
        self._event = event

    def _progress(self) -> bool:
        return self._event is None or self._event.query()

    def _abort(self) -> bool:
        if self._event is not None:
            self._event.synchronize()  # a queued device copy cannot be cancelled: let it land
        return True

    def _on_failed(self, error: Exception) -> None:
        self._source._report_failed(self.request_id, str(error))


class LocalBackend(KVTransportBackend):
    """In-process transport: a registry of live registrations, copies with torch."""

    name = "local"
    is_push = False
    reads_other_processes = False  # only registrations of this process, found by id

    def _register(self) -> None:
        self._reads_in_flight: list[tuple[Optional[torch.cuda.Event], RequestId]] = []
        self._reads_lock = threading.Lock()
        self.buffer_id = next(_NEXT_ID)
        with _LIVE_LOCK:
            _LIVE[self.buffer_id] = self

    def _deregister(self) -> None:
        with _LIVE_LOCK:
            _LIVE.pop(self.buffer_id, None)

    def _transport_meta(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "local_buffer_id": self.buffer_id}

    def _find_source(self, pull: PullRequest) -> "LocalBackend":
        """The live registration the meta names, and only if the meta describes it truly."""
        meta = pull.peer_meta
        if meta.get("pid") != os.getpid():
            raise PeerMetadataError(
                "the local backend only reaches registrations in this process; the peer meta comes from "
                f"pid {meta.get('pid')!r}. Use a network backend (nixl, ucx) across processes"
            )
        buffer_id = meta.get("local_buffer_id")
        if not isinstance(buffer_id, int):
            raise PeerMetadataError(f"peer meta field 'local_buffer_id' must be an int, got {buffer_id!r}")
        with _LIVE_LOCK:
            source = _LIVE.get(buffer_id)
        if source is None:
            raise PeerMetadataError(f"no live local registration {buffer_id!r}; was the source closed?")
        if pull.peer.geometry != source.geometry or pull.peer.dtype != source.dtype_name:
            raise PeerMetadataError(
                f"peer meta does not describe local registration {buffer_id} (its geometry or dtype differs)"
            )
        return source

    def _post_read(self, pull: PullRequest) -> TransferHandle:
        source = self._find_source(pull)
        transfers = reshard_transfers_for_pull(self.local_pool, pull.peer)
        if transfers is None:
            dst = self.memory_buffer
            copy_slices(source, self, torch.from_numpy(pull.src_ids).to(source.memory_buffer.device),
                        torch.from_numpy(pull.dst_ids).to(dst.device))
        else:
            dst = self.memory_buffer
            copy_resharded(source, self, transfers, pull.src_ids, pull.dst_ids)
        event = None
        if dst.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dst.device))
        if pull.notify:
            with source._reads_lock:
                source._reads_in_flight.append((event, pull.request_id))
        return LocalHandle(pull.request_id, self.timeout_s, source, event)

    def _notify_source(self, peer_meta: Any, request_id: RequestId, failure: Optional[str] = None) -> None:
        with _LIVE_LOCK:
            source = _LIVE.get(peer_meta.get("local_buffer_id")) if peer_meta.get("pid") == os.getpid() else None
        if source is None:
            return
        if failure is None:
            source._deliver_read_done(request_id)
        else:
            source._report_failed(request_id, failure)

    def _collect_notifications(self) -> None:
        """Source side: reads of our blocks whose copies have landed are done."""
        with self._reads_lock:
            pending = []
            for event, request_id in self._reads_in_flight:
                if event is None or event.query():
                    self._deliver_read_done(request_id)
                else:
                    pending.append((event, request_id))
            self._reads_in_flight = pending

    def _report_failed(self, request_id: RequestId, reason: str) -> None:
        with self._reads_lock:
            self._reads_in_flight = [(e, r) for e, r in self._reads_in_flight if r != request_id]
        self._deliver_read_failed(request_id, reason)
