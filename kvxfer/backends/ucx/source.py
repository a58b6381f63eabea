"""The ucx section of a source's meta: the fields this backend exports beside the geometry, decoded and
checked once by the reader (``UcxSource.parse``), and the base64 they travel in."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from kvxfer.errors import PeerMetadataError
from kvxfer.meta.capabilities import reveal
from kvxfer.meta.version import check_wire_version


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@dataclass(frozen=True)
class UcxSource:
    """The ucx section of a source's meta, decoded and checked once: the worker address to reach it,
    the packed rkey of its pool, and the token its served reads need (absent: it serves none)."""

    address: bytes
    rkey: bytes
    read_token: Optional[bytes]

    @staticmethod
    def parse(meta: Mapping[str, Any], cluster_key: Optional[bytes] = None) -> "UcxSource":
        """The section of ``meta``; the capability fields (``CAPABILITY_FIELDS``) opened with ``cluster_key``
        when they travel encrypted (``kvxfer.meta.capabilities``)."""
        check_wire_version(meta.get("ucx_meta_version"), "meta field 'ucx_meta_version'")
        token = unb64(meta, "ucx_read_token", cluster_key) if meta.get("ucx_read_token") is not None else None
        return UcxSource(unb64(meta, "ucx_worker_address"), unb64(meta, "ucx_rkey", cluster_key), token)


#: The fields that let their holder read the source's pool: encrypted under the cluster key when there is one.
CAPABILITY_FIELDS = ("ucx_rkey", "ucx_read_token")


def unb64(meta: Mapping[str, Any], field: str, cluster_key: Optional[bytes] = None) -> bytes:
    value = meta.get(field)
    if field in CAPABILITY_FIELDS:
        value = reveal(value, cluster_key, field)
    if not isinstance(value, str) or not value:
        raise PeerMetadataError(f"peer meta field {field!r} must be a non-empty base64 string; export it with the ucx backend")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PeerMetadataError(f"peer meta field {field!r} is not valid base64: {exc}") from None
