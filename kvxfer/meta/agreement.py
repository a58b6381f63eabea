"""The meta fields two engines must agree on before KV can move between them, stated once.

A prefill and a decode may differ in pool size, TP and PP (a reshard plan maps one to the other), but not in
these: the wire version, the transport, the element type and size, the block's token count, the head shape,
and the slice layout. The control planes refuse an engine whose first meta differs from the fleet's in one of
them, naming the field (``engine_integration.control_plane.policy``); a backend refuses the same at its
first pull (``geometry.parse_geometry_meta`` and the planner). Adding a field two peers must agree on is one
line here, beside writing it in ``geometry.export_geometry_meta``.

No imports: the coordinator process reads this and never loads torch.
"""

from __future__ import annotations

AGREED_FIELDS: tuple[str, ...] = ("schema_version", "backend", "dtype", "element_size", "tokens_per_block",
                                  "heads_per_partition", "head_dim", "num_outer", "bytes_per_slice")
