"""One lifecycle enum for every handoff, on both sides (after SGLang's ``KVPoll``, same names and values).

The library owns it, below every engine adapter: the reference engine's source and sink report
it, and SGLang's own enum has the same names and values, so its adapter maps one to one.

Prefill (source) side:
  ``WaitingForInput`` -- blocks pinned, descriptor published, waiting for the reader;
  ``Success`` -- read-done received, pins released;
  ``Failed``  -- a failure report said no read is in flight, pins released.
Decode (sink) side:
  ``Bootstrapping``   -- descriptor received, queued for blocks (FIFO) or the peer's meta;
  ``Transferring``    -- blocks reserved, one-sided read posted, polled by the engine loop;
  ``Success``         -- every byte landed, request admitted to the decode batch;
  ``Failed``          -- the pull failed; its blocks stay quarantined until ``storage_safe``.
"""

from __future__ import annotations

import enum


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def final(self) -> bool:
        return self in (KVPoll.Success, KVPoll.Failed)
