"""The reference model's shape, in one frozen record shared by every process.

Prefill and decode instances must agree on it byte for byte (the coordinator refuses
an engine whose ``fingerprint`` differs), so it is plain data with a stable digest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelConfig:
    """A tiny Llama-style decoder: GQA, RoPE, RMSNorm, SwiGLU; paged KV with small blocks.

    ``tokens_per_block`` is 4 so that most prompts end in a partial block.
    """

    vocab_size: int = 256
    hidden: int = 64
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    ffn_hidden: int = 128
    tokens_per_block: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.vocab_size < 256:
            raise ValueError(f"vocab_size must be >= 256, got {self.vocab_size}")
        if self.hidden % self.num_q_heads:
            raise ValueError(f"hidden ({self.hidden}) must divide by num_q_heads ({self.num_q_heads})")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads ({self.num_q_heads}) must divide by num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {self.tokens_per_block}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_q_heads

    def kv_pool_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        """The canonical ``[2, L, B, T, H, d]`` layout."""
        return (2, self.num_layers, num_blocks, self.tokens_per_block, self.num_kv_heads, self.head_dim)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    @property
    def fingerprint(self) -> str:
        """Stable digest of every field: equal fingerprints mean interchangeable KV caches."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]
