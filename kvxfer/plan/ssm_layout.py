"""Which part of a hybrid (Mamba-style) model's SSM state one rank holds.

An SSM layer keeps two per-request states, each in its own paged pool whose blocks
axis is fixed at 1 (one block = one request slot):

* **conv** ``[L_local, B, channels_local, d_conv]`` -- channel-major, so that a
  contiguous range of channels is one contiguous byte range per slot. The local
  channels are three TP-split bands laid end to end::

      [ x: nheads_local*headdim | B: ngroups_local*d_state | C: ngroups_local*d_state ]

  Globally each band is split over TP ranks on its own, so changing TP means
  cutting and re-joining the bands, not one contiguous channel range.
* **recurrent** ``[L_local, B, nheads_local, headdim, d_state]`` -- split by heads.

Both heads and groups are split evenly by TP (no replication: the model itself
cannot run with ``tp_size > ngroups``), and layers by pipeline stage, exactly like
``KVShardLayout``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional

from kvxfer.errors import GeometryError, PeerMetadataError
from kvxfer.plan.layout import check_head_split, check_layer_window, check_positive, check_ranks, layer_window

#: Names of the conv bands in their order inside one slot.
CONV_BANDS = ("x", "B", "C")


@dataclass(frozen=True)
class SSMStateDims:
    """The model's global SSM dimensions (per layer)."""

    nheads: int
    headdim: int
    d_state: int
    ngroups: int
    d_conv: int

    def __post_init__(self) -> None:
        check_positive("SSMStateDims", self, ("nheads", "headdim", "d_state", "ngroups", "d_conv"))
        if self.nheads % self.ngroups:
            raise GeometryError(f"SSMStateDims: nheads={self.nheads} is not a multiple of ngroups={self.ngroups}")

    @property
    def conv_channels(self) -> int:
        """Global conv channels: ``nheads*headdim + 2*ngroups*d_state``."""
        return self.nheads * self.headdim + 2 * self.ngroups * self.d_state


@dataclass(frozen=True)
class SSMShardLayout:
    """The global slice of the SSM state one rank's pools hold.

    ``num_layers`` counts the model's SSM layers (the pools hold only those).
    ``layer_start``/``num_local_layers``: explicit pipeline window, both or neither.
    ``ep_size``/``ep_rank`` only break ties between replicas, as in ``KVShardLayout``.
    """

    num_layers: int
    dims: SSMStateDims
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    global_rank: int = 0
    layer_start: Optional[int] = None
    num_local_layers: Optional[int] = None
    ep_size: int = 1
    ep_rank: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dims, SSMStateDims):
            raise GeometryError(f"SSMShardLayout.dims must be an SSMStateDims, got {type(self.dims).__name__}")
        check_positive("SSMShardLayout", self, ("num_layers",))
        check_ranks("SSMShardLayout", self)
        check_layer_window("SSMShardLayout", self.num_layers, self.pp_size, self.layer_start, self.num_local_layers)
        check_head_split("SSMShardLayout", "SSM heads", self.dims.nheads, self.tp_size, allow_replication=False)
        check_head_split("SSMShardLayout", "SSM groups", self.dims.ngroups, self.tp_size, allow_replication=False)

    # --- local ranges (global coordinates) ------------------------------------------------
    @property
    def nheads_local(self) -> int:
        return self.dims.nheads // self.tp_size

    @property
    def ngroups_local(self) -> int:
        return self.dims.ngroups // self.tp_size

    @property
    def conv_channels_local(self) -> int:
        return self.nheads_local * self.dims.headdim + 2 * self.ngroups_local * self.dims.d_state

    def local_head_range(self) -> tuple[int, int]:
        """Global ``[start, end)`` of the SSM heads this rank holds."""
        return self.tp_rank * self.nheads_local, (self.tp_rank + 1) * self.nheads_local

    def local_group_range(self) -> tuple[int, int]:
        """Global ``[start, end)`` of the SSM groups (B/C channels) this rank holds."""
        return self.tp_rank * self.ngroups_local, (self.tp_rank + 1) * self.ngroups_local

    def local_layer_range(self) -> tuple[int, int]:
        """Global ``[start, end)`` of the SSM layers this rank holds."""
        return layer_window(self.num_layers, self.pp_size, self.pp_rank, self.layer_start, self.num_local_layers)

    def model_key(self) -> tuple[Any, ...]:
        """What two layouts must agree on to describe the same model's SSM state."""
        return ("ssm", self.num_layers, self.dims)

    def state_shape(self, kind: str, num_blocks: int) -> tuple[int, ...]:
        """The pool shape this layout implies for ``kind`` ("conv" or "recurrent")."""
        first, last = self.local_layer_range()
        if kind == "conv":
            return (last - first, num_blocks, self.conv_channels_local, self.dims.d_conv)
        if kind == "recurrent":
            return (last - first, num_blocks, self.nheads_local, self.dims.headdim, self.dims.d_state)
        raise GeometryError(f"unknown SSM state kind {kind!r}; expected 'conv' or 'recurrent'")

    # --- wire form ------------------------------------------------------------------------
    def to_meta(self) -> dict[str, Any]:
        """JSON-serialisable form (``dims`` nested); ``from_meta`` is its inverse."""
        return asdict(self)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "SSMShardLayout":
        """Rebuild a peer's SSM layout, turning every problem into ``PeerMetadataError``."""
        if not isinstance(meta, Mapping):
            raise PeerMetadataError(f"peer meta field 'ssm_layout' must be an object, got {type(meta).__name__}")
        unknown = set(meta) - {f.name for f in fields(cls)}
        dims = meta.get("dims")
        if unknown:
            raise PeerMetadataError(f"peer meta field 'ssm_layout' has unknown keys {sorted(unknown)}")
        if not isinstance(dims, Mapping) or set(dims) != {f.name for f in fields(SSMStateDims)}:
            raise PeerMetadataError(
                f"peer meta field 'ssm_layout.dims' must be an object with keys "
                f"{sorted(f.name for f in fields(SSMStateDims))}, got {dims!r}"
            )
        try:
            return cls(**{**dict(meta), "dims": SSMStateDims(**dict(dims))})
        except (GeometryError, TypeError) as exc:
            raise PeerMetadataError(f"peer meta field 'ssm_layout' is invalid: {exc}") from None
