"""Plan who reads which KV slices when prefill and decode use different TP/PP.

Pure functions over ``KVShardLayout``s: no buffers, no I/O. Every rank on both
sides can call ``plan_kv_reshard(srcs, dsts)`` with the same arguments, get the
same list of transfers, and keep the ones naming its own global rank
(``for_dst``/``for_src``). Byte addresses come later, from
``kvxfer.plan.reshard_descriptors``.

The rules, in order:

1. Both sides describe the same model (``model_key``) and each side tiles it:
   every pipeline stage has one layer window, the windows cover ``[0, L)`` with
   no gap or overlap, and every stage has every head. Violations raise
   ``LayoutError`` before anything moves.
2. Source replicas are dropped: per (stage, head range) the lowest global rank
   is read. This covers data/expert-parallel copies of one (tp, pp) rank and,
   when ``tp_size > num_heads``, TP ranks that replicate one head.
3. Each destination (replicas included: each needs its own copy) intersects its
   layer and head ranges with every remaining source.

``tiling_problems``/``dedupe_sources``/``overlap`` are written once for any
layout with ``local_layer_range``/``local_head_range``/``model_key`` so the SSM
planner shares them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence, TypeVar

from kvxfer.errors import LayoutError
from kvxfer.plan.layout import KVShardLayout


class ShardLayout(Protocol):
    """What the generic tiling / replica logic needs from a layout.

    A pipeline stage is named by its layer window, so SSM layouts (Megatron's shape,
    no ``pp_rank``) and KV layouts are treated alike.
    """

    tp_size: int
    tp_rank: int
    global_rank: int

    def local_layer_range(self) -> tuple[int, int]: ...
    def local_head_range(self) -> tuple[int, int]: ...
    def model_key(self) -> tuple[Any, ...]: ...


L = TypeVar("L", bound=ShardLayout)

Range = tuple[int, int]


def intersect(a: Range, b: Range) -> Range | None:
    """``[max, min)`` of two half-open ranges, or None when empty."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def check_same_model(side_a: Sequence[ShardLayout], side_b: Sequence[ShardLayout]) -> None:
    """Every layout on both sides must describe one model."""
    keys = {layout.model_key() for layout in (*side_a, *side_b)}
    if len(keys) > 1:
        raise LayoutError(
            f"the layouts describe different models {sorted(map(str, keys))}; prefill and decode must "
            "serve the same model (same layer count, KV heads / SSM dims)"
        )


def dedupe_sources(layouts: Iterable[L]) -> list[L]:
    """One source per (stage window, head range): the lowest global rank."""
    chosen: dict[tuple[Range, Range], L] = {}
    for layout in layouts:
        key = (layout.local_layer_range(), layout.local_head_range())
        if key not in chosen or layout.global_rank < chosen[key].global_rank:
            chosen[key] = layout
    return sorted(chosen.values(), key=lambda x: x.global_rank)


def tiling_problems(side: str, layouts: Sequence[ShardLayout], num_heads: int,
                    num_layers: int | None = None) -> list[str]:
    """Why ``layouts`` do not tile the model's layers x heads (empty list when they do).

    Stages are the distinct layer windows; they must cover ``[0, num_layers)`` (or,
    when the layouts do not know the model's layer count, ``[0, last window end)``)
    with no gap or overlap, and each must hold every head once.
    """
    if not layouts:
        return [f"{side}: no layouts given"]
    problems = []
    sizes = {(x.tp_size, getattr(x, "pp_size", None)) for x in layouts}
    if len(sizes) > 1:
        problems.append(f"{side}: ranks disagree on (tp_size, pp_size): {sorted(sizes, key=str)}")
    ranks = [x.global_rank for x in layouts]
    if len(set(ranks)) != len(ranks):
        problems.append(f"{side}: global ranks repeat: {sorted(ranks)}")
    heads: dict[Range, set[Range]] = {}
    for x in layouts:
        heads.setdefault(x.local_layer_range(), set()).add(x.local_head_range())
    cursor = 0
    for start, end in sorted(heads):
        if start > cursor:
            problems.append(f"{side}: layers [{cursor}, {start}) are held by no pipeline stage")
        elif start < cursor:
            problems.append(f"{side}: the stage of layers [{start}, {end}) overlaps layers below {cursor} held by another stage")
        cursor = max(cursor, end)
    if num_layers is not None and cursor < num_layers:
        problems.append(f"{side}: layers [{cursor}, {num_layers}) are held by no pipeline stage")
    for window, ranges in sorted(heads.items()):
        covered = sorted(ranges)
        held = sum(b - a for a, b in covered)
        disjoint = all(covered[i][1] <= covered[i + 1][0] for i in range(len(covered) - 1))
        if not disjoint or held != num_heads:
            problems.append(f"{side}: the stage of layers {window} holds heads {covered}, not each of the {num_heads} heads once")
    return problems


def layers_held(layouts: Sequence[ShardLayout]) -> int:
    """The end of the last layer window: the model's layer count when the layouts tile it."""
    return max(x.local_layer_range()[1] for x in layouts)


def check_tiling(srcs: Sequence[ShardLayout], dsts: Sequence[ShardLayout], num_heads: int,
                 num_layers: int | None = None) -> None:
    """Raise one ``LayoutError`` listing everything wrong with either side.

    Without ``num_layers`` both sides must at least end at the same layer.
    """
    problems = (tiling_problems("prefill (source)", srcs, num_heads, num_layers)
                + tiling_problems("decode (destination)", dsts, num_heads, num_layers))
    if not problems and num_layers is None and layers_held(srcs) != layers_held(dsts):
        problems.append(f"prefill holds {layers_held(srcs)} layers, decode {layers_held(dsts)}: not the same model")
    if problems:
        raise LayoutError("cannot reshard: " + "; ".join(problems))


def check_covers(dst: ShardLayout, sources: Sequence[ShardLayout]) -> None:
    """The (deduplicated, disjoint) sources must hold every layer x head ``dst`` needs."""
    need_l, need_h = dst.local_layer_range(), dst.local_head_range()
    got = 0
    for src in sources:
        ol, oh = intersect(need_l, src.local_layer_range()), intersect(need_h, src.local_head_range())
        if ol and oh:
            got += (ol[1] - ol[0]) * (oh[1] - oh[0])
    need = (need_l[1] - need_l[0]) * (need_h[1] - need_h[0])
    if got != need:
        raise LayoutError(
            f"the given peers hold {got} of the {need} (layer, head) pairs that rank {dst.global_rank} "
            f"(layers {need_l}, heads {need_h}) needs; pull from every prefill rank that holds part of them"
        )


class LayerHeadSlices:
    """Local layer and head slices of a transfer with global bounds and per-side offsets.

    Shared by the KV and SSM transfers; the dataclass using it supplies
    ``layer_start/end``, ``head_start/end`` and the ``src_/dst_`` offsets.
    """

    layer_start: int
    layer_end: int
    head_start: int
    head_end: int
    src_layer_offset: int
    dst_layer_offset: int
    src_head_offset: int
    dst_head_offset: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start

    @property
    def src_layers(self) -> slice:
        return slice(self.src_layer_offset, self.src_layer_offset + self.num_layers)

    @property
    def dst_layers(self) -> slice:
        return slice(self.dst_layer_offset, self.dst_layer_offset + self.num_layers)

    @property
    def src_heads(self) -> slice:
        return slice(self.src_head_offset, self.src_head_offset + self.num_heads)

    @property
    def dst_heads(self) -> slice:
        return slice(self.dst_head_offset, self.dst_head_offset + self.num_heads)


@dataclass(frozen=True)
class KVReshardTransfer(LayerHeadSlices):
    """One rectangle of layers x heads that a destination rank reads from a source rank.

    Global bounds (``layer_start..layer_end``, ``head_start..head_end``) plus where
    that rectangle sits in each side's local pool: its pool is
    ``[2, L_local, B, T, H_local, d]`` and the rectangle is
    ``pool[:, src_layers, :, :, src_heads]`` (resp. ``dst_*``).
    """

    src_rank: int
    dst_rank: int
    layer_start: int
    layer_end: int
    head_start: int
    head_end: int
    src_layer_offset: int  # local index of layer_start in the source pool
    dst_layer_offset: int
    src_head_offset: int  # local index of head_start in the source pool
    dst_head_offset: int



def overlap(src: ShardLayout, dst: ShardLayout) -> tuple[Range, Range] | None:
    """Global (layers, heads) both ranks hold, or None."""
    layers = intersect(src.local_layer_range(), dst.local_layer_range())
    heads = intersect(src.local_head_range(), dst.local_head_range())
    return (layers, heads) if layers and heads else None


def kv_transfer_between(src: KVShardLayout, dst: KVShardLayout) -> KVReshardTransfer | None:
    """The one rectangle ``dst`` can read from ``src`` (no replica logic), or None."""
    both = overlap(src, dst)
    if both is None:
        return None
    (l0, l1), (h0, h1) = both
    return KVReshardTransfer(
        src_rank=src.global_rank, dst_rank=dst.global_rank,
        layer_start=l0, layer_end=l1, head_start=h0, head_end=h1,
        src_layer_offset=l0 - src.local_layer_range()[0], dst_layer_offset=l0 - dst.local_layer_range()[0],
        src_head_offset=h0 - src.local_head_range()[0], dst_head_offset=h0 - dst.local_head_range()[0],
    )


def plan_kv_reshard(srcs: Sequence[KVShardLayout], dsts: Sequence[KVShardLayout]) -> list[KVReshardTransfer]:
    """Every transfer that moves the prefill side's KV (``srcs``) into the decode side's (``dsts``).

    Validates first (same model, each side tiles it); raises ``LayoutError``.
    Ordered by destination rank, then source rank.
    """
    srcs, dsts = list(srcs), list(dsts)
    for layout in (*srcs, *dsts):
        if not isinstance(layout, KVShardLayout):
            raise LayoutError(f"plan_kv_reshard takes KVShardLayouts, got {type(layout).__name__}")
    check_same_model(srcs, dsts)
    if not srcs or not dsts:
        raise LayoutError("plan_kv_reshard needs at least one source and one destination layout")
    check_tiling(srcs, dsts, srcs[0].num_heads, srcs[0].num_layers)
    return pair_transfers(dedupe_sources(srcs), dsts, kv_transfer_between)


def pair_transfers(sources: Sequence[Any], dsts: Sequence[Any], between: Callable[[Any, Any], Any]) -> list:
    """Every non-empty ``between(src, dst)``, destinations in global-rank order (both sides agree)."""
    plan = []
    for dst in sorted(dsts, key=lambda x: x.global_rank):
        for src in sources:
            transfer = between(src, dst)
            if transfer is not None:
                plan.append(transfer)
    return plan


T = TypeVar("T")


def for_dst(plan: Iterable[T], rank: int) -> list[T]:
    """The transfers global rank ``rank`` reads (decode side)."""
    return [t for t in plan if t.dst_rank == rank]  # type: ignore[attr-defined]


def for_src(plan: Iterable[T], rank: int) -> list[T]:
    """The transfers that read global rank ``rank`` (prefill side)."""
    return [t for t in plan if t.src_rank == rank]  # type: ignore[attr-defined]
