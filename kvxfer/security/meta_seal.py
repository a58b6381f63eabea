"""An integrity seal over a backend's exported meta.

A peer's meta carries addresses and transport keys (agent metadata, packed rkeys,
worker addresses) that go straight into C libraries; UCX, for one, trusts them and
a shared-memory read through a stale or altered ``buf_ptr`` faults in *our*
process. The exporter seals the whole meta (a SHA-256 over its canonical JSON)
and the importer refuses any meta whose seal does not match, before a single
field reaches a transport: a truncated, corrupted or edited meta is a clear
``PeerMetadataError``, never a crash.

This guards against accidents, not adversaries: anyone can compute the seal. That
only authenticated peers can hand us a meta at all is the control channel's job
(``kvxfer.security.auth``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from kvxfer.errors import PeerMetadataError

SEAL_FIELD = "meta_seal"


def _digest(meta: Mapping[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != SEAL_FIELD}
    try:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PeerMetadataError(f"peer meta is not JSON-serialisable: {exc}") from None
    return hashlib.sha256(canonical.encode()).hexdigest()


def seal_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """Add (or refresh) the seal; returns ``meta`` for chaining."""
    meta[SEAL_FIELD] = _digest(meta)
    return meta


def check_meta_seal(meta: Mapping[str, Any]) -> None:
    """Raise ``PeerMetadataError`` unless ``meta`` is exactly what its exporter sealed."""
    if not isinstance(meta, Mapping):
        raise PeerMetadataError(f"peer meta must be a dict, got {type(meta).__name__}")
    seal = meta.get(SEAL_FIELD)
    if not isinstance(seal, str):
        raise PeerMetadataError(f"peer meta is missing field {SEAL_FIELD!r}; pass the peer's export_meta() unchanged")
    if seal != _digest(meta):
        raise PeerMetadataError(
            "peer meta failed its integrity check: a field was changed, truncated or corrupted after "
            "export_meta(); pass the peer's export_meta() unchanged"
        )
