"""Rules both control planes (the ZeroMQ coordinator and etcd) apply to the engines they see.

Kept free of zmq and of the etcd client so that either plane imports it.
"""

from __future__ import annotations

import os

#: Meta fields two engines must agree on before KV can move between them.
GEOMETRY_FIELDS = ("schema_version", "backend", "dtype", "element_size", "tokens_per_block", "heads_per_partition",
                   "head_dim", "num_outer", "bytes_per_slice")


def process_gone(pid: int) -> bool:
    """True when ``pid`` (on this host) has exited; a zombie counts as exited: it runs nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False
