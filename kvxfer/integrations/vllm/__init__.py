"""kvxfer as a vLLM KV connector: ``KvxferConnector`` (``docs/vllm.md``).

vLLM loads it by module path::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_connector_module_path": "kvxfer.integrations.vllm",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {"backend": "nixl"}}'

The connector class imports vLLM; it is loaded on first access, so the pure parts of
this package (configuration, signed handoff tickets, the handshake) import without it.

Modules: ``config`` (extra-config parsing), ``tickets`` (the signed ``kv_transfer_params``),
``handshake`` and ``side_channel`` (the per-instance meta exchange), ``kv_buffers`` (vLLM's
KV tensors -> one kvxfer registration), ``scheduler`` (scheduler role), ``worker`` / ``sender`` / ``receiver`` (worker role),
``stats``, ``connector`` (the facade vLLM instantiates); ``README.md`` has the reading order. The
torn-read-safe pin check (leases) is the library's: ``kvxfer.handoff.guard``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvxferConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvxferConnector":
        from kvxfer.integrations.vllm.connector import KvxferConnector

        return KvxferConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
