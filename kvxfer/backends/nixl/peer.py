"""The NIXL section of a peer's meta: the fields this backend exports beside the geometry, and their check."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from kvxfer.errors import PeerMetadataError
from kvxfer.meta.capabilities import reveal
from kvxfer.meta.version import check_wire_version

MEM_TYPES = ("DRAM", "VRAM")
#: The exporting process and its start time: a reader on the same host watches it by pidfd.
PID_FIELD, START_FIELD = "nixl_pid", "nixl_pid_start"


@dataclass(frozen=True)
class NixlPeer:
    """The NIXL fields of a peer's ``export_meta()``, checked."""

    name: str
    instance: str  # changes when the peer's agent is re-created (restart under the same name)
    metadata: bytes
    buffer_id: int
    mem_type: str


def parse_nixl_peer(meta: Mapping[str, Any], cluster_key: Optional[bytes] = None) -> NixlPeer:
    """Validate the NIXL fields of a peer meta; ``PeerMetadataError`` names the bad field. The agent
    metadata (a capability: it carries the pool's rkeys) is opened with ``cluster_key`` when it travels
    encrypted (``kvxfer.meta.capabilities``)."""
    check_wire_version(meta.get("nixl_meta_version"), "meta field 'nixl_meta_version'")
    instance = meta.get("nixl_agent_instance")
    if not isinstance(instance, str) or not instance:
        raise PeerMetadataError("peer meta field 'nixl_agent_instance' must be a non-empty string")
    encoded = reveal(meta.get("nixl_agent_metadata"), cluster_key, "nixl_agent_metadata")
    if not isinstance(encoded, str) or not encoded:
        raise PeerMetadataError("peer meta field 'nixl_agent_metadata' must be a non-empty base64 string")
    try:
        metadata = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise PeerMetadataError("peer meta field 'nixl_agent_metadata' is not valid base64") from None
    buffer_id = meta.get("nixl_buffer_id")
    if isinstance(buffer_id, bool) or not isinstance(buffer_id, int) or buffer_id < 1:
        raise PeerMetadataError(f"peer meta field 'nixl_buffer_id' must be a positive int, got {buffer_id!r}")
    mem_type = meta.get("nixl_mem_type")
    if mem_type not in MEM_TYPES:
        raise PeerMetadataError(f"peer meta field 'nixl_mem_type' must be one of {MEM_TYPES}, got {mem_type!r}")
    name = meta.get("nixl_agent_name")
    if not isinstance(name, str) or not name:
        raise PeerMetadataError("peer meta field 'nixl_agent_name' must be a non-empty string")
    return NixlPeer(name, instance, metadata, buffer_id, mem_type)
