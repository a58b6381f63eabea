"""A meta's capability fields, encrypted under the cluster key.

Some fields of an exported meta are not descriptions but keys to the exporter's memory: NIXL's agent
metadata (it carries the registered regions' rkeys), the ``ucx`` backend's packed rkey and the read token
its served reads check. Whoever reads them off the wire can read the exported pool, as anyone holding an
RDMA rkey can. Signing (``seal.py``) proves who wrote a meta; it does not hide it, and metas travel in
the clear over the engines' own sockets (SGLang's HELLO, vLLM's side channel, etcd records). So with the
cluster key each backend's capability fields (``KVTransportBackend.capability_meta_fields``) are
encrypted before the meta is sealed: AES-256-GCM under a key derived from the cluster key for this use
only, a random 96-bit nonce per field, the field's name as associated data (a box moved to another field
does not open). The seal then covers the boxes, so the meta's digest and signature stay what they were.

A reader opens a box only when it parses the transport section (``reveal``), with the same key; without
the key, or with another, the field cannot be read and the meta is refused naming the setting. Without a
cluster key nothing is encrypted: the keyless mode's exposure is docs/reliability.md's table.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from functools import lru_cache
from typing import Any, Optional

from kvxfer.errors import PeerMetadataError

#: What an encrypted field's value starts with (then base64 of nonce + ciphertext + tag).
BOX_PREFIX = "kvxfer-box1:"
_NONCE_BYTES = 12
#: The largest box accepted (NIXL's agent metadata is a few KiB; a peer cannot make us decrypt more).
MAX_BOX_CHARS = 1 << 22


@lru_cache(maxsize=8)
def _aead(cluster_key: bytes) -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:  # pragma: no cover - a core dependency
        raise PeerMetadataError("encrypting a meta's capability fields needs the 'cryptography' package: "
                                "pip install 'cryptography>=42'") from None
    return AESGCM(hmac.new(cluster_key, b"kvxfer/meta-capabilities", hashlib.sha256).digest())


def conceal(value: str, cluster_key: bytes, field: str) -> str:
    """``value`` (a capability field's text) in a box only ``cluster_key`` opens, bound to ``field``."""
    nonce = os.urandom(_NONCE_BYTES)
    sealed = _aead(cluster_key).encrypt(nonce, value.encode(), field.encode())
    return BOX_PREFIX + base64.b64encode(nonce + sealed).decode("ascii")


def is_box(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(BOX_PREFIX)


def reveal(value: Any, cluster_key: Optional[bytes], field: str) -> Any:
    """A capability field as its exporter wrote it. A box needs ``cluster_key``; with a key, a field that is
    not a box is refused (a keyed exporter never sends one in the clear). ``PeerMetadataError`` names the fix."""
    if not is_box(value):
        if cluster_key is not None and value is not None:
            raise PeerMetadataError(
                f"peer meta field {field!r} travels in the clear although this process has the cluster key "
                "(KVXFER_SECRET_FILE): the peer runs without the key or an older kvxfer; give both the same key")
        return value
    if cluster_key is None:
        raise PeerMetadataError(
            f"peer meta field {field!r} is encrypted under a cluster key this process does not have: point "
            "KVXFER_SECRET_FILE at the cluster secret, as on the peer")
    if len(value) > MAX_BOX_CHARS:
        raise PeerMetadataError(f"peer meta field {field!r} is larger than {MAX_BOX_CHARS} characters")
    try:
        raw = base64.b64decode(value[len(BOX_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise PeerMetadataError(f"peer meta field {field!r} is not a valid box (bad base64)") from None
    if len(raw) <= _NONCE_BYTES + 16:
        raise PeerMetadataError(f"peer meta field {field!r} is not a valid box (too short)")
    from cryptography.exceptions import InvalidTag

    try:
        plain = _aead(cluster_key).decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], field.encode())
    except InvalidTag:
        raise PeerMetadataError(
            f"peer meta field {field!r} does not open with this cluster's key (another secret, or altered); "
            "give both sides the same KVXFER_SECRET_FILE") from None
    try:
        return plain.decode()
    except UnicodeDecodeError:
        raise PeerMetadataError(f"peer meta field {field!r} holds no text") from None
