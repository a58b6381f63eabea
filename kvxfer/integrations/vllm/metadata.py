"""What the scheduler tells its workers each step (``build_connector_meta``), and what workers
report up at start-up (``get_handshake_metadata``). Plain dataclasses: vLLM pickles them
between processes when workers run apart from the scheduler (TP > 1)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from kvxfer.integrations.vllm.specs import LoadSpec, SendSpec

__all__ = ["KvxferConnectorMetadata", "KvxferHandshakeMetadata", "LoadSpec", "SendSpec"]


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)


@dataclass
class KvxferHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One worker's ``{"kv": [meta per region], "lease": meta, "layout": {...}}`` as JSON."""

    payload: str
