"""What planning knows of the pool a rank reads into (the planners' one description of "us").

Apart from ``request.py`` so that every planner (``reshard_descriptors``, ``staged_reshard``,
``request``) can name it without importing the entry point that calls them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvxfer.plan.geometry import BufferGeometry, PeerGeometry, dtype_from_name
from kvxfer.plan.ssm_layout import SSMShardLayout


@dataclass(frozen=True)
class LocalPool:
    """What planning knows of the pool a rank reads into: its geometry, dtype and SSM identity.

    A backend describes its own registration with one (``KVTransportBackend.local_pool``);
    a push sender describes the decode's pool from its meta (``from_peer``).
    """

    geometry: BufferGeometry
    dtype: str  # the wire spelling, e.g. "bfloat16"
    ssm_layout: Optional[SSMShardLayout] = None
    ssm_state_kind: Optional[str] = None

    @staticmethod
    def from_peer(peer: PeerGeometry) -> "LocalPool":
        return LocalPool(peer.geometry, peer.dtype, peer.ssm_layout, peer.ssm_state_kind)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)
