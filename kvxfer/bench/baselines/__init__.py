"""Baselines measured in the same run, on the same machine, at the same sizes.

Each module has one job and reports ``PointResult``s (kind ``"baseline"``) or an
``Unavailable`` with the reason it could not run here:

* ``memcpy``: a same-process copy of the same bytes, the physical ceiling;
* ``naive_nixl``: what the reference does, one NIXL descriptor per (block, plane),
  built per request with ``initialize_xfer``, two processes;
* ``ucx_perftest``: UCX's own ``ucp_get`` benchmark from the libucx wheel;
* ``mooncake``: Mooncake Transfer Engine ``batch_transfer_sync_read`` over TCP.
"""
