"""vLLM's per-layer KV tensors -> the fewest contiguous buffers kvxfer can register.

``register_kv_caches`` receives one tensor per attention layer. In vLLM 0.32 every platform
hands 4-D views ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` of one allocation
(``create_kv_cache_views``), strided by the resolved ``KVCacheLayout``: ``LBHNC`` (HND, the
CPU backend's only layout; the views are contiguous) or ``LBNHC`` (NHD, which GPU backends
may pick; the views are dense but not contiguous: heads and tokens are swapped in memory).
Older flash attention used ``[2, num_blocks, block_size, heads, head_size]`` per layer, and
allocations may be per layer. Nothing here assumes one of these: a tensor must be *dense*
(some order of its axes is contiguous), its blocks axis is the one axis of size
``num_blocks`` (after vLLM's logical-to-kernel block split), the axes after it in memory are
one block's slice, those before it the outer index. Layers that tile one storage evenly
become *one* view ``[num_layers * outer, num_blocks, slice]``, hence one registration and one
descriptor run per block range for all layers; layers that do not are grouped by storage,
one registration each. Block-outermost layouts (``BLHNC``: a block holds every layer's page)
are not dense per layer and are refused.

On ``LBHNC`` a block's heads are consecutive slabs of ``block_size * 2 * head_size`` elements,
so each region is registered as *one slab per head*, ``[layers, num_blocks * heads, slab]``:
backend id ``b * heads + h`` is head ``h`` of vLLM block ``b``. A whole block is then the run of
ids ``b*H .. b*H+H-1``, which the backend's planner coalesces into the same descriptors as one
block (so equal TP moves exactly what it moved before), and a head range ``h0..h1`` of a block is
ids ``b*H+h0 .. b*H+h1-1``: different TP (``tp_reads``) reads its heads with the existing
whole-"block" reads, on both sides' own head counts. Other layouts keep one slab per block.

Whole blocks are read with equal block sizes and TP, so the layout inside a block (NHD, HND, K and V
interleaved, a kernel's packing) does not matter as long as both sides have the same one (a smaller
prefill block or NHD across TP is read as parts: ``block_parts``); ``layout_signature`` is what the
handshake compares, the memory order of the axes (``layout``) included. The number of blocks is not part of it: vLLM sizes each instance's
pool by profiling its memory, so a prefill's and a decode's pools differ in length, and a
block id is checked against the pool it names instead (the producer's ``num_blocks`` in the
handshake, the backend's plan).

Hybrid attention+Mamba models (vLLM's hybrid KV cache manager, ``hma_pages_region``): vLLM puts
every group's layers in *one* int8 allocation (``allocate_kv_cache``), each group's layer slot ``l``
at bytes ``[l * num_blocks * page, (l+1) * num_blocks * page)`` with one common (padded) page size,
the groups aliasing the same bytes (a block id belongs to one group at a time). The Mamba view is a
raw ``int8 [num_blocks, 1, 1, state bytes]`` with a padded block stride, not dense, so the per-layer
path above cannot take it. Instead the allocation itself is registered as pages,
``uint8 [slots, num_blocks, page]``: reading block ``b`` reads page ``b`` of every slot, which for
an attention block is its layers' KV and for a Mamba slot its conv and SSM state (and padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from kvxfer.errors import GeometryError


HMA_PAGES = "HMA-pages"


@dataclass(frozen=True)
class KVRegion:
    """One contiguous buffer covering ``layers`` (in order), viewed as ``[outer, blocks * head_slabs, slab]``
    (register it with ``expected_num_blocks = num_blocks * head_slabs``)."""

    layers: tuple[str, ...]
    view: torch.Tensor
    layer_shape: tuple[int, ...]
    blocks_axis: int
    memory_order: tuple[int, ...] = ()
    head_slabs: int = 1  # registered slabs per vLLM block: its heads on LBHNC, else 1
    pages: bool = False  # a hybrid model's whole allocation as pages (``hma_pages_region``)

    @property
    def layout(self) -> str:
        """vLLM's name for a 0.32 view's layout (``LBHNC``/``LBNHC``), ``HMA-pages`` for a hybrid model's
        allocation, else the axes in memory order."""
        if self.pages:
            return HMA_PAGES
        if len(self.layer_shape) == 4 and self.blocks_axis == 0 and self.memory_order in ((0, 1, 2, 3), (0, 2, 1, 3)):
            return "LBHNC" if self.memory_order == (0, 1, 2, 3) else "LBNHC"
        return "order" + "".join(map(str, self.memory_order))

    @property
    def signature(self) -> dict:
        """What a peer's region must share for a block to mean the same bytes: everything but the pool's length."""
        per_block = [None if i == self.blocks_axis else size for i, size in enumerate(self.layer_shape)]
        return {"layers": len(self.layers), "layer_shape": per_block, "blocks_axis": self.blocks_axis,
                "layout": self.layout, "dtype": str(self.view.dtype).removeprefix("torch.")}


def _blocks_axis(name: str, tensor: torch.Tensor, num_blocks: int) -> int:
    axes = [i for i, size in enumerate(tensor.shape) if size == num_blocks]
    if len(axes) != 1:
        raise GeometryError(
            f"KV cache tensor {name!r} of shape {tuple(tensor.shape)} has {len(axes)} axes of size "
            f"num_blocks={num_blocks}; KvxferConnector needs exactly one (set num_gpu_blocks_override "
            "to a value no other dimension has)"
        )
    return axes[0]


def kv_regions(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> list[KVRegion]:
    """Group vLLM's layer tensors into registrable regions (see the module docstring)."""
    if not kv_caches:
        raise GeometryError("vLLM handed the connector no KV cache tensors")
    by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
    shapes = set()
    for name, tensor in kv_caches.items():
        order = memory_order(name, tensor)
        shapes.add((tuple(tensor.shape), tuple(tensor.stride()), order, tensor.dtype))
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append((name, tensor))
    if len(shapes) != 1:
        raise GeometryError(f"KV cache layers have different shapes/dtypes {sorted(map(str, shapes))}; "
                            "KvxferConnector supports one uniform attention group")
    (shape, _, order, dtype), = shapes
    regions = []
    for members in by_storage.values():
        members.sort(key=lambda item: item[1].data_ptr())
        regions.extend(_tile(members, shape, order, num_blocks))
    regions.sort(key=lambda r: r.layers[0])
    return regions


def memory_order(name: str, tensor: torch.Tensor) -> tuple[int, ...]:
    """The tensor's axes from the largest stride to the smallest, if they tile its bytes densely
    (contiguous, or a permutation of contiguous as vLLM's NHD views are); else ``GeometryError``."""
    order = tuple(sorted(range(tensor.dim()), key=lambda i: (-tensor.stride(i), i)))
    expected = 1
    for axis in reversed(order):
        if tensor.shape[axis] != 1 and tensor.stride(axis) != expected:
            raise GeometryError(
                f"KV cache tensor {name!r} (shape {tuple(tensor.shape)}, strides {tensor.stride()}) is not dense: "
                "no order of its axes is contiguous (a block-outermost layout such as BLHNC interleaves layers "
                "inside a block); KvxferConnector needs each layer's blocks as dense slices (LBHNC or LBNHC)"
            )
        expected *= tensor.shape[axis]
    return order


def slabs_per_block(layout: str, layer_shape: Sequence[Optional[int]]) -> int:
    """How many registered slabs one vLLM block is: its heads on ``LBHNC`` (heads outermost inside a
    block, each head's tokens contiguous), else 1. The one rule both sides apply, to their own
    regions and to a peer's signature."""
    return int(layer_shape[1]) if layout == "LBHNC" and layer_shape[1] else 1


def _slab_dims(slab: int, blocks: int) -> tuple[int, ...]:
    """A slab's elements as one axis, or two when that one would be as long as the blocks axis: the
    registration finds its blocks axis by its length, so no other axis may have it (a tiny Llama's
    1,024 blocks x 4 heads = 4,096 slabs of 32 x 2 x 64 = 4,096 elements did)."""
    if slab != blocks:
        return (slab,)
    for factor in range(2, slab):
        if slab % factor == 0 and factor != blocks and slab // factor != blocks:
            return (slab // factor, factor)
    return (slab,)  # prime: the registration refuses it, naming the sizes


def _tile(members: Sequence[tuple[str, torch.Tensor]], shape: tuple[int, ...], order: tuple[int, ...],
          num_blocks: int) -> list[KVRegion]:
    """One region for layers evenly spaced back to back in one storage; else one per layer."""
    first_name, first = members[0]
    axis = _blocks_axis(first_name, first, num_blocks)
    layer_bytes = first.numel() * first.element_size()
    back_to_back = all(t.data_ptr() - first.data_ptr() == i * layer_bytes for i, (_, t) in enumerate(members))
    position = order.index(axis)
    outer = math.prod(shape[i] for i in order[:position])
    slice_elems = math.prod(shape[i] for i in order[position + 1:])
    groups = [members] if back_to_back else [[m] for m in members]
    probe = KVRegion((), first, shape, axis, order)
    slabs = slabs_per_block(probe.layout, [None if i == axis else n for i, n in enumerate(shape)])
    out = []
    for group in groups:
        base = group[0][1]
        view = torch.empty(0, dtype=base.dtype, device=base.device)
        view.set_(base.untyped_storage(), base.storage_offset(),
                  (len(group) * outer, num_blocks * slabs, *_slab_dims(slice_elems // slabs, num_blocks * slabs)))
        out.append(KVRegion(tuple(name for name, _ in group), view, shape, axis, order, slabs))
    return out


@dataclass(frozen=True)
class TensorPlacement:
    """One of vLLM's ``KVCacheTensor``: layer ``layers[l]``'s page of block ``b`` is at byte
    ``offset + l * layer_stride + b * block_stride`` of the backing allocation of ``size`` bytes."""

    layers: tuple[str, ...]
    size: int
    offset: int
    layer_stride: int
    block_stride: int


def hma_pages_region(kv_caches: Mapping[str, torch.Tensor], placements: Sequence[TensorPlacement],
                     num_blocks: int) -> KVRegion:
    """A hybrid model's one allocation as ``uint8 [slots, num_blocks, page]`` (module docstring), after
    checking that vLLM placed every layer layer-outermost on one page size; else ``GeometryError``."""
    if not kv_caches or not placements:
        raise GeometryError("vLLM handed the connector no KV cache tensors")
    storages = {t.untyped_storage().data_ptr() for t in kv_caches.values()}
    if len(storages) != 1:
        raise GeometryError(f"the hybrid model's KV cache layers live in {len(storages)} allocations; "
                            "KvxferConnector moves a hybrid model's groups from vLLM's one shared allocation")
    pages = {p.block_stride for p in placements}
    sizes = {p.size for p in placements}
    if len(pages) != 1 or len(sizes) != 1:
        raise GeometryError(f"the hybrid model's KV cache tensors have block strides {sorted(pages)} and backing "
                            f"sizes {sorted(sizes)}; KvxferConnector needs one page size and one allocation")
    page, size = pages.pop(), sizes.pop()
    slot_bytes = num_blocks * page
    for p in placements:
        if (len(p.layers) > 1 and p.layer_stride != slot_bytes) or p.offset % slot_bytes:
            raise GeometryError(
                f"KV cache tensor of layers {list(p.layers)} is not layer-outermost (layer stride {p.layer_stride}, "
                f"offset {p.offset}; a layer slot is {num_blocks} blocks x {page} bytes = {slot_bytes}): a "
                "block-outermost layout (BLHNC) interleaves layers inside a block; KvxferConnector needs "
                "vLLM's layer-outermost layout (LBHNC or LBNHC)")
    slots = size // slot_bytes
    beyond = [list(p.layers) for p in placements if p.offset + len(p.layers) * slot_bytes > slots * slot_bytes]
    if beyond:
        raise GeometryError(f"KV cache layers {beyond} lie beyond the {slots} whole layer slots of the allocation")
    storage = next(iter(kv_caches.values())).untyped_storage()
    if slots < 1 or storage.nbytes() < slots * slot_bytes:
        raise GeometryError(f"the KV allocation has {storage.nbytes()} bytes, fewer than {max(slots, 1)} layer "
                            f"slots of {num_blocks} blocks x {page} bytes")
    view = torch.empty(0, dtype=torch.uint8, device=next(iter(kv_caches.values())).device)
    view.set_(storage, 0, (slots, num_blocks, *_slab_dims(page, num_blocks)))
    layers = tuple(name for p in placements for name in p.layers)
    return KVRegion(layers, view, (slots, num_blocks, page), 1, (0, 1, 2), 1, pages=True)


def page_layout(view: torch.Tensor, num_blocks: int) -> dict:
    """A hybrid model's attention view ``[blocks, heads, tokens, entry]`` (padded pages, so not dense),
    as facts: ``kv_layout`` ``LBHNC`` when a block's heads are outermost (a head's tokens contiguous),
    else ``LBNHC``; ``kv_page`` its ``[heads, tokens, entry bytes]``; ``kv_split`` how many kernel
    blocks vLLM cut each block into (its blocks axis is ``num_blocks * kv_split`` long)."""
    if view.dim() != 4:
        return {"kv_layout": f"{view.dim()}-D"}
    heads_outer = view.shape[1] == 1 or view.stride(1) >= view.stride(2) * view.shape[2]
    return {"kv_layout": "LBHNC" if heads_outer else "LBNHC",
            "kv_page": [int(view.shape[1]), int(view.shape[2]), int(view.shape[3]) * view.element_size()],
            "kv_split": int(view.shape[0]) // max(1, num_blocks)}


def layout_signature(regions: Sequence[KVRegion], block_size: int) -> dict:
    """What both sides must agree on for whole-block reads to be byte-exact (``layer_shape``
    has ``None`` on the blocks axis), and this side's ``num_blocks``, which they need not."""
    return {"block_size": block_size, "regions": [r.signature for r in regions],
            "num_blocks": regions[0].view.shape[1] // regions[0].head_slabs if regions else 0}
