"""The geometry wire schema: every backend's ``export_meta()`` starts with it.

``export_geometry_meta`` writes a registered pool's ``BufferGeometry`` (with its KV or SSM
shard layout and dtype) as the seed's fields plus kvxfer's (``schema_version``, ``dtype``,
``ssm_state_kind``); ``parse_geometry_meta`` turns a peer's dict back into a checked
``PeerGeometry``, refusing the first bad or missing field by name. Parsed once per meta:
planning takes the typed result, never the dict.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from kvxfer.errors import GeometryError, PeerMetadataError
from kvxfer.meta.version import WIRE_VERSION, check_wire_version
from kvxfer.plan.geometry import MAX_BYTES, SSM_STATE_KINDS, BufferGeometry, PeerGeometry, dtype_from_name, dtype_name
from kvxfer.plan.layout import KVShardLayout
from kvxfer.plan.ssm_layout import SSMShardLayout


#: The flat KV topology fields of the wire schema (Megatron's names), present when the pool has a layout.
LAYOUT_FIELDS = ("global_rank", "tp_size", "tp_rank", "pp_size", "pp_rank",
                 "num_layers_global", "num_kv_heads_global", "layer_start", "layer_end")


def export_geometry_meta(
    geometry: BufferGeometry,
    ssm_layout: Any = None,
    *,
    dtype: torch.dtype | str | None = None,
    ssm_state_kind: Optional[str] = None,
) -> dict[str, Any]:
    """The wire schema shared by every backend's ``export_meta``.

    The seed's fields first (``base_addr``, strides, slice dims and, with a KV layout,
    the flat topology fields ``LAYOUT_FIELDS``; ``ssm_layout`` as ``asdict``), then
    kvxfer's beside them: ``schema_version``, ``dtype`` (bf16 and fp16 are both two
    bytes: a peer of the other type must be refused, not read as garbage) and
    ``ssm_state_kind``. Called as ``export_geometry_meta(geometry)`` it is the seed's
    function; backends always pass ``dtype``, which peers require.
    """
    meta: dict[str, Any] = {
        "base_addr": geometry.buf_ptr,
        "outer_stride_bytes": geometry.outer_stride_bytes,
        "device_id": geometry.device_id,
        "num_outer": geometry.num_outer,
        "bytes_per_slice": geometry.bytes_per_slice,
        "blocks_axis": geometry.blocks_axis,
        "num_blocks": geometry.num_blocks,
        "heads_per_partition": geometry.heads_per_partition,
        "head_dim": geometry.head_dim,
        "tokens_per_block": geometry.tokens_per_block,
        "element_size": geometry.element_size,
    }
    layout = geometry.layout
    if layout is not None:
        first, last = layout.local_layer_range()
        meta.update(global_rank=layout.global_rank, tp_size=layout.tp_size, tp_rank=layout.tp_rank,
                    pp_size=layout.pp_size, pp_rank=layout.pp_rank, num_layers_global=layout.num_layers,
                    num_kv_heads_global=layout.num_heads, layer_start=first, layer_end=last)
    if ssm_layout is not None:
        meta["ssm_layout"] = SSMShardLayout.coerce(ssm_layout).to_meta()
    meta["schema_version"] = WIRE_VERSION
    if dtype is not None:
        meta["dtype"] = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype_name(dtype_from_name(dtype))
    if ssm_state_kind is not None:
        meta["ssm_state_kind"] = ssm_state_kind
    return meta


_INT_FIELDS = {  # field -> smallest allowed value
    "base_addr": 0, "element_size": 1, "device_id": 0, "blocks_axis": 0, "num_blocks": 1,
    "num_outer": 1, "bytes_per_slice": 1, "outer_stride_bytes": 1,
}
_OPTIONAL_INT_FIELDS = ("heads_per_partition", "head_dim", "tokens_per_block")


def _field(meta: Mapping[str, Any], name: str) -> Any:
    if name not in meta:
        raise PeerMetadataError(f"peer meta is missing field {name!r}")
    return meta[name]


def _int_field(meta: Mapping[str, Any], name: str, minimum: int, optional: bool = False) -> Optional[int]:
    value = _field(meta, name)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value < MAX_BYTES:
        raise PeerMetadataError(
            f"peer meta field {name!r} must be an int in [{minimum}, 2**62), got {value!r}"
        )
    return value


def kv_layout_from_meta(meta: Mapping[str, Any]) -> Optional[KVShardLayout]:
    """The KV layout named by a meta's flat topology fields, or None when it has none.

    All of ``LAYOUT_FIELDS`` or none (a partial set is an error), like Megatron's
    check; ``heads_per_partition`` and ``num_outer`` must agree with the layout.
    """
    present = [name for name in LAYOUT_FIELDS if meta.get(name) is not None]
    if not present:
        return None
    missing = [name for name in LAYOUT_FIELDS if name not in present]
    if missing:
        raise PeerMetadataError(f"peer meta has KV layout fields {present} but is missing {missing}")
    values = {name: meta[name] for name in LAYOUT_FIELDS}
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_BYTES:
            raise PeerMetadataError(f"peer meta field {name!r} must be a non-negative int, got {value!r}")
    try:
        layout = KVShardLayout(
            num_layers=values["num_layers_global"], num_heads=values["num_kv_heads_global"],
            tp_size=values["tp_size"], tp_rank=values["tp_rank"], pp_size=values["pp_size"],
            pp_rank=values["pp_rank"], global_rank=values["global_rank"], layer_start=values["layer_start"],
            num_local_layers=values["layer_end"] - values["layer_start"],
        )
    except GeometryError as exc:
        raise PeerMetadataError(f"peer meta KV layout fields are invalid: {exc}") from None
    if meta.get("heads_per_partition") != layout.local_num_heads() or meta.get("num_outer") != 2 * layout.local_num_layers():
        raise PeerMetadataError(
            f"peer meta fields 'heads_per_partition'={meta.get('heads_per_partition')!r} and "
            f"'num_outer'={meta.get('num_outer')!r} do not match its KV layout "
            f"({layout.local_num_heads()} heads, {layout.local_num_layers()} layers x K/V)"
        )
    return layout


def parse_geometry_meta(meta: Any) -> PeerGeometry:
    """Turn a peer's ``export_meta()`` dict back into a checked ``PeerGeometry``.

    Raises ``PeerMetadataError`` naming the first bad or missing field. Extra keys
    (a transport's own fields) are ignored here; the backend reads them itself.
    """
    if not isinstance(meta, Mapping):
        raise PeerMetadataError(f"peer meta must be a dict, got {type(meta).__name__}")
    check_wire_version(_field(meta, "schema_version"), "meta field 'schema_version'")
    dtype = _field(meta, "dtype")
    torch_dtype = dtype_from_name(dtype)
    ints = {name: _int_field(meta, name, low) for name, low in _INT_FIELDS.items()}
    for name in _OPTIONAL_INT_FIELDS:
        ints[name] = _int_field(meta, name, 1, optional=True)
    element_size = torch.empty((), dtype=torch_dtype).element_size()
    if ints["element_size"] != element_size:
        raise PeerMetadataError(
            f"peer meta field 'element_size' is {ints['element_size']} but dtype {dtype} has {element_size}"
        )
    if ints["bytes_per_slice"] % element_size:
        raise PeerMetadataError("peer meta field 'bytes_per_slice' is not a multiple of 'element_size'")
    if ints["outer_stride_bytes"] != ints["num_blocks"] * ints["bytes_per_slice"]:
        raise PeerMetadataError("peer meta field 'outer_stride_bytes' is not num_blocks * bytes_per_slice")
    if ints["num_outer"] * ints["outer_stride_bytes"] + ints["base_addr"] >= MAX_BYTES:
        raise PeerMetadataError("peer meta fields 'num_outer' x 'outer_stride_bytes' describe an impossible region")
    layout = kv_layout_from_meta(meta)
    ints["buf_ptr"] = ints.pop("base_addr")
    ssm_layout = meta.get("ssm_layout")
    ssm_state_kind = meta.get("ssm_state_kind")
    if ssm_layout is not None:
        ssm_layout = SSMShardLayout.from_meta(ssm_layout)
    if (ssm_layout is None) != (ssm_state_kind is None) or ssm_state_kind not in (None, *SSM_STATE_KINDS):
        raise PeerMetadataError(
            f"peer meta fields 'ssm_layout'/'ssm_state_kind' must both be set (kind in {SSM_STATE_KINDS}) or both null"
        )
    return PeerGeometry(
        geometry=BufferGeometry(layout=layout, **ints),
        dtype=dtype_name(torch_dtype),
        ssm_layout=ssm_layout,
        ssm_state_kind=ssm_state_kind,
    )
