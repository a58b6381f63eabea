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
cannot run with ``tp_size > ngroups``), and layers by pipeline stage. The layout has
Megatron's fields (``docs/megatron.md``): a stage is named by its layer window.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from kvxfer.errors import GeometryError, PeerMetadataError
from kvxfer.plan.layout import check_head_split, check_positive

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


def _coerce_dims(dims: Any) -> SSMStateDims:
    """Accept our ``SSMStateDims``, a dict of its fields (``asdict`` output) or any object with them."""
    if isinstance(dims, SSMStateDims):
        return dims
    names = [f.name for f in fields(SSMStateDims)]
    if isinstance(dims, Mapping):
        if set(dims) != set(names):
            raise GeometryError(f"SSMShardLayout.dims must have exactly the keys {names}, got {sorted(dims)}")
        return SSMStateDims(**{name: dims[name] for name in names})
    if all(hasattr(dims, name) for name in names):
        return SSMStateDims(**{name: getattr(dims, name) for name in names})
    raise GeometryError(f"SSMShardLayout.dims must be an SSMStateDims (or its fields), got {type(dims).__name__}")


@dataclass(frozen=True)
class SSMShardLayout:
    """The slice of the SSM state one rank's pools hold, in Megatron's shape.

    The fields and their order are those of Megatron's ``SSMShardLayout``, so a layout
    it builds (or its ``dataclasses.asdict``) is accepted as is: ``num_layers`` is the
    number of SSM layers *this rank* holds, starting at global SSM layer
    ``layer_start``. There is no pipeline rank: a stage is its layer window.
    ``dims`` may be given as a dict; it is stored as ``SSMStateDims``.
    """

    global_rank: int
    tp_size: int
    tp_rank: int
    layer_start: int
    num_layers: int
    dims: SSMStateDims

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", _coerce_dims(self.dims))
        check_positive("SSMShardLayout", self, ("tp_size", "num_layers"))
        for name, value in (("global_rank", self.global_rank), ("layer_start", self.layer_start)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise GeometryError(f"SSMShardLayout.{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.tp_rank, int) or isinstance(self.tp_rank, bool) or not 0 <= self.tp_rank < self.tp_size:
            raise GeometryError(f"SSMShardLayout.tp_rank={self.tp_rank!r} must be in [0, tp_size={self.tp_size})")
        check_head_split("SSMShardLayout", "SSM heads", self.dims.nheads, self.tp_size, allow_replication=False)
        check_head_split("SSMShardLayout", "SSM groups", self.dims.ngroups, self.tp_size, allow_replication=False)

    @classmethod
    def coerce(cls, layout: Any) -> "SSMShardLayout":
        """Ours from any layout of Megatron's shape: our own, another dataclass, or its ``asdict``."""
        if isinstance(layout, cls):
            return layout
        names = [f.name for f in fields(cls)]
        if isinstance(layout, Mapping):
            values = dict(layout)
        elif all(hasattr(layout, name) for name in names):
            values = {name: getattr(layout, name) for name in names}
        else:
            raise GeometryError(
                f"ssm_layout must be an SSMShardLayout or have its fields {names}, got {type(layout).__name__}"
            )
        unknown = set(values) - set(names)
        if unknown or set(names) - set(values):
            raise GeometryError(f"ssm_layout must have exactly the fields {names}, got {sorted(values)}")
        try:
            return cls(**values)
        except TypeError as exc:
            raise GeometryError(f"ssm_layout is invalid: {exc}") from None

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
        return self.layer_start, self.layer_start + self.num_layers

    def layer_range(self) -> tuple[int, int]:
        """Megatron's name for ``local_layer_range``."""
        return self.local_layer_range()

    def shard_key(self) -> tuple[int, int]:
        """Megatron's key of the shard this rank holds: ``(tp_rank, layer_start)``."""
        return self.tp_rank, self.layer_start

    def model_key(self) -> tuple[Any, ...]:
        """What two layouts must agree on to describe the same model's SSM state (the layer
        count is checked from the windows, since one layout only knows its own)."""
        return ("ssm", self.dims)

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
    def from_meta(cls, meta: Any) -> "SSMShardLayout":
        """Rebuild a peer's SSM layout, turning every problem into ``PeerMetadataError``."""
        if not isinstance(meta, Mapping):
            raise PeerMetadataError(f"peer meta field 'ssm_layout' must be an object, got {type(meta).__name__}")
        if not isinstance(meta.get("dims"), Mapping):
            raise PeerMetadataError(f"peer meta field 'ssm_layout.dims' must be an object, got {meta.get('dims')!r}")
        try:
            return cls.coerce(meta)
        except GeometryError as exc:
            raise PeerMetadataError(f"peer meta field 'ssm_layout' is invalid: {exc}") from None
