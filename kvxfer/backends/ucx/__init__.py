"""The ``ucx`` backend: one-sided gets through UCX's UCP, via a small cffi binding."""

from kvxfer.backends.ucx.backend import UcxBackend, ucx_transport_info
from kvxfer.backends.ucx.handle import UcxHandle

__all__ = ["UcxBackend", "UcxHandle", "ucx_transport_info"]
