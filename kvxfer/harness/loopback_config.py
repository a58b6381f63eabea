"""What a loopback run moves: the pools' shape and the request's blocks (no torch here, so the command
line can build its parser, and refuse a mistake, without importing it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxfer.defaults import MAX_TIMEOUT_S, MIN_TIMEOUT_S, TRANSFER_TIMEOUT_S, bounded_float


@dataclass(frozen=True)
class LoopbackConfig:
    backend: str = "local"
    num_layers: int = 32
    tokens_per_block: int = 16
    num_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    pool_blocks: int = 256
    request_blocks: int = 128
    pattern: str = "scattered"  # or "contiguous"
    seed: int = 0
    timeout_s: float = TRANSFER_TIMEOUT_S
    device: str = "cpu"  # where both pools live: "cuda" (or "cuda:N") for VRAM pools

    def __post_init__(self) -> None:
        if self.pattern not in ("scattered", "contiguous"):
            raise ValueError(f"pattern must be 'scattered' or 'contiguous', got {self.pattern!r}")
        if not 0 < self.request_blocks <= self.pool_blocks:
            raise ValueError(f"request_blocks must be in [1, pool_blocks={self.pool_blocks}], got {self.request_blocks}")
        bounded_float("timeout_s", self.timeout_s, MIN_TIMEOUT_S, MAX_TIMEOUT_S, unit="seconds")
        from kvxfer.plan.geometry import dtype_from_name  # torch: only once a run is configured

        dtype_from_name(self.dtype)

    @property
    def pool_shape(self) -> tuple[int, ...]:
        return (2, self.num_layers, self.pool_blocks, self.tokens_per_block, self.num_heads, self.head_dim)

    def block_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """Source and destination ids: random permutations, or the same run on both sides."""
        if self.pattern == "contiguous":
            ids = np.arange(self.request_blocks, dtype=np.int64)
            return ids, ids.copy()
        rng = np.random.default_rng(self.seed)
        src = rng.choice(self.pool_blocks, self.request_blocks, replace=False)
        dst = rng.choice(self.pool_blocks, self.request_blocks, replace=False)
        return src.astype(np.int64), dst.astype(np.int64)
