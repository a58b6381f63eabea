"""A tiny hybrid attention+Mamba model's KV cache on any TP rank, laid out as vLLM 0.32 lays it out.

The reference a hybrid read across TP sizes is checked against (``tests/integrations/vllm/test_vllm_hybrid_tp.py``).
Every element's value is a function of where it belongs in the *whole* model's state, so the pages
of rank ``r`` of TP ``T`` are built by cutting that state the way vLLM shards it (facts from vLLM
0.32's source, docs/vllm.md "Hybrid and MLA models"):

* KV heads: rank ``r`` holds ``[r*K/T, (r+1)*K/T)``, or the one head ``r*K//T`` when ``T > K``;
* the Mamba state (``MambaStateShapeCalculator``): conv channels in bands, each band the rank's
  share of its units, stored ``(channels, rows)`` with the ``DS`` conv layout and ``(rows,
  channels)`` with ``SD``; then the SSM state, split along its first dimension:

  - Mamba2 (``MambaMixer2``'s sharded loaders): ``[x | B | C]``, ``x`` = the rank's SSM heads x
    ``head_dim``, ``B``, ``C`` = its groups x ``d_state`` (groups replicated on ``T / G`` ranks when
    ``T > G``: ``extra_groups_for_head_shards``); SSM ``(heads, head_dim, d_state)``;
  - Mamba1: ``[x]``, the rank's ``intermediate / T`` channels; SSM ``(intermediate / T, d_state)``;
  - GDN: ``[Q | K | V]``, the rank's key heads x ``head_k_dim`` twice, then its value heads x
    ``head_v_dim``; SSM ``(value heads, head_v_dim, head_k_dim)``;
* one int8 allocation, layer slot ``l`` at ``l * blocks * page`` (``allocate_kv_cache``), every
  group's layer ``l`` viewing the same bytes, attention ``[blocks, heads, tokens, 2*head]`` bf16
  (``LBHNC``) and Mamba the raw ``[blocks, 1, 1, state bytes]``, the page the larger of the two.

In a pool, odd blocks hold attention KV and even blocks Mamba state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

KV_HEADS, HEAD, BLOCK = 4, 8, 16  # attention: 4 KV heads of 8, 16 tokens a block
NHEADS, HEAD_DIM, D_STATE, ROWS = 4, 4, 8, 3  # Mamba2: 4 SSM heads of 4, d_state 8, conv kernel 4
INTERMEDIATE, D_STATE1 = 8, 4  # Mamba1: 8 channels, d_state 4
K_HEADS, HEAD_K, V_HEADS, HEAD_V = 4, 2, 4, 3  # GDN: Q and K 4 heads of 2, V 4 heads of 3
KINDS = ("MAMBA2", "MAMBA1", "GDN_ATTN")  # vLLM's MambaAttentionBackendEnum names
SLOTS = 2  # two attention and two Mamba layers: two layer slots
MAMBA_BLOCK = 2048


def _owned(units: int, tp: int, rank: int) -> range:
    """The units (KV heads, SSM heads, groups) rank ``rank`` of ``tp`` holds, vLLM's way."""
    if tp <= units:
        per = units // tp
        return range(rank * per, (rank + 1) * per)
    first = rank * units // tp
    return range(first, first + 1)


@dataclass(frozen=True)
class HybridRank:
    """Rank ``rank`` of an instance with TP ``tp``: its page size and its pages' bytes."""

    tp: int
    rank: int
    ngroups: int  # Mamba2's B/C groups (unused by the other kinds)
    conv_layout: str  # "DS" or "SD"
    kind: str = "MAMBA2"

    def _owned(self, units: int) -> range:
        return _owned(units, self.tp, self.rank)

    @property
    def kv_heads(self) -> range:
        return self._owned(KV_HEADS)

    @property
    def bands(self) -> list[tuple[range, int]]:
        """The conv state's bands: the units this rank holds and the channels of one unit."""
        if self.kind == "MAMBA1":
            return [(self._owned(INTERMEDIATE), 1)]
        if self.kind == "GDN_ATTN":
            keys = self._owned(K_HEADS)
            return [(keys, HEAD_K), (keys, HEAD_K), (self._owned(V_HEADS), HEAD_V)]
        groups = self._owned(self.ngroups)
        return [(self._owned(NHEADS), HEAD_DIM), (groups, D_STATE), (groups, D_STATE)]

    @property
    def ssm(self) -> tuple[range, tuple[int, ...]]:
        """The SSM state: the units this rank holds (its first dimension) and the shape of one unit."""
        if self.kind == "MAMBA1":
            return self._owned(INTERMEDIATE), (D_STATE1,)
        if self.kind == "GDN_ATTN":
            return self._owned(V_HEADS), (HEAD_V, HEAD_K)
        return self._owned(NHEADS), (HEAD_DIM, D_STATE)

    @property
    def channels(self) -> int:
        return sum(len(units) * width for units, width in self.bands)

    @property
    def conv_shape(self) -> list[int]:
        return [self.channels, ROWS] if self.conv_layout == "DS" else [ROWS, self.channels]

    @property
    def state_bytes(self) -> int:
        units, inner = self.ssm
        return self.channels * ROWS * 2 + len(units) * math.prod(inner) * 4

    @property
    def page(self) -> int:
        return max(len(self.kv_heads) * BLOCK * 2 * HEAD * 2, self.state_bytes)

    # --- the bytes --------------------------------------------------------------------------
    def attention_page(self, slot: int, block: int) -> torch.Tensor:
        heads = torch.tensor(list(self.kv_heads)).view(-1, 1, 1)
        token = torch.arange(BLOCK).view(1, -1, 1)
        ch = torch.arange(2 * HEAD).view(1, 1, -1)
        kv = ((slot * 61 + block * 29 + heads * 53 + token * 7 + ch * 3) % 251).to(torch.bfloat16)
        return kv.contiguous().view(torch.uint8).flatten()

    def mamba_page(self, slot: int, block: int) -> torch.Tensor:
        base = slot * 41 + block * 17
        channels = torch.tensor([base + 300 * band + 7 * (u * width + i)
                                 for band, (units, width) in enumerate(self.bands) for u in units
                                 for i in range(width)]).view(-1, 1)
        conv = ((channels + 11 * torch.arange(ROWS).view(1, -1)) % 247).to(torch.bfloat16)  # (channels, rows)
        if self.conv_layout == "SD":
            conv = conv.t().contiguous()
        units, inner = self.ssm
        unit = torch.tensor(list(units)).view(-1, *([1] * len(inner)))
        ssm = (base * 1000 + unit * 100 + torch.arange(math.prod(inner)).view(1, *inner)).to(torch.float32) + 0.5
        return torch.cat((conv.contiguous().view(torch.uint8).flatten(), ssm.contiguous().view(torch.uint8).flatten()))

    def pool(self, blocks: int, filled: bool = True) -> torch.Tensor:
        """``uint8 [SLOTS, blocks, page]``: odd blocks attention pages, even blocks Mamba state (zero padded)."""
        out = torch.zeros(SLOTS, blocks, self.page, dtype=torch.uint8)
        for slot in range(SLOTS if filled else 0):
            for block in range(blocks):
                data = self.attention_page(slot, block) if block % 2 else self.mamba_page(slot, block)
                out[slot, block, :data.numel()] = data
        return out

    # --- what vLLM hands the connector ------------------------------------------------------
    def kv_caches(self, raw: torch.Tensor, blocks: int) -> tuple[dict[str, torch.Tensor], list[Any]]:
        """vLLM's layer views of the allocation ``raw`` and its ``KVCacheTensor`` placements."""
        from kvxfer.integrations.vllm.kv_buffers import TensorPlacement

        flat = raw.view(torch.int8).flatten()
        slot_bytes = blocks * self.page
        heads = len(self.kv_heads)
        caches = {}
        for layer in range(SLOTS):
            attn = torch.as_strided(flat, (blocks, heads, BLOCK, 2 * HEAD * 2),
                                    (self.page, BLOCK * 2 * HEAD * 2, 2 * HEAD * 2, 1), layer * slot_bytes)
            caches[f"model.layers.{2 * layer + 1}.attn"] = attn.view(torch.bfloat16)
            caches[f"model.layers.{2 * layer}.mixer"] = torch.as_strided(
                flat, (blocks, 1, 1, self.state_bytes), (self.page, self.state_bytes, self.state_bytes, 1),
                layer * slot_bytes)
        placements = [TensorPlacement(tuple(n for n in caches if n.endswith(kind)), flat.numel(), 0, slot_bytes,
                                      self.page) for kind in (".attn", ".mixer")]
        return caches, placements

    def layout(self, regions: Any, blocks: int) -> Any:
        """The ``EngineLayout`` its worker would serve (``worker.engine_model``'s facts)."""
        from kvxfer.integrations.vllm.handshake import EngineLayout
        from kvxfer.integrations.vllm.kv_buffers import layout_signature

        groups = [{"spec": "FullAttentionSpec", "layers": SLOTS, "block_size": BLOCK, "page_bytes": self.page,
                   "dtype": "bfloat16", "kv_layout": "LBHNC", "kv_page": [len(self.kv_heads), BLOCK, 2 * HEAD * 2],
                   "kv_split": 1},
                  {"spec": "MambaSpec", "layers": SLOTS, "block_size": MAMBA_BLOCK, "page_bytes": self.page,
                   "shapes": [self.conv_shape, [len(self.ssm[0]), *self.ssm[1]]],
                   "dtypes": ["bfloat16", "float32"], "mamba_cache_mode": "none", "spec_blocks": 0,
                   "conv_layout": self.conv_layout, "mamba_type": self.kind}]
        model = {"num_layers": 2 * SLOTS, "num_kv_heads": KV_HEADS, "head_size": HEAD, "dtype": "bfloat16",
                 "kv_dtype": "auto", "kv_groups": groups, "use_mla": False}
        if self.kind == "MAMBA2":  # the worker reports the groups only where the model has them
            model["mamba_ngroups"] = self.ngroups
        return EngineLayout(model=model, tp_size=self.tp, pp_size=1, block_size=BLOCK,
                            regions=tuple(layout_signature(regions, BLOCK)["regions"]), num_blocks=blocks)

    def expected(self, blocks: int, pairs: list[tuple[int, int]], source_blocks: int) -> torch.Tensor:
        """A decode pool of ``blocks`` after reading ``(src, dst)`` pairs: the decode's share of each
        source block, the rest of the pool (Mamba pages' padding included) untouched (zero)."""
        out = torch.zeros(SLOTS, blocks, self.page, dtype=torch.uint8)
        for slot in range(SLOTS):
            for src, dst in pairs:
                data = self.attention_page(slot, src) if src % 2 else self.mamba_page(slot, src)
                out[slot, dst, :data.numel()] = data
        return out
