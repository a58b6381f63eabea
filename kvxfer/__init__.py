"""kvxfer: move an LLM request's KV cache (and SSM state) from prefill to decode.

Pick a backend by name, register the paged pool, exchange ``export_meta()``, and
pull blocks with one-sided reads::

    from kvxfer import construct_kv_transfer_backend_class
    Backend = construct_kv_transfer_backend_class("nixl")
    src = Backend("prefill-0", kv_pool, num_blocks)      # prefill process
    dst = Backend("decode-0", kv_pool, num_blocks)       # decode process
    handle = dst.begin_pull_blocks(src_meta, [7, 3, 9], [0, 1, 2], request_id=42)
    handle.wait()                                         # source: src.drain_read_done() -> [42]
"""

from importlib import import_module
from typing import Any

from kvxfer.errors import (
    BackendUnavailableError,
    BlockIdError,
    GeometryError,
    KVXferError,
    PeerMetadataError,
    TransferCancelledError,
    TransferError,
    TransferTimeoutError,
)

# The rest loads on first use (PEP 562): importing kvxfer.errors or kvxfer.security must not
# pull in torch and every backend (a control-plane process would pay seconds to start).
_LAZY = {
    "available_backends": "kvxfer.backends", "construct_kv_transfer_backend_class": "kvxfer.backends",
    "default_backend_name": "kvxfer.backends", "register_backend": "kvxfer.backends",
    "KVTransportBackend": "kvxfer.backends.base", "TransferHandle": "kvxfer.backends.base",
    "TransferState": "kvxfer.backends.base", "TransferStartError": "kvxfer.backends.base",
    "BufferGeometry": "kvxfer.plan.geometry", "compute_buffer_geometry": "kvxfer.plan.geometry",
    "export_geometry_meta": "kvxfer.meta.geometry", "parse_geometry_meta": "kvxfer.meta.geometry",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError", "BlockIdError", "BufferGeometry", "GeometryError", "KVTransportBackend",
    "KVXferError", "PeerMetadataError", "TransferError", "TransferHandle", "TransferState",
    "TransferStartError", "TransferCancelledError", "TransferTimeoutError", "available_backends", "compute_buffer_geometry", "construct_kv_transfer_backend_class",
    "default_backend_name", "export_geometry_meta", "parse_geometry_meta", "register_backend",
]
