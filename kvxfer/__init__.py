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

from kvxfer.backends import (
    available_backends,
    construct_kv_transfer_backend_class,
    default_backend_name,
    register_backend,
)
from kvxfer.backends.base import KVTransportBackend, TransferHandle, TransferState
from kvxfer.errors import (
    BackendUnavailableError,
    BlockIdError,
    GeometryError,
    KVXferError,
    PeerMetadataError,
    TransferError,
    TransferTimeoutError,
)
from kvxfer.plan.geometry import BufferGeometry, compute_buffer_geometry, export_geometry_meta, parse_geometry_meta

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError", "BlockIdError", "BufferGeometry", "GeometryError", "KVTransportBackend",
    "KVXferError", "PeerMetadataError", "TransferError", "TransferHandle", "TransferState",
    "TransferTimeoutError", "available_backends", "compute_buffer_geometry", "construct_kv_transfer_backend_class",
    "default_backend_name", "export_geometry_meta", "parse_geometry_meta", "register_backend",
]
