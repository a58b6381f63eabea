"""What the scheduler asks of its workers per request: pure dataclasses, no vLLM import, so the
worker's load and pin machinery (``receiver``, ``sender``) can be driven and tested without vLLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

ATTENTION, MAMBA = "attention", "mamba"


@dataclass(frozen=True)
class TransferGroup:
    """One of vLLM's KV cache groups that a handoff moves (``kv_cache_config.transfer_group_ids``).

    ``attention`` groups hold one block per ``block_size`` tokens, read from the first block past a
    local hit; a ``mamba`` group holds the state after all computed tokens in one running slot
    (``spec_blocks`` speculative scratch slots after it in vLLM's list, never read)."""

    kind: str
    block_size: int
    spec_blocks: int = 0


@dataclass(frozen=True)
class GroupLoad:
    """One transfer group's part of a hybrid load: the decode's blocks to fill, and (attention) the
    block position they start at (a Mamba group has one slot and starts at 0)."""

    group: TransferGroup
    local_block_ids: tuple[int, ...]
    first_block: int = 0


@dataclass(frozen=True)
class LoadSpec:
    """Decode side: pull one request's prompt KV (or, with no blocks, just release the producer's pin).

    ``first_block`` is the block position the pull starts at (the blocks before it are a local
    prefix-cache hit); the worker takes the remote ids from the *verified* ticket from there.
    ``awaiting``: the scheduler parked the request in WAITING_FOR_REMOTE_KVS and expects it in
    ``finished_recving``. ``refusal``: the scheduler already found the ticket unusable.
    ``groups``: a hybrid model's loads per transfer group (then ``local_block_ids`` is their union,
    for counts only); empty for one attention/MLA group, which ``local_block_ids``/``first_block`` say.
    """

    request_id: str
    params: dict[str, Any]
    local_block_ids: tuple[int, ...]
    first_block: int
    awaiting: bool
    refusal: Optional[str] = None
    groups: tuple[GroupLoad, ...] = ()


@dataclass(frozen=True)
class SendSpec:
    """Producer side: a finished request whose blocks vLLM keeps until we report it sent."""

    request_id: str
    block_ids: tuple[int, ...]
    slot: int
    lease: int
