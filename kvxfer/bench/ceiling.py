"""The gather ceiling of one point: a same-process copy of exactly the slices the point moves.

Measured in the sweep worker right after the point itself (same run, same moment of a
noisy machine), with the point's own ids (the same draw per repeat), pattern and pool
shapes, into the decode's own pool. It is the memory-bandwidth limit of the *pattern*
(scattered slices, head-interleaved reshard rows), where the memcpy baseline is the
limit of one flat run of the same byte count.

The copy is the fast one (as the ``local`` oracle's ``copy_slices``): pools viewed as
8-byte words, one ``index_select`` + ``index_copy_`` per K/V layer plane. For a TP
reshard point each prefill rank's half of the heads is gathered into its head range of
the decode pool's token rows (``narrow`` on the word axis), i.e. the same bytes a
reshard pull must place. The first measured copy is checked against the source.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from kvxfer.bench.config import RESHARD_SRC_TP, BenchConfig, Point
from kvxfer.harness.loopback import LoopbackConfig, make_pool

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _word(nbytes: int, *pools: torch.Tensor) -> torch.dtype:
    for word in _WORDS:
        size = torch.empty((), dtype=word).element_size()
        if nbytes % size == 0 and all(p.data_ptr() % size == 0 for p in pools):
            return word
    return torch.uint8


class GatherCeiling:
    """Source pool(s) shaped like the point's sources (allocated once per slice size), and the copy."""

    def __init__(self, pool_cfg: LoopbackConfig, reshard: bool) -> None:
        self.cfg = pool_cfg
        self.src_tp = RESHARD_SRC_TP if reshard else 1
        rank_cfg = replace(pool_cfg, num_heads=pool_cfg.num_heads // self.src_tp)
        # random bytes (not a constant) so the check below means something; seeded like the sources
        self.sources = [make_pool(rank_cfg, random_seed=pool_cfg.seed + 1 + r) for r in range(self.src_tp)]

    def _views(self, dst_pool: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per rank: (source words ``[planes, B, row]``, destination words ``[planes, B, row]`` narrowed to its heads)."""
        c = self.cfg
        planes = 2 * c.num_layers
        esize = dst_pool.element_size()
        if self.src_tp == 1:
            nbytes = c.tokens_per_block * c.num_heads * c.head_dim * esize
            word = _word(nbytes, self.sources[0], dst_pool)
            src = self.sources[0].view(torch.uint8).view(planes, c.pool_blocks, nbytes).view(word)
            dst = dst_pool.view(torch.uint8).view(planes, c.pool_blocks, nbytes).view(word)
            return [src], [dst]
        part = (c.num_heads // self.src_tp) * c.head_dim * esize  # one rank's heads of one token row
        word = _word(part, dst_pool, *self.sources)
        dst = dst_pool.view(torch.uint8).view(planes, c.pool_blocks, c.tokens_per_block, c.num_heads * c.head_dim * esize)
        dst = dst.view(word)
        w = part // torch.empty((), dtype=word).element_size()
        srcs = [s.view(torch.uint8).view(planes, c.pool_blocks, c.tokens_per_block, part).view(word) for s in self.sources]
        return srcs, [dst.narrow(3, r * w, w) for r in range(self.src_tp)]

    def copy(self, srcs: list[torch.Tensor], dsts: list[torch.Tensor], src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        for src, dst in zip(srcs, dsts):
            for plane in range(src.shape[0]):
                dst[plane].index_copy_(0, dst_ids, src[plane].index_select(0, src_ids))

    def measure(self, cfg: BenchConfig, point: Point, dst_pool: torch.Tensor) -> tuple[list[float], Optional[str]]:
        """Warm-up copies, then ``cfg.repeats`` timed copies with the point's ids; (times in ms, error)."""
        srcs, dsts = self._views(dst_pool)
        times: list[float] = []
        try:
            for repeat in range(cfg.warmup + cfg.repeats):
                src_np, dst_np = cfg.request_config(self.cfg, point, repeat).block_ids()
                src_ids = torch.from_numpy(np.asarray(src_np)).to(dst_pool.device)
                dst_ids = torch.from_numpy(np.asarray(dst_np)).to(dst_pool.device)
                t0 = time.perf_counter()
                self.copy(srcs, dsts, src_ids, dst_ids)
                if dst_pool.is_cuda:  # a device copy is over when its stream is
                    torch.cuda.synchronize(dst_pool.device)
                t1 = time.perf_counter()
                if repeat == cfg.warmup:
                    for src, dst in zip(srcs, dsts):
                        if not torch.equal(dst[:, dst_ids], src[:, src_ids]):
                            return times, "gather ceiling: the copy did not land the source's bytes"
                if repeat >= cfg.warmup:
                    times.append((t1 - t0) * 1e3)
        except Exception as exc:  # a ceiling that cannot run is stated, not fatal to the point
            return times, f"gather ceiling: {type(exc).__name__}: {exc}"
        return times, None


__all__ = ["GatherCeiling"]
