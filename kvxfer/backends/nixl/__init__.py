"""The ``nixl`` backend: one-sided READs through a NIXL agent (UCX underneath)."""

from kvxfer.backends.nixl.backend import NixlBackend, NixlHandle, nixl_transport_probe

__all__ = ["NixlBackend", "NixlHandle", "nixl_transport_probe"]
