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

The hash alone guards against accidents: anyone can recompute it. With the cluster key
(``$KVXFER_SECRET_FILE``, the control plane's secret) the exporter also signs the sealed
fields (HMAC-SHA256 under a key derived for metas) and an importer holding the key
refuses any meta without a valid signature, whichever control plane carried it
(Megatron's included). An importer without a key accepts unsigned metas only from its
own host (same boot id and network namespace, ``host_identity``), unless the user opts
in to unauthenticated metas by name: a forged meta is how a remote peer would point
our reads at memory it chose.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from functools import lru_cache
from typing import Any, Mapping, Optional

from kvxfer.errors import PeerMetadataError
from kvxfer.meta.version import WIRE_VERSION

SEAL_FIELD = "meta_seal"
MAX_SEALED_KEYS = 256
_MAX_KEY_CHARS = 128


#: The sealed field naming the exporter's host (``host_identity``).
HOST_FIELD = "host_id"


@lru_cache(maxsize=1)
def host_identity() -> str:
    """This kernel and network namespace: peers with the same identity share memory and loopback."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "unknown-netns"
    return f"{boot}/{netns}"


def _canonical(meta: Mapping[str, Any], keys: list[str]) -> bytes:
    body = {key: meta[key] for key in keys}
    try:
        return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested deeper than JSON goes
        raise PeerMetadataError(f"peer meta is not JSON-serialisable: {type(exc).__name__}: {exc}") from None


def _signature(key: bytes, canonical: bytes) -> str:
    meta_key = hmac.new(key, b"kvxfer/meta-signature", hashlib.sha256).digest()  # not the frame key
    return hmac.new(meta_key, canonical, hashlib.sha256).hexdigest()


def seal_meta(meta: dict[str, Any], key: Optional[bytes] = None) -> dict[str, Any]:
    """Seal (and with ``key`` sign) every field of ``meta``, replacing a previous seal; returns ``meta``."""
    meta.pop(SEAL_FIELD, None)
    keys = sorted(meta)
    canonical = _canonical(meta, keys)
    seal: dict[str, Any] = {"version": WIRE_VERSION, "keys": keys, "sha256": hashlib.sha256(canonical).hexdigest()}
    if key is not None:
        seal["hmac"] = _signature(key, canonical)
    meta[SEAL_FIELD] = seal
    return meta


def check_meta_seal(meta: Any, key: Optional[bytes] = None, *, allow_unauthenticated: bool = False) -> dict[str, Any]:
    """The sealed fields of ``meta``; ``PeerMetadataError`` unless they are exactly what was exported
    and, with ``key``, signed with it (without: exported on this host, or ``allow_unauthenticated``)."""
    if not isinstance(meta, Mapping):
        raise PeerMetadataError(f"peer meta must be a dict, got {type(meta).__name__}")
    seal = meta.get(SEAL_FIELD)
    if not isinstance(seal, Mapping):
        raise PeerMetadataError(
            f"peer meta has no valid {SEAL_FIELD!r}; pass the peer's export_meta() (extended or wrapped is fine)"
        )
    if seal.get("version") != WIRE_VERSION:
        raise PeerMetadataError(
            f"peer meta seal version is {seal.get('version')!r}, this kvxfer speaks {WIRE_VERSION}; "
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
    canonical = _canonical(meta, list(keys))
    if digest != hashlib.sha256(canonical).hexdigest():
        raise PeerMetadataError(
            "peer meta failed its integrity check: a sealed field was changed or corrupted after "
            "export_meta(); fields may be added, not changed"
        )
    view = {name: meta[name] for name in keys}
    if key is not None:
        signature = seal.get("hmac")
        if not isinstance(signature, str) or not hmac.compare_digest(signature, _signature(key, canonical)):
            raise PeerMetadataError(
                "peer meta is not signed with this cluster's key (forged, or the peer runs without "
                "KVXFER_SECRET_FILE or with another secret); it was refused before any field was used"
            )
    elif not allow_unauthenticated and view.get(HOST_FIELD) != host_identity():
        raise PeerMetadataError(
            f"peer meta from another host ({view.get(HOST_FIELD)!r}) is not authenticated: point "
            "KVXFER_SECRET_FILE at the cluster secret on both sides, or opt in with "
            "KVXFER_ALLOW_UNAUTHENTICATED_METAS=1 (or allow_unauthenticated_metas=True)"
        )
    return view


#: Set to 1/true to accept unsigned metas from other hosts (a trusted network only).
ALLOW_UNAUTHENTICATED_ENV = "KVXFER_ALLOW_UNAUTHENTICATED_METAS"


def meta_key_from_env() -> Optional[bytes]:
    """The cluster key from ``$KVXFER_SECRET_FILE``, or None when it is not set."""
    from kvxfer.security.auth import SECRET_FILE_ENV, load_secret

    path = os.environ.get(SECRET_FILE_ENV)
    return load_secret(secret_file=path) if path else None


def unauthenticated_metas_allowed_by_env() -> bool:
    return os.environ.get(ALLOW_UNAUTHENTICATED_ENV, "").strip().lower() in ("1", "true", "yes")
