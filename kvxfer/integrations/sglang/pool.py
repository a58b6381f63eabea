"""One kvxfer registration of an SGLang manager's memory: KV pages, aux rows, state slots, and
the small int64 table that carries leases (prefill) or receives them (decode).

Registered once per manager, on one transport agent (the first registration's; the others are
siblings, ``new_registered_buffer``), so a peer needs one connection for all of it.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Optional

import torch

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.integrations.sglang.regions import Region, buffers_of, buffer_regions, region_bytes

logger = logging.getLogger(__name__)


class PoolRegistration:
    """Every buffer of ``kv_args`` registered with kvxfer's ``backend_name`` backend."""

    def __init__(self, kv_args: Any, backend_name: str, *, device: str, table_slots: int, role: str,
                 timeout_s: float, meta_key: Optional[bytes] = None) -> None:
        self.backend_name = backend_name
        kv = buffers_of(kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens, "kv_data")
        aux = buffers_of(kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens, "aux_data")
        self.kv_regions: list[Region] = buffer_regions("kv", kv, device)
        self.aux_regions: list[Region] = buffer_regions("aux", aux, "cpu")  # SGLang keeps metadata rows in host memory
        self.state_regions: list[list[Region]] = []
        for c, (ptrs, lens, items) in enumerate(zip(getattr(kv_args, "state_data_ptrs", None) or [],
                                                    getattr(kv_args, "state_data_lens", None) or [],
                                                    getattr(kv_args, "state_item_lens", None) or [])):
            self.state_regions.append(buffer_regions("state", buffers_of(ptrs, lens, items, f"state_data[{c}]"), device))
        # prefill: lease[slot] per room in flight; decode: where lease reads land
        self.table = torch.zeros(table_slots, dtype=torch.int64)
        cls = construct_kv_transfer_backend_class(backend_name)
        agent = f"sglang-{role}-r{getattr(kv_args, 'engine_rank', 0)}-{uuid.uuid4().hex[:8]}"
        regions = self.kv_regions + self.aux_regions + [r for comp in self.state_regions for r in comp]
        first = cls(agent_name=agent, memory_buffer=regions[0].view, expected_num_blocks=regions[0].items,
                    timeout_s=timeout_s, meta_key=meta_key)
        self.agent = agent
        self.backends: dict[int, Any] = {id(regions[0]): first}
        for region in regions[1:]:
            self.backends[id(region)] = first.new_registered_buffer(memory_buffer=region.view,
                                                                    expected_num_blocks=region.items)
        self.table_backend = first.new_registered_buffer(memory_buffer=self.table, expected_num_blocks=table_slots)
        self._first = first
        logger.info("kvxfer sglang: %s registered %d KV, %d aux, %d state region(s) (%.1f MiB) with %s as %r",
                    role, len(self.kv_regions), len(self.aux_regions), sum(map(len, self.state_regions)),
                    region_bytes(regions) / 2**20, backend_name, agent)

    def backend(self, region: Region) -> Any:
        return self.backends[id(region)]

    def all_backends(self) -> list[Any]:
        return list(self.backends.values()) + [self.table_backend]

    def export(self) -> dict[str, Any]:
        """Every meta a reader needs, region by region, in ``kv_args`` order."""
        return {
            "kv": [[list(r.buffers), self.backend(r).export_meta()] for r in self.kv_regions],
            "aux": [[list(r.buffers), self.backend(r).export_meta()] for r in self.aux_regions],
            "state": [[[list(r.buffers), self.backend(r).export_meta()] for r in comp] for comp in self.state_regions],
            "table": self.table_backend.export_meta(),
        }

    def close(self) -> None:
        for backend in [self.table_backend, *reversed(list(self.backends.values()))]:
            try:
                backend.close()
            except Exception:
                logger.exception("kvxfer sglang: closing a registration failed")
