"""What the scheduler asks of its workers per request: pure dataclasses, no vLLM import, so the
worker's load and pin machinery (``receiver``, ``sender``) can be driven and tested without vLLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class LoadSpec:
    """Decode side: pull one request's prompt KV (or, with no blocks, just release the producer's pin).

    ``first_block`` is the block position the pull starts at (the blocks before it are a local
    prefix-cache hit); the worker takes the remote ids from the *verified* ticket from there.
    ``awaiting``: the scheduler parked the request in WAITING_FOR_REMOTE_KVS and expects it in
    ``finished_recving``. ``refusal``: the scheduler already found the ticket unusable.
    """

    request_id: str
    params: dict[str, Any]
    local_block_ids: tuple[int, ...]
    first_block: int
    awaiting: bool
    refusal: Optional[str] = None


@dataclass(frozen=True)
class SendSpec:
    """Producer side: a finished request whose blocks vLLM keeps until we report it sent."""

    request_id: str
    block_ids: tuple[int, ...]
    slot: int
    lease: int
