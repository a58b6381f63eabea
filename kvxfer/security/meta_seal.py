"""An integrity seal over a backend's exported meta.

A peer's meta carries addresses and transport keys (agent metadata, packed rkeys,
worker addresses) that go straight into C libraries; UCX, for one, trusts them and
a shared-memory read through a stale or altered ``base_addr`` faults in *our*
process. The exporter seals every field it wrote: the seal lists those keys and a
SHA-256 over their canonical JSON. The importer refuses a meta whose sealed fields
are missing or changed, before a single field reaches a transport, and reads
*only* the sealed fields (``check_meta_seal`` returns them).

Fields added later are allowed and ignored: Megatron's engine extends a peer's meta
per request (``resume_tokens``, ``block_ids``, ``ssm``) and wraps it in
``tp_metas``/``pp_metas`` (``docs/megatron.md``). Canonical JSON makes the seal survive
a JSON or pickle round trip (tuples become lists, nothing else changes).

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
SEAL_VERSION = 2
MAX_SEALED_KEYS = 256
_MAX_KEY_CHARS = 128


def _digest(meta: Mapping[str, Any], keys: list[str]) -> str:
    body = {key: meta[key] for key in keys}
    try:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PeerMetadataError(f"peer meta is not JSON-serialisable: {exc}") from None
    return hashlib.sha256(canonical.encode()).hexdigest()


def seal_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """Seal every field of ``meta`` (a previous seal is replaced); returns ``meta`` for chaining."""
    meta.pop(SEAL_FIELD, None)
    keys = sorted(meta)
    meta[SEAL_FIELD] = {"version": SEAL_VERSION, "keys": keys, "sha256": _digest(meta, keys)}
    return meta


def check_meta_seal(meta: Any) -> dict[str, Any]:
    """The sealed fields of ``meta``; ``PeerMetadataError`` unless they are exactly what was exported."""
    if not isinstance(meta, Mapping):
        raise PeerMetadataError(f"peer meta must be a dict, got {type(meta).__name__}")
    seal = meta.get(SEAL_FIELD)
    if not isinstance(seal, Mapping):
        raise PeerMetadataError(
            f"peer meta has no valid {SEAL_FIELD!r}; pass the peer's export_meta() (extended or wrapped is fine)"
        )
    if seal.get("version") != SEAL_VERSION:
        raise PeerMetadataError(
            f"peer meta seal version is {seal.get('version')!r}, this kvxfer speaks {SEAL_VERSION}; "
            "run the same kvxfer version on both sides"
        )
    keys, digest = seal.get("keys"), seal.get("sha256")
    if (not isinstance(keys, (list, tuple)) or not 0 < len(keys) <= MAX_SEALED_KEYS
            or not all(isinstance(k, str) and 0 < len(k) <= _MAX_KEY_CHARS and k != SEAL_FIELD for k in keys)
            or len(set(keys)) != len(keys) or not isinstance(digest, str)):
        raise PeerMetadataError(f"peer meta field {SEAL_FIELD!r} is malformed")
    missing = [key for key in keys if key not in meta]
    if missing:
        raise PeerMetadataError(f"peer meta lost sealed fields {missing[:8]} after export_meta()")
    if digest != _digest(meta, list(keys)):
        raise PeerMetadataError(
            "peer meta failed its integrity check: a sealed field was changed or corrupted after "
            "export_meta(); fields may be added, not changed"
        )
    return {key: meta[key] for key in keys}
