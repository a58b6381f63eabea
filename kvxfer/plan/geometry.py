"""Address geometry of a registered paged buffer (the wire schema for it is ``kvxfer.meta.geometry``).

A paged KV pool is a contiguous tensor with one *blocks axis*. Everything before
that axis (for the canonical KV layout ``[2, L, B, T, H, d]``: K/V and layers) is
the *outer* index; everything after it is one *slice*. Block ``b`` of outer index
``o`` is the byte range ``buf_ptr + o * outer_stride_bytes + b * bytes_per_slice``
of length ``bytes_per_slice``. Every backend addresses memory through this one
description, and ``kvxfer.meta.geometry.export_geometry_meta`` is the single wire format for it.

What a caller says of its pool (the reference's arguments: block count, TP/PP topology, SSM
layout) is one ``PoolSpec``, written once here; ``pool_geometry`` turns it into the geometry.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch

from kvxfer.errors import GeometryError, PeerMetadataError
from kvxfer.plan.layout import KVShardLayout
from kvxfer.plan.ssm_layout import SSMShardLayout

#: The two kinds of per-layer SSM state a hybrid model keeps (see ``kvxfer.plan.reshard``).
SSM_STATE_KINDS = ("conv", "recurrent")

# Fixed position of the blocks axis in the canonical layouts.
KV_BLOCKS_AXIS = 2  # [2, L, B, T, H, d]
SSM_BLOCKS_AXIS = 1  # [L, B, ...state dims]

#: far beyond any real pool; keeps peer-supplied arithmetic in int64 (``kvxfer.meta`` checks against it)
MAX_BYTES = 1 << 62


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the spelling used on the wire."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise PeerMetadataError(f"peer meta field 'dtype' is not a torch dtype name: {name!r}")
    return dtype


@dataclass(frozen=True)
class BufferGeometry:
    """Address geometry of one registered paged buffer.

    Each (outer, block) pair is one contiguous slice; the outer stride skips over the
    full block pool for that outer index. ``layout`` is the canonical KV shard layout
    when the buffer is a KV cache; SSM pools carry their typed layout separately.
    """

    buf_ptr: int
    element_size: int
    device_id: int
    blocks_axis: int
    num_blocks: int
    num_outer: int
    bytes_per_slice: int
    outer_stride_bytes: int
    heads_per_partition: Optional[int] = None
    head_dim: Optional[int] = None
    tokens_per_block: Optional[int] = None
    layout: Optional[KVShardLayout] = None

    @property
    def region_bytes(self) -> int:
        """Size of the whole registered region, from ``buf_ptr``."""
        return self.num_outer * self.outer_stride_bytes


@dataclass(frozen=True, eq=False)  # eq=False: it holds the tensor, whose ``==`` is elementwise
class PoolSpec:
    """A pool as its caller describes it: the tensor, its block count and the reference's topology
    arguments, not yet checked (``pool_geometry`` checks them).

    The one place these arguments are written. The entrances Megatron and the seed call with them
    loose, ``compute_buffer_geometry`` and a backend's constructor, turn them into one of these at
    once (``takes_pool_spec`` shows them in the entrances' signatures, in this order); everything
    behind the entrances passes this object. ``layer_end`` is exclusive; ``ssm_layout`` is
    Megatron's ``SSMShardLayout``, ours, or its ``asdict``.
    """

    memory_buffer: torch.Tensor
    expected_num_blocks: int
    tp_size: Optional[int] = None
    tp_rank: Optional[int] = None
    num_kv_heads_global: Optional[int] = None
    heads_per_partition: Optional[int] = None
    head_dim: Optional[int] = None
    tokens_per_block: Optional[int] = None
    global_rank: Optional[int] = None
    pp_size: Optional[int] = None
    pp_rank: Optional[int] = None
    num_layers_global: Optional[int] = None
    layer_start: Optional[int] = None
    layer_end: Optional[int] = None
    ssm_layout: Any = None
    ssm_state_kind: Optional[str] = None

    @property
    def ssm(self) -> Optional[SSMShardLayout]:
        """``ssm_layout`` as our typed layout (None for a KV pool)."""
        return None if self.ssm_layout is None else SSMShardLayout.coerce(self.ssm_layout)


F = TypeVar("F", bound=Callable[..., Any])


def takes_pool_spec(entrance: F) -> F:
    """Give an entrance that collects the pool's arguments loosely (``*pool_args`` / ``**pool_kwargs``,
    turned into a ``PoolSpec`` at once) the signature its callers know, spelled from ``PoolSpec``.

    Fields the entrance names itself keep their place; the others stand where its ``*pool_args``
    is (positional or keyword: a backend's constructor) or else, keyword-only, where its
    ``**pool_kwargs`` is (``compute_buffer_geometry``). So ``inspect.signature`` and ``help()``
    show the reference's signature while the list is written once.
    """
    real = inspect.signature(entrance)
    P = inspect.Parameter
    # The fields go where the entrance collects them: its *pool_args if it has one, else its **pool_kwargs.
    spread_at = P.VAR_POSITIONAL if any(p.kind is P.VAR_POSITIONAL for p in real.parameters.values()) else P.VAR_KEYWORD
    as_kind = P.POSITIONAL_OR_KEYWORD if spread_at is P.VAR_POSITIONAL else P.KEYWORD_ONLY
    fields = [P(f.name, as_kind, annotation=f.type, default=P.empty if f.default is dataclasses.MISSING else f.default)
              for f in dataclasses.fields(PoolSpec) if f.name not in real.parameters]
    params: list[inspect.Parameter] = []
    for param in real.parameters.values():
        if param.kind is spread_at:
            params.extend(fields)
        elif param.kind is not P.VAR_KEYWORD:
            params.append(param)
    entrance.__signature__ = real.replace(parameters=params)  # type: ignore[attr-defined]
    return entrance


@takes_pool_spec
def compute_buffer_geometry(
    memory_buffer: torch.Tensor, expected_num_blocks: int, *, backend_name: str, **pool_kwargs: Any,
) -> BufferGeometry:
    """Locate the blocks axis, derive the slice strides, and validate the canonical
    KV layout when the full geometry is provided.

    The seed's entrance (its signature, from ``PoolSpec``: the topology arguments are
    keyword-only); ``pool_geometry`` does the work.
    """
    return pool_geometry(PoolSpec(memory_buffer, expected_num_blocks, **pool_kwargs), backend_name)


def pool_geometry(spec: PoolSpec, backend_name: str) -> BufferGeometry:
    """Locate the blocks axis, derive the slice strides, and validate the canonical
    KV layout when the full geometry is provided.

    Where the reference silently falls back to "no layout" on inconsistent topology
    arguments, this raises ``GeometryError`` naming the argument to fix.
    """
    where = f"[{backend_name}]"
    memory_buffer, expected_num_blocks = spec.memory_buffer, spec.expected_num_blocks
    ssm_state_kind = spec.ssm_state_kind
    if not isinstance(memory_buffer, torch.Tensor):
        raise GeometryError(f"{where} memory_buffer must be a torch.Tensor, got {type(memory_buffer).__name__}")
    if not isinstance(expected_num_blocks, int) or isinstance(expected_num_blocks, bool) or expected_num_blocks < 1:
        raise GeometryError(f"{where} expected_num_blocks must be a positive int, got {expected_num_blocks!r}")
    if not memory_buffer.is_contiguous():
        raise GeometryError(
            f"{where} memory_buffer (shape {tuple(memory_buffer.shape)}, strides {memory_buffer.stride()}) "
            "is not contiguous; register the contiguous pool itself, not a view of it"
        )
    shape = tuple(memory_buffer.shape)
    if (spec.ssm_layout is None) != (ssm_state_kind is None):
        raise GeometryError(f"{where} pass ssm_layout and ssm_state_kind together, or neither")

    if ssm_state_kind is not None:
        if ssm_state_kind not in SSM_STATE_KINDS:
            raise GeometryError(f"{where} ssm_state_kind must be one of {SSM_STATE_KINDS}, got {ssm_state_kind!r}")
        if len(shape) < 2 or shape[SSM_BLOCKS_AXIS] != expected_num_blocks:
            raise GeometryError(
                f"{where} an SSM state buffer has its blocks on axis {SSM_BLOCKS_AXIS}; shape {shape} "
                f"does not have {expected_num_blocks} there"
            )
        blocks_axis = SSM_BLOCKS_AXIS
        # Megatron's SSMShardLayout (or its asdict) is accepted: same fields, same meaning.
        expected = spec.ssm.state_shape(ssm_state_kind, expected_num_blocks)
        if shape != expected:
            raise GeometryError(
                f"{where} the SSM {ssm_state_kind} buffer has shape {shape} but its ssm_layout gives {expected} "
                "([L_local, B, channels_local, d_conv] for conv, [L_local, B, nheads_local, headdim, d_state] "
                "for recurrent)"
            )
    else:
        candidates = [axis for axis, size in enumerate(shape) if size == expected_num_blocks]
        if len(candidates) != 1:
            found = "no axis" if not candidates else f"axes {candidates}"
            raise GeometryError(
                f"{where} expected exactly one axis of size expected_num_blocks={expected_num_blocks} in "
                f"buffer shape {shape}, found {found}; pass the pool's real block count (or make the "
                "other dims differ from it)"
            )
        blocks_axis = candidates[0]

    element_size = memory_buffer.element_size()
    bytes_per_slice = element_size * math.prod(shape[blocks_axis + 1:])
    num_outer = math.prod(shape[:blocks_axis])
    device_id = (memory_buffer.device.index or 0) if memory_buffer.device.type == "cuda" else 0
    if bytes_per_slice == 0 or num_outer == 0:
        raise GeometryError(f"{where} buffer shape {shape} has an empty dimension")

    heads_per_partition, head_dim, tokens_per_block = spec.heads_per_partition, spec.head_dim, spec.tokens_per_block
    layout = None
    if ssm_state_kind is None:
        _check_kv_dims(where, shape, blocks_axis, spec)
        layout = _kv_layout(where, shape, blocks_axis, spec)
        if layout is not None:
            heads_per_partition = layout.heads_per_partition
            head_dim = shape[5]
            tokens_per_block = shape[3]

    return BufferGeometry(
        buf_ptr=memory_buffer.data_ptr(),
        element_size=element_size,
        device_id=device_id,
        blocks_axis=blocks_axis,
        num_blocks=expected_num_blocks,
        num_outer=num_outer,
        bytes_per_slice=bytes_per_slice,
        outer_stride_bytes=expected_num_blocks * bytes_per_slice,
        heads_per_partition=heads_per_partition,
        head_dim=head_dim,
        tokens_per_block=tokens_per_block,
        layout=layout,
    )


def _check_kv_dims(where: str, shape: tuple[int, ...], blocks_axis: int, spec: PoolSpec) -> None:
    """The per-slice dims the caller states must be the buffer's ``[T, H, d]``."""
    stated = {"tokens_per_block": spec.tokens_per_block, "heads_per_partition": spec.heads_per_partition,
              "head_dim": spec.head_dim}
    if all(v is None for v in stated.values()):
        return
    if len(shape) != 6 or blocks_axis != KV_BLOCKS_AXIS:
        raise GeometryError(
            f"{where} {', '.join(k for k, v in stated.items() if v is not None)} describe the canonical "
            f"KV layout [2, L, B, T, H, d], but the buffer has shape {shape} with blocks on axis {blocks_axis}"
        )
    actual = {"tokens_per_block": shape[3], "heads_per_partition": shape[4], "head_dim": shape[5]}
    for name, value in stated.items():
        if value is not None and value != actual[name]:
            raise GeometryError(f"{where} {name}={value} but the buffer {shape} has {actual[name]} there")


_LAYOUT_REQUIRED = ("tp_size", "tp_rank", "num_kv_heads_global", "num_layers_global")
#: The arguments that place a KV pool in the model; any one given asks for a KV shard layout.
_TOPOLOGY = ("tp_size", "tp_rank", "num_kv_heads_global", "global_rank", "pp_size", "pp_rank", "num_layers_global",
             "layer_start", "layer_end")


def _kv_layout(where: str, shape: tuple[int, ...], blocks_axis: int, spec: PoolSpec) -> Optional[KVShardLayout]:
    """Build the KV shard layout from the topology arguments, or None if none are given."""
    topo = {name: getattr(spec, name) for name in _TOPOLOGY}
    given = {k for k, v in topo.items() if v is not None}
    if not given:
        return None
    missing = [k for k in _LAYOUT_REQUIRED if topo[k] is None]
    if missing:
        raise GeometryError(
            f"{where} topology arguments {sorted(given)} were given but {missing} are missing; "
            "pass the full topology to get a KV shard layout, or none of it"
        )
    if len(shape) != 6 or blocks_axis != KV_BLOCKS_AXIS or shape[0] != 2:
        raise GeometryError(
            f"{where} a KV layout needs the canonical buffer [2, L, B, T, H, d]; got shape {shape} "
            f"with blocks on axis {blocks_axis}"
        )
    layer_start, layer_end = topo["layer_start"], topo["layer_end"]
    if (layer_start is None) != (layer_end is None):
        raise GeometryError(f"{where} pass layer_start and layer_end (exclusive) together, or neither")
    tp_size, tp_rank, pp_size = topo["tp_size"], topo["tp_rank"], topo["pp_size"] or 1
    pp_rank = topo["pp_rank"] or 0
    global_rank = topo["global_rank"] if topo["global_rank"] is not None else pp_rank * tp_size + tp_rank
    layout = KVShardLayout(
        num_layers=topo["num_layers_global"],
        num_heads=topo["num_kv_heads_global"],
        tp_size=tp_size,
        tp_rank=tp_rank,
        pp_size=pp_size,
        pp_rank=pp_rank,
        global_rank=global_rank,
        layer_start=layer_start,
        num_local_layers=None if layer_start is None else layer_end - layer_start,
    )
    hpp = spec.heads_per_partition
    if hpp is not None and hpp != layout.heads_per_partition:
        raise GeometryError(
            f"{where} heads_per_partition={hpp} x tp_size={tp_size} does not match "
            f"num_kv_heads_global={layout.num_heads} (expected {layout.heads_per_partition} per rank)"
        )
    if shape[4] != layout.heads_per_partition:
        raise GeometryError(
            f"{where} buffer holds {shape[4]} heads per rank but num_kv_heads_global={layout.num_heads} "
            f"over tp_size={tp_size} gives {layout.heads_per_partition}"
        )
    first, last = layout.local_layer_range()
    # The window is always explicit, as on the wire: a layout and its peer's parse compare equal.
    layout = dataclasses.replace(layout, layer_start=first, num_local_layers=last - first)
    if shape[1] != last - first:
        raise GeometryError(
            f"{where} buffer holds {shape[1]} layers but the layout gives this rank layers [{first}, {last}) "
            f"({last - first} layers); check num_layers_global, pp_size/pp_rank or layer_start/layer_end"
        )
    return layout


@dataclass(frozen=True)
class PeerGeometry:
    """A peer's meta after every field has been checked: its geometry, and the transport's own
    section parsed by the backend (``transport``: e.g. the NIXL agent or the UCX worker address
    and rkey), so the post reads typed fields and never parses the meta again."""

    geometry: BufferGeometry
    dtype: str
    ssm_layout: Optional[SSMShardLayout] = None
    ssm_state_kind: Optional[str] = None
    transport: Any = dataclasses.field(default=None, compare=False)


def check_peer_compatible(local: BufferGeometry, local_dtype: torch.dtype, peer: PeerGeometry) -> None:
    """Refuse a peer whose slices cannot be copied byte-for-byte into ours.

    Used for whole-slice transfers (no reshard): same dtype, element size, slice
    shape and outer count. Raises ``PeerMetadataError`` naming the mismatch.
    """
    ours = dtype_name(local_dtype)
    if peer.dtype != ours:
        raise PeerMetadataError(f"peer dtype is {peer.dtype}, ours is {ours}; both sides must use the same KV dtype")
    remote = peer.geometry
    for name in ("element_size", "head_dim", "tokens_per_block", "heads_per_partition", "bytes_per_slice", "num_outer"):
        mine, theirs = getattr(local, name), getattr(remote, name)
        if mine is not None and theirs is not None and mine != theirs:
            raise PeerMetadataError(f"peer {name} is {theirs}, ours is {mine}; the pools are not compatible")


def kv_layout_geometry(layout: KVShardLayout, *, num_blocks: int, tokens_per_block: int, head_dim: int,
                       element_size: int, buf_ptr: int = 0) -> BufferGeometry:
    """The geometry a canonical ``[2, L_local, B, T, H_local, d]`` pool of ``layout`` would have.

    Planning needs only numbers; this lets benchmarks and tools plan reshards for
    pools they never allocate.
    """
    first, last = layout.local_layer_range()
    slice_bytes = tokens_per_block * layout.heads_per_partition * head_dim * element_size
    return BufferGeometry(
        buf_ptr=buf_ptr, element_size=element_size, device_id=0, blocks_axis=KV_BLOCKS_AXIS, num_blocks=num_blocks,
        num_outer=2 * (last - first), bytes_per_slice=slice_bytes, outer_stride_bytes=num_blocks * slice_bytes,
        heads_per_partition=layout.heads_per_partition, head_dim=head_dim, tokens_per_block=tokens_per_block,
        layout=layout,
    )


def staging_geometry(num_bytes: int) -> BufferGeometry:
    """A flat byte region of ``num_bytes`` (a staging range), for bounds checks of plans into it."""
    return BufferGeometry(buf_ptr=0, element_size=1, device_id=0, blocks_axis=0, num_blocks=1, num_outer=1,
                          bytes_per_slice=num_bytes, outer_stride_bytes=num_bytes)
