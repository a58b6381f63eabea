"""The reference engine's memory: one paged KV pool and its allocator.

It plays the part of an engine's ``DynamicInferenceContext``: the engine and the
transport both see the same ``kv_pool`` tensor (the transport registers it once).
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine_integration.reference.config import ModelConfig
from engine_integration.reference.kv_cache import BlockAllocator, block_hashes


class ReferenceContext:
    """A ``[2, L, B, T, H, d]`` pool of ``num_blocks`` blocks plus its bookkeeping."""

    def __init__(self, config: ModelConfig, num_blocks: int, device: torch.device | str = "cpu") -> None:
        shape = config.kv_pool_shape(num_blocks)
        if shape.count(num_blocks) != 1:
            raise ValueError(f"num_blocks={num_blocks} equals another dimension of the pool {shape}; transports find "
                             "the blocks axis by its size, so pick a block count that differs from the other dims")
        self.config = config
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.kv_pool = torch.zeros(config.kv_pool_shape(num_blocks), dtype=getattr(torch, config.dtype),
                                   device=self.device)
        self.allocator = BlockAllocator(num_blocks)

    @property
    def tokens_per_block(self) -> int:
        return self.config.tokens_per_block

    def block_hashes(self, tokens: Sequence[int]) -> list[int]:
        return block_hashes(tokens, self.config.tokens_per_block)

    def backend_kwargs(self) -> dict:
        """The topology arguments a transport backend needs to register ``kv_pool``."""
        c = self.config
        return dict(memory_buffer=self.kv_pool, expected_num_blocks=self.num_blocks,
                    heads_per_partition=c.num_kv_heads,
                    head_dim=c.head_dim, tokens_per_block=c.tokens_per_block)
