"""``HandoffEngineAdapter`` over the reference engine: the one place the handoff state machines meet it.

One job: translate the adapter calls ``source``/``sink`` make (``adapter.HandoffEngineAdapter``)
into the reference engine's allocator and batch. The engine it wraps is the
``handoff_engine.StateHandoffDynamicInferenceEngine`` that constructs it (``setup_kv_transfer``).
It is handed the engine and imports none (its row of ``LAYERS`` in tests/project/test_library_layout.py).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from engine_integration.adapter import ImportedRequest


class ReferenceEngineAdapter:
    """``HandoffEngineAdapter`` over the reference engine's context and batch."""

    def __init__(self, engine: Any) -> None:   # a StateHandoffDynamicInferenceEngine (not imported: no circle)
        self._engine = engine
        self._alloc = engine.context.allocator
        self.tokens_per_block = engine.context.tokens_per_block

    def block_hashes(self, tokens: Sequence[int]) -> list[int]:
        return self._engine.context.block_hashes(tokens)

    def allocate_blocks(self, n: int) -> Optional[list[int]]:
        return self._alloc.allocate(n)

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        self._alloc.release(block_ids)

    def pin_blocks(self, block_ids: Sequence[int]) -> None:
        self._alloc.pin(block_ids)

    def unpin_blocks(self, block_ids: Sequence[int]) -> None:
        self._alloc.unpin(block_ids)

    def acquire_cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        return self._alloc.acquire_prefix(hashes)

    def register_block_hashes(self, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        self._alloc.register(block_ids, hashes)

    def admit_decode_request(self, request: ImportedRequest) -> None:
        self._engine._admit_imported(request)

