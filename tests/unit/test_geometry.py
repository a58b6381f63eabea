import dataclasses
import json

import pytest
import torch

from kvxfer.errors import GeometryError, PeerMetadataError
from kvxfer.meta.version import WIRE_VERSION
from kvxfer.meta.geometry import export_geometry_meta, parse_geometry_meta
from kvxfer.plan.geometry import BufferGeometry, check_peer_compatible, compute_buffer_geometry
from kvxfer.plan.ssm_layout import SSMShardLayout, SSMStateDims
from tests.conftest import DTYPES

SEED_FIELDS = [
    "buf_ptr", "element_size", "device_id", "blocks_axis", "num_blocks", "num_outer", "bytes_per_slice",
    "outer_stride_bytes", "heads_per_partition", "head_dim", "tokens_per_block", "layout",
]


def test_buffer_geometry_has_exactly_the_seed_fields():
    assert [f.name for f in dataclasses.fields(BufferGeometry)] == SEED_FIELDS


@pytest.mark.parametrize("dtype", DTYPES)
def test_strides_match_the_tensor(dtype):
    pool = torch.zeros(2, 3, 10, 4, 2, 8, dtype=dtype)
    g = compute_buffer_geometry(pool, 10, backend_name="t")
    es = pool.element_size()
    assert (g.blocks_axis, g.num_outer, g.num_blocks) == (2, 6, 10)
    assert g.bytes_per_slice == 4 * 2 * 8 * es
    assert g.outer_stride_bytes == 10 * g.bytes_per_slice
    assert g.buf_ptr == pool.data_ptr() and g.element_size == es and g.device_id == 0
    # the geometry's address of (outer=5, block=7) is the tensor's own
    view = pool.view(6, 10, 4, 2, 8)
    assert g.buf_ptr + 5 * g.outer_stride_bytes + 7 * g.bytes_per_slice == view[5, 7].data_ptr()


def test_blocks_axis_need_not_be_canonical():
    g = compute_buffer_geometry(torch.zeros(7, 3, 5), 7, backend_name="t")
    assert (g.blocks_axis, g.num_outer, g.bytes_per_slice) == (0, 1, 15 * 4)


def test_no_axis_of_the_expected_size():
    with pytest.raises(GeometryError, match=r"exactly one axis.*\(2, 3, 4\).*found no axis"):
        compute_buffer_geometry(torch.zeros(2, 3, 4), 9, backend_name="t")


def test_ambiguous_blocks_axis():
    with pytest.raises(GeometryError, match=r"found axes \[1, 2\]"):
        compute_buffer_geometry(torch.zeros(2, 5, 5), 5, backend_name="t")


def test_non_contiguous_buffer_is_rejected():
    pool = torch.zeros(2, 4, 10, 4, 2, 8).transpose(3, 4)
    with pytest.raises(GeometryError, match="not contiguous"):
        compute_buffer_geometry(pool, 10, backend_name="t")


def _topo(**over):
    base = dict(tp_size=2, tp_rank=1, num_kv_heads_global=4, heads_per_partition=2, head_dim=8,
                tokens_per_block=4, pp_size=2, pp_rank=1, num_layers_global=6)
    base.update(over)
    return base


def test_full_topology_gives_a_layout():
    pool = torch.zeros(2, 3, 10, 4, 2, 8)
    g = compute_buffer_geometry(pool, 10, backend_name="t", **_topo())
    assert g.layout is not None
    assert g.layout.local_head_range() == (2, 4)
    assert g.layout.local_layer_range() == (3, 6)
    assert (g.heads_per_partition, g.head_dim, g.tokens_per_block) == (2, 8, 4)


def test_explicit_layer_window():
    pool = torch.zeros(2, 2, 10, 4, 2, 8)
    g = compute_buffer_geometry(pool, 10, backend_name="t", **_topo(layer_start=1, layer_end=3))
    assert g.layout.local_layer_range() == (1, 3)


@pytest.mark.parametrize("over, message", [
    (dict(heads_per_partition=1), "heads_per_partition=1"),          # 1 x 2 != 4
    (dict(num_kv_heads_global=6), "num_kv_heads_global=6"),            # 2 x 2 != 6
    (dict(num_kv_heads_global=3), "do not divide evenly"),
    (dict(num_layers_global=8), "holds 3 layers"),
    (dict(num_layers_global=None), r"\['num_layers_global'\] are missing"),
    (dict(layer_start=0), "layer_start and layer_end"),
    (dict(head_dim=16), "head_dim=16"),
    (dict(tokens_per_block=8), "tokens_per_block=8"),
])
def test_inconsistent_topology_raises_instead_of_dropping_the_layout(over, message):
    with pytest.raises(GeometryError, match=message):
        compute_buffer_geometry(torch.zeros(2, 3, 10, 4, 2, 8), 10, backend_name="t", **_topo(**over))


def test_topology_on_a_non_canonical_buffer():
    with pytest.raises(GeometryError, match="canonical"):
        compute_buffer_geometry(torch.zeros(3, 10, 4), 10, backend_name="t", head_dim=4)


def test_ssm_buffers_have_blocks_on_axis_1():
    layout = SSMShardLayout(global_rank=0, tp_size=1, tp_rank=0, layer_start=0, num_layers=4,
                            dims=SSMStateDims(nheads=1, headdim=1, d_state=4, ngroups=1, d_conv=3))  # 9 channels
    g = compute_buffer_geometry(torch.zeros(4, 9, 9, 3), 9, backend_name="t", ssm_layout=layout, ssm_state_kind="conv")
    assert (g.blocks_axis, g.num_outer, g.bytes_per_slice) == (1, 4, 9 * 3 * 4)
    with pytest.raises(GeometryError, match="together"):
        compute_buffer_geometry(torch.zeros(4, 9, 3), 9, backend_name="t", ssm_state_kind="conv")
    with pytest.raises(GeometryError, match="ssm_state_kind"):
        compute_buffer_geometry(torch.zeros(4, 9, 3), 9, backend_name="t", ssm_layout=object(), ssm_state_kind="kv")
    with pytest.raises(GeometryError, match="axis 1"):
        compute_buffer_geometry(torch.zeros(9, 4, 3), 9, backend_name="t", ssm_layout=object(), ssm_state_kind="recurrent")


@pytest.mark.parametrize("dtype", DTYPES)
def test_meta_round_trips_through_json(dtype):
    pool = torch.zeros(2, 3, 10, 4, 2, 8, dtype=dtype)
    g = compute_buffer_geometry(pool, 10, backend_name="t", **_topo())
    meta = json.loads(json.dumps(export_geometry_meta(g, dtype=dtype)))
    assert meta["schema_version"] == WIRE_VERSION
    assert meta["dtype"] == str(dtype).removeprefix("torch.")
    peer = parse_geometry_meta(meta)
    assert peer.geometry == g
    check_peer_compatible(g, dtype, peer)


def _meta():
    pool = torch.zeros(2, 3, 10, 4, 2, 8, dtype=torch.bfloat16)
    return export_geometry_meta(compute_buffer_geometry(pool, 10, backend_name="t"), dtype=torch.bfloat16)


@pytest.mark.parametrize("field, value, message", [
    ("schema_version", 99, "schema_version"),
    ("dtype", "int128", "'dtype'"),
    ("element_size", 4, "element_size"),
    ("num_blocks", -1, "'num_blocks'"),
    ("num_blocks", True, "'num_blocks'"),
    ("bytes_per_slice", "128", "'bytes_per_slice'"),
    ("outer_stride_bytes", 7, "outer_stride_bytes"),
    ("num_outer", 2**70, "'num_outer'"),
    ("num_layers_global", 3, "missing"),
    ("ssm_layout", {"bogus": 1}, "ssm_layout"),
    ("ssm_state_kind", "conv", "ssm_layout"),
])
def test_bad_peer_meta_names_the_field(field, value, message):
    meta = _meta()
    meta[field] = value
    with pytest.raises(PeerMetadataError, match=message):
        parse_geometry_meta(meta)


@pytest.mark.parametrize("field", ["schema_version", "dtype", "base_addr", "num_blocks", "element_size"])
def test_missing_field_is_named(field):
    meta = _meta()
    del meta[field]
    with pytest.raises(PeerMetadataError, match=field):
        parse_geometry_meta(meta)


def test_not_a_dict():
    with pytest.raises(PeerMetadataError, match="must be a dict"):
        parse_geometry_meta(["not", "a", "dict"])


def test_bf16_and_fp16_are_incompatible_though_both_two_bytes():
    bf = torch.zeros(2, 3, 10, 4, 2, 8, dtype=torch.bfloat16)
    fp = torch.zeros(2, 3, 10, 4, 2, 8, dtype=torch.float16)
    peer = parse_geometry_meta(export_geometry_meta(compute_buffer_geometry(bf, 10, backend_name="t"), dtype=bf.dtype))
    with pytest.raises(PeerMetadataError, match="dtype is bfloat16, ours is float16"):
        check_peer_compatible(compute_buffer_geometry(fp, 10, backend_name="t"), fp.dtype, peer)


@pytest.mark.parametrize("shape, stated, message", [
    ((2, 3, 10, 4, 2, 16), dict(head_dim=16), "head_dim"),
    ((2, 3, 10, 8, 2, 8), dict(tokens_per_block=8), "tokens_per_block"),
])
def test_peer_with_other_slice_shape_is_refused(shape, stated, message):
    ours = compute_buffer_geometry(torch.zeros(2, 3, 10, 4, 2, 8), 10, backend_name="t", head_dim=8, tokens_per_block=4)
    theirs = compute_buffer_geometry(torch.zeros(shape), 10, backend_name="t", **stated)
    peer = parse_geometry_meta(export_geometry_meta(theirs, dtype=torch.float32))
    with pytest.raises(PeerMetadataError, match=message):
        check_peer_compatible(ours, torch.float32, peer)


@pytest.mark.gpu
def test_cuda_device_id_is_the_device_index():
    device = torch.cuda.device_count() - 1
    pool = torch.zeros(2, 3, 10, 4, 2, 8, device=f"cuda:{device}")
    assert compute_buffer_geometry(pool, 10, backend_name="t").device_id == device
