"""The ``torch.distributed`` process group a push backend's processes meet in (``nccl``: NCCL on GPUs, Gloo on
host memory), for the runs that start those processes themselves: the loopback, the bench, the engine launcher.

:func:`host_group` (the process that hosts it: a TCP store on a free port of 127.0.0.1 the OS picks) gives a
:class:`GroupSpec` that travels to the other processes as an argument; :func:`join_group` (every process, each
with its rank, a timeout on the rendezvous) and :func:`leave_group` (``destroy_process_group``) bracket the run.
Beside the backends rather than in a harness, so the engine layer can join a group without importing one;
and outside ``nccl/``, so joining one imports no backend (the registry imports only the backend it is asked for).
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: Ranks of the two-process group a push backend runs in: the prefill pushes from 0 to the decode's 1.
PREFILL_RANK, DECODE_RANK = 0, 1


@dataclass(frozen=True)
class GroupSpec:
    """Where and how the two processes of a push run meet: a TCP store, the world, the timeouts.

    ``join_timeout_s`` bounds the rendezvous (a peer that never joins); ``timeout_s`` is
    the group's own operation timeout, which must not be shorter than a transfer's."""

    host: str
    port: int
    world_size: int = 2
    backend: str = "gloo"
    join_timeout_s: float = 60.0
    timeout_s: float = 300.0


def host_group(join_timeout_s: float = 60.0, timeout_s: float = 300.0, backend: str = "gloo") -> tuple[Any, GroupSpec]:
    """Parent side: a TCP store listening on a port of 127.0.0.1 the OS chose, and the spec to hand the child.

    The store lives as long as the returned object; pass it to :func:`join_group` in this process."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=join_timeout_s))
    return store, GroupSpec("127.0.0.1", int(store.port), 2, backend, join_timeout_s, max(timeout_s, join_timeout_s))


def join_group(spec: GroupSpec, rank: int, store: Any = None) -> None:
    """Join the default process group of ``spec`` as ``rank`` (the store's host passes its store).

    Raises ``TimeoutError`` naming the spec when the other process does not join within ``join_timeout_s``."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("this process already has a default process group; leave it (leave_group) first")
    if store is None:
        store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=spec.join_timeout_s))
    logger.debug("joining a %s process group of %d at %s:%d as rank %d", spec.backend, spec.world_size, spec.host,
                 spec.port, rank)
    try:
        dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.world_size,
                                timeout=datetime.timedelta(seconds=spec.timeout_s))
    except Exception as exc:  # the store's timeout surfaces as a DistStoreError / RuntimeError
        raise TimeoutError(f"rank {rank} could not join the {spec.backend} process group at {spec.host}:{spec.port} "
                           f"within {spec.join_timeout_s:.0f}s: {' '.join(str(exc).split())[:300]}") from exc


def leave_group() -> None:
    """Tear down the default process group, if this process has one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
