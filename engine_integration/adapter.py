"""The few things the handoff state machines need from an engine.

Keeping this a ``Protocol`` keeps ``source``/``sink`` engine-agnostic: the reference
engine implements it in a dozen lines, and so could any engine with a paged pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from engine_integration.descriptor import RequestId


@dataclass(frozen=True)
class ImportedRequest:
    """A request whose KV is now in the decode pool, ready to join the decode batch."""

    request_id: RequestId
    prompt: tuple[int, ...]
    resume_tokens: tuple[int, ...]
    block_ids: tuple[int, ...]   #: the full block table (cached prefix, pulled blocks, room to grow)
    max_new_tokens: int
    cached_prefix_blocks: int
    pulled_blocks: int


class HandoffEngineAdapter(Protocol):
    """Block management and admission, as the handoff layer sees an engine."""

    tokens_per_block: int

    def block_hashes(self, tokens: Sequence[int]) -> list[int]:
        """Chained hashes of the full blocks of ``tokens`` (same function on every instance)."""

    def allocate_blocks(self, n: int) -> Optional[list[int]]:
        """``n`` blocks, or ``None`` (and nothing taken) if they are not free."""

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """Give back blocks from ``allocate_blocks`` or ``acquire_cached_prefix``."""

    def pin_blocks(self, block_ids: Sequence[int]) -> None:
        """Keep blocks out of reuse while a reader may read them."""

    def unpin_blocks(self, block_ids: Sequence[int]) -> None:
        """Undo one ``pin_blocks``."""

    def acquire_cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest cached contiguous prefix of ``hashes``, each held once."""

    def register_block_hashes(self, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        """Make imported full blocks findable by later prefix lookups."""

    def admit_decode_request(self, request: ImportedRequest) -> None:
        """Put a fully imported request straight into the decode batch (no recompute)."""
