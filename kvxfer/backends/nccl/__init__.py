"""The ``nccl`` backend: push over torch.distributed point-to-point (NCCL on GPUs, Gloo on host memory)."""

from kvxfer.backends.nccl.backend import NcclBackend, NcclRecvHandle, NcclSendHandle

__all__ = ["NcclBackend", "NcclRecvHandle", "NcclSendHandle"]
