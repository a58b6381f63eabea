"""A small Llama-style decoder that reads and writes a paged KV cache.

Weights come from a seeded generator, so every process builds the same model without
a checkpoint. The forward pass handles one request at a time: it writes the K/V of the
new tokens into their pool slots, then attends over the request's whole history read
back from the pool. Prefill, decode and a prefix-cache hit therefore run the same
code, which is what makes disaggregated output equal co-located output bit for bit.
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine_integration.reference.config import ModelConfig


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class TinyLlama:
    """Parameters and the paged forward pass (no autograd, no nn.Module: inference only)."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        c = config
        gen = torch.Generator().manual_seed(c.seed)

        def param(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(self.device)

        s = c.hidden ** -0.5
        self.embed = param(c.vocab_size, c.hidden, scale=1.0)
        self.layers = []
        for _ in range(c.num_layers):
            self.layers.append({
                "attn_norm": torch.ones(c.hidden, device=self.device),
                "wq": param(c.hidden, c.num_q_heads * c.head_dim, scale=s),
                "wk": param(c.hidden, c.num_kv_heads * c.head_dim, scale=s),
                "wv": param(c.hidden, c.num_kv_heads * c.head_dim, scale=s),
                "wo": param(c.num_q_heads * c.head_dim, c.hidden, scale=s),
                "mlp_norm": torch.ones(c.hidden, device=self.device),
                "w_gate": param(c.hidden, c.ffn_hidden, scale=s),
                "w_up": param(c.hidden, c.ffn_hidden, scale=s),
                "w_down": param(c.ffn_hidden, c.hidden, scale=c.ffn_hidden ** -0.5),
            })
        self.final_norm = torch.ones(c.hidden, device=self.device)
        self.lm_head = param(c.hidden, c.vocab_size, scale=s)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        self._inv_freq = inv_freq

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [n, H, d] by its absolute positions (half-split convention)."""
        angles = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        cos = angles.cos().to(x.dtype).to(x.device)[:, None, :]
        sin = angles.sin().to(x.dtype).to(x.device)[:, None, :]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    @torch.no_grad()
    def forward(self, token_ids: Sequence[int], start_pos: int, block_table: Sequence[int],
                kv_pool: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] for ``token_ids`` at positions ``start_pos..``; K/V land in ``kv_pool``.

        ``block_table`` lists the request's blocks in order; positions ``< start_pos``
        must already be in the pool (computed here earlier, or pulled from a peer).
        """
        c = self.config
        T = c.tokens_per_block
        n = len(token_ids)
        total = start_pos + n
        if c.blocks_for(total) > len(block_table):
            raise ValueError(f"{total} tokens need {c.blocks_for(total)} blocks, the table has {len(block_table)}")
        positions = torch.arange(start_pos, total, device=self.device)
        slot_blocks = torch.tensor([block_table[p // T] for p in range(start_pos, total)], device=self.device)
        slot_offsets = positions % T
        ctx_blocks = torch.tensor(list(block_table[: c.blocks_for(total)]), device=self.device)
        q_pos = positions[:, None]
        k_pos = torch.arange(total, device=self.device)[None, :]
        mask = k_pos <= q_pos  # [n, total]
        group = c.num_q_heads // c.num_kv_heads

        x = self.embed[torch.tensor(list(token_ids), device=self.device)]
        for li, w in enumerate(self.layers):
            h = _rms_norm(x, w["attn_norm"], c.norm_eps)
            q = self._rope((h @ w["wq"]).view(n, c.num_q_heads, c.head_dim), positions)
            k = self._rope((h @ w["wk"]).view(n, c.num_kv_heads, c.head_dim), positions)
            v = (h @ w["wv"]).view(n, c.num_kv_heads, c.head_dim)
            kv_pool[0, li, slot_blocks, slot_offsets] = k
            kv_pool[1, li, slot_blocks, slot_offsets] = v
            keys = kv_pool[0, li, ctx_blocks].reshape(-1, c.num_kv_heads, c.head_dim)[:total]
            vals = kv_pool[1, li, ctx_blocks].reshape(-1, c.num_kv_heads, c.head_dim)[:total]
            keys = keys.repeat_interleave(group, dim=1)  # [total, Hq, d]
            vals = vals.repeat_interleave(group, dim=1)
            scores = torch.einsum("nhd,thd->hnt", q, keys) * (c.head_dim ** -0.5)
            scores = scores.masked_fill(~mask[None], float("-inf"))
            attn = torch.einsum("hnt,thd->nhd", scores.softmax(-1), vals).reshape(n, -1)
            x = x + attn @ w["wo"]
            h = _rms_norm(x, w["mlp_norm"], c.norm_eps)
            x = x + (torch.nn.functional.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
        return _rms_norm(x, self.final_norm, c.norm_eps) @ self.lm_head


def default_device() -> str:
    """The first GPU where there is one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def greedy(logits: torch.Tensor) -> int:
    """The next token of the last position (ties go to the lowest id, as argmax does)."""
    return int(torch.argmax(logits[-1]).item())
