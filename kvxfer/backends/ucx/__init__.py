"""The ``ucx`` backend: one-sided gets through UCX's UCP, via a small cffi binding."""

from kvxfer.backends.ucx.backend import UcxBackend, UcxHandle, ucx_transport_info

__all__ = ["UcxBackend", "UcxHandle", "ucx_transport_info"]
