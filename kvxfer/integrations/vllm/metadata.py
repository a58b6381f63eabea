"""What the scheduler tells its workers each step (``build_connector_meta``), and what workers
report up at start-up (``get_handshake_metadata``). Plain dataclasses: vLLM pickles them
between processes when workers run apart from the scheduler (TP > 1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata


@dataclass(frozen=True)
class LoadSpec:
    """Decode side: pull one request's prompt KV (or, with no blocks, just release the producer's pin).

    ``first_block`` is the block position the pull starts at (the blocks before it are a local
    prefix-cache hit); the worker takes the remote ids from the *verified* ticket from there.
    ``awaiting``: the scheduler parked the request in WAITING_FOR_REMOTE_KVS and expects it in
    ``finished_recving``. ``refusal``: the scheduler already found the ticket unusable.
    """

    request_id: str
    params: dict[str, Any]
    local_block_ids: tuple[int, ...]
    first_block: int
    awaiting: bool
    refusal: Optional[str] = None


@dataclass(frozen=True)
class SendSpec:
    """Producer side: a finished request whose blocks vLLM keeps until we report it sent."""

    request_id: str
    block_ids: tuple[int, ...]
    slot: int
    lease: int


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)


@dataclass
class KvxferHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One worker's ``{"kv": [meta per region], "lease": meta, "layout": {...}}`` as JSON."""

    payload: str
