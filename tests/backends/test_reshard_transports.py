"""Reshard through the byte-planning transports (NIXL, UCX) where they are present.

They post ``KVTransportBackend.plan_pull``'s ``CopyPlan`` and never see layouts, so
reshard reaches them through the base class alone. One case, TP 2 -> 1 (heads
merge: one fragment per token) with PP 1 -> 2 (layers split), bf16, checked byte
for byte against the decode ranks' own shards; skipped where the backend is
missing or cannot run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvxfer.backends import available_backends, construct_kv_transfer_backend_class
from kvxfer.runtime.multi_pull import begin_pull_from_peers
from reshard_support import POOL_BLOCKS, kv_layouts, kv_shard, random_tensor, same_bytes

_AVAILABLE = {info.name: info for info in available_backends()}


@pytest.mark.parametrize("name", ["nixl", "ucx"])
def test_transport_reshard_tp2_to_1_pp1_to_2(name):
    info = _AVAILABLE.get(name)
    assert info is not None and info.available, f"backend {name!r} cannot run: {info.reason if info else 'not registered'}"
    backend_cls = construct_kv_transfer_backend_class(name)
    num_layers, num_heads = 4, 4
    g = random_tensor((2, num_layers, POOL_BLOCKS, 3, num_heads, 5), torch.bfloat16, 11)
    rng = np.random.default_rng(11)
    src_ids, dst_ids = rng.choice(POOL_BLOCKS, 9, replace=False), rng.choice(POOL_BLOCKS, 9, replace=False)

    def make(layout, pool, agent):
        return backend_cls(agent, pool, POOL_BLOCKS, tp_size=layout.tp_size, tp_rank=layout.tp_rank,
                           num_kv_heads_global=num_heads, global_rank=layout.global_rank, pp_size=layout.pp_size,
                           pp_rank=layout.pp_rank, num_layers_global=num_layers)

    sources = [make(x, kv_shard(g, x), f"reshard-{name}-p{x.global_rank}") for x in kv_layouts(2, 1, num_layers, num_heads)]
    opened = list(sources)
    try:
        for dl in kv_layouts(1, 2, num_layers, num_heads, rank_base=10):
            pool = torch.zeros_like(kv_shard(g, dl))
            dst = make(dl, pool, f"reshard-{name}-d{dl.global_rank}")
            opened.append(dst)
            begin_pull_from_peers(dst, [(s.export_meta(), src_ids) for s in sources], dst_ids,
                                  request_id=f"r{dl.global_rank}").wait(30)
            expected = torch.zeros_like(pool)
            expected[:, :, torch.from_numpy(dst_ids)] = kv_shard(g, dl)[:, :, torch.from_numpy(src_ids)]
            assert same_bytes(pool, expected)
    finally:
        for b in opened:
            b.close()
