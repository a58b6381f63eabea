"""The wire's one version, and its history.

Everything kvxfer puts on a wire between two processes carries this number: a backend's
exported meta (``schema_version``, the geometry schema and every transport's section, e.g.
``nixl_meta_version``), the seal over it (``meta_seal.version``), the read-done / read-failed
notices (``v``) and the ``nccl`` backend's message header (``backends/nccl/wire.py``). Two processes speak to each other only if they carry the same version, so a
change to any field's meaning bumps it once, here, with a line in ``HISTORY``.
"""

from __future__ import annotations

from typing import Any

from kvxfer.errors import PeerMetadataError

WIRE_VERSION = 5

#: version -> what changed (newest last). Before 3 each part counted on its own.
HISTORY: dict[int, str] = {
    1: "first schema: geometry fields, nixl agent metadata, an unsigned seal, JSON notices",
    2: "the seed's field names (base_addr, flat KV topology fields), Megatron-shaped ssm_layout; "
       "seals signed with the cluster key (HMAC-SHA256) and bound to the exporter's host",
    3: "one version for the whole wire (it was: geometry schema 2, nixl section 1, seal 2, notice 1); "
       "the ucx backend's read-done notices in the shared notice format",
    4: "the nccl backend's message header carries this version (it counted its own, 1)",
    5: "with the cluster key, a meta's capability fields (nixl agent metadata, ucx rkey and read token) are "
       "AES-GCM boxes (kvxfer.meta.capabilities); the ucx section carries ucx_meta_version",
}


def check_wire_version(value: Any, where: str) -> None:
    """Refuse a peer's ``where`` (a field name) unless it carries this kvxfer's wire version."""
    if value != WIRE_VERSION:
        raise PeerMetadataError(
            f"peer {where} is {value!r}, this kvxfer speaks wire version {WIRE_VERSION}; "
            "run the same kvxfer version on both sides")
