"""Which part of the model's KV cache one rank holds.

A ``KVShardLayout`` says, in global coordinates, which layers (pipeline stage) and
which KV heads (tensor-parallel rank) live in a rank's paged pool. It is pure data:
the reshard planner compares two sets of layouts to decide who reads what.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from kvxfer.errors import GeometryError, LayoutError, PeerMetadataError


def check_positive(what: str, obj: Any, names: tuple[str, ...]) -> None:
    """Each named field of ``obj`` is a positive int (bool excluded)."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise GeometryError(f"{what}.{name} must be a positive int, got {value!r}")


def check_ranks(what: str, obj: Any) -> None:
    """The parallel sizes are positive, each rank lies in its size, and ``global_rank`` >= 0."""
    check_positive(what, obj, ("tp_size", "pp_size", "ep_size"))
    for name, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size"), ("ep_rank", "ep_size")):
        value, limit = getattr(obj, name), getattr(obj, size)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
            raise GeometryError(f"{what}.{name}={value!r} must be in [0, {size}={limit})")
    rank = obj.global_rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise GeometryError(f"{what}.global_rank must be >= 0, got {rank!r}")


@dataclass(frozen=True)
class KVShardLayout:
    """The global slice of ``[2, L, B, T, H, d]`` that one rank's pool holds.

    ``layer_start``/``num_local_layers`` give an explicit pipeline window (both or
    neither); without them the layers are split evenly across ``pp_size`` stages.
    When ``tp_size`` exceeds ``num_heads`` each head is replicated on
    ``tp_size // num_heads`` consecutive ranks. ``ep_size``/``ep_rank`` and
    ``etp_size``/``etp_rank`` (expert parallelism) do not change which KV a rank
    holds; they are kept so that a layout has Megatron's fields, in its order.
    ``layer_range``, ``head_range``, ``local_num_layers``, ``local_num_heads`` and
    ``kv_shard_key`` are Megatron's names (``docs/megatron.md``).
    """

    num_layers: int
    num_heads: int
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    global_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    etp_size: int = 1
    etp_rank: int = 0
    layer_start: Optional[int] = None
    num_local_layers: Optional[int] = None

    def __post_init__(self) -> None:
        check_positive("KVShardLayout", self, ("num_layers", "num_heads", "etp_size"))
        if not isinstance(self.etp_rank, int) or isinstance(self.etp_rank, bool) or not 0 <= self.etp_rank < self.etp_size:
            raise GeometryError(f"KVShardLayout.etp_rank={self.etp_rank!r} must be in [0, etp_size={self.etp_size})")
        check_ranks("KVShardLayout", self)
        check_layer_window("KVShardLayout", self.num_layers, self.pp_size, self.layer_start, self.num_local_layers)
        check_head_split("KVShardLayout", "KV heads", self.num_heads, self.tp_size, allow_replication=True)

    @property
    def heads_per_partition(self) -> int:
        return max(1, self.num_heads // self.tp_size)

    def local_head_range(self) -> tuple[int, int]:
        """Global ``[start, end)`` of the KV heads this rank holds."""
        if self.tp_size <= self.num_heads:
            start = self.tp_rank * self.heads_per_partition
        else:
            start = self.tp_rank // (self.tp_size // self.num_heads)
        return start, start + self.heads_per_partition

    def local_layer_range(self) -> tuple[int, int]:
        """Global ``[start, end)`` of the layers this rank holds."""
        return layer_window(self.num_layers, self.pp_size, self.pp_rank, self.layer_start, self.num_local_layers)

    # --- Megatron's names ----------------------------------------------------------------
    def layer_range(self) -> tuple[int, int]:
        return self.local_layer_range()

    def head_range(self) -> tuple[int, int]:
        return self.local_head_range()

    def local_num_layers(self) -> int:
        first, last = self.local_layer_range()
        return last - first

    def local_num_heads(self) -> int:
        return self.heads_per_partition

    def kv_shard_key(self) -> tuple[int, int]:
        """The shard a rank holds, as Megatron keys it: ``(tp_rank, pp_rank)``."""
        return self.tp_rank, self.pp_rank

    @property
    def head_replicas(self) -> int:
        """How many TP ranks hold each head (1 unless ``tp_size > num_heads``)."""
        return max(1, self.tp_size // self.num_heads)

    def model_key(self) -> tuple[Any, ...]:
        """What two layouts must agree on to describe the same model's KV cache."""
        return ("kv", self.num_layers, self.num_heads)

    def to_meta(self) -> dict[str, Any]:
        """JSON-serialisable form; ``from_meta`` is its inverse."""
        return asdict(self)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "KVShardLayout":
        """Rebuild a peer's layout, turning every problem into ``PeerMetadataError``."""
        if not isinstance(meta, Mapping):
            raise PeerMetadataError(f"peer meta field 'layout' must be an object, got {type(meta).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = set(meta) - known
        if unknown:
            raise PeerMetadataError(f"peer meta field 'layout' has unknown keys {sorted(unknown)}")
        try:
            return cls(**dict(meta))
        except (GeometryError, TypeError) as exc:
            raise PeerMetadataError(f"peer meta field 'layout' is invalid: {exc}") from None


def layer_window(num_layers: int, pp_size: int, pp_rank: int,
                 layer_start: Optional[int], num_local_layers: Optional[int]) -> tuple[int, int]:
    """Global ``[start, end)`` layers of a pipeline stage: the explicit window, else an even split."""
    if layer_start is not None and num_local_layers is not None:
        return layer_start, layer_start + num_local_layers
    per_stage = num_layers // pp_size
    return pp_rank * per_stage, (pp_rank + 1) * per_stage


def check_layer_window(what: str, num_layers: int, pp_size: int,
                       layer_start: Optional[int], num_local_layers: Optional[int]) -> None:
    """An explicit window must lie inside the model; without one the split must be even."""
    if (layer_start is None) != (num_local_layers is None):
        raise GeometryError(
            f"{what}: give layer_start and num_local_layers together, or neither "
            f"(got layer_start={layer_start!r}, num_local_layers={num_local_layers!r})"
        )
    if layer_start is None:
        if num_layers % pp_size:
            raise LayoutError(
                f"{what}: {num_layers} layers do not split evenly over pp_size={pp_size}; "
                "pass an explicit layer window (layer_start, layer_end)"
            )
        return
    for name, value in (("layer_start", layer_start), ("num_local_layers", num_local_layers)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise GeometryError(f"{what}.{name} must be an int, got {value!r}")
    if not (0 <= layer_start and num_local_layers >= 1 and layer_start + num_local_layers <= num_layers):
        raise LayoutError(
            f"{what}: layer window [{layer_start}, {layer_start + num_local_layers}) "
            f"is not inside the model's {num_layers} layers"
        )


def check_head_split(what: str, noun: str, num_heads: int, tp_size: int, *, allow_replication: bool) -> None:
    """Heads split evenly over TP ranks, or (KV only) TP ranks evenly replicate heads."""
    if tp_size <= num_heads:
        if num_heads % tp_size:
            raise LayoutError(f"{what}: {num_heads} {noun} do not divide evenly over tp_size={tp_size}")
    elif not allow_replication:
        raise LayoutError(f"{what}: tp_size={tp_size} exceeds the {num_heads} {noun}; they cannot be split")
    elif tp_size % num_heads:
        raise LayoutError(
            f"{what}: tp_size={tp_size} exceeds num_heads={num_heads} but is not a multiple "
            "of it, so heads cannot be replicated evenly"
        )
