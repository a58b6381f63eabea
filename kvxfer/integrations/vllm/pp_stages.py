"""A prefill of pipeline parallel size ``P`` > 1 read into a decode of PP 1: each decode layer from the stage
that holds it.

vLLM's pipeline stage ``p`` holds a contiguous window of layers (``get_pp_indices``), registered as its own
regions (``kv_buffers.kv_regions``: its layers' views, usually one region for all of them). The handshake lists
every stage's window (``EngineLayout.stages``: ``(first layer, layers, regions)`` per stage, the regions of all
stages concatenated in stage order) and one rank entry per ``(stage, TP rank)``, stage-major: rank entry
``p * tp_size + t`` is TP rank ``t`` of stage ``p``, with one meta per region of *its* stage. The decode, at the
same TP, reads stage ``p``'s regions from rank entry ``p * tp + t`` into the rows of its own region that hold
the same layers (``StageWindows``: that window of its region, registered once per handshake shape), and tells
each stage's rank "done" on that stage's lease, so each stage frees its own blocks after its own reads.

What is refused (``stage_problem``, before anything is read), naming both layouts: a decode of PP > 1, PP with
different TP, hybrid models across stages (each stage holds its own layers' state), stages whose windows do not
give the model's layers exactly once in order, a stage region of another per-layer shape than the decode's,
and a stage region that straddles two decode regions. Pure but for ``StageWindows`` (which registers memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from kvxfer.errors import PeerMetadataError

#: The most layers one stage window may claim, and the most regions (the model's own bounds: ``handshake``).
_MAX_LAYERS = 1 << 14


@dataclass(frozen=True)
class Stage:
    """Stage ``index`` holds layers ``[first, first + layers)`` in ``regions`` regions."""

    index: int
    first: int
    layers: int
    regions: int


def parse_stages(value: Any, pp_size: int, num_regions: int) -> tuple[Stage, ...]:
    """A peer's ``stages`` field, checked: ``pp_size`` entries of three bounded ints, windows that follow one
    another from layer 0, region counts that add up to the layout's regions. ``()`` when absent."""
    if value is None:  # a layout without stages (any PP): compared as a whole, PP included (``first_difference``)
        return ()
    if not isinstance(value, list) or len(value) != pp_size:
        raise PeerMetadataError(f"handshake layout field 'stages' must list {pp_size} stages")
    stages, at, regions = [], 0, 0
    for index, entry in enumerate(value):
        if not (isinstance(entry, list) and len(entry) == 3 and all(
                isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= _MAX_LAYERS for n in entry)):
            raise PeerMetadataError(f"handshake layout stage {index} must be [first layer, layers, regions], ints "
                                    f"in [0, {_MAX_LAYERS}]")
        first, layers, count = entry
        if first != at or layers < 1 or count < 1 or count > layers:
            raise PeerMetadataError(f"handshake layout stage {index} holds layers [{first}, {first + layers}) in "
                                    f"{count} regions: stages must follow one another from layer 0 ({at} expected), "
                                    "each with at least one layer and at most one region per layer")
        stages.append(Stage(index, first, layers, count))
        at, regions = first + layers, regions + count
    if regions != num_regions:
        raise PeerMetadataError(f"handshake layout stages hold {regions} regions, its regions list {num_regions}")
    return tuple(stages)


def stage_region_slice(stages: Sequence[Stage], index: int) -> slice:
    """Which of the layout's regions are stage ``index``'s."""
    start = sum(s.regions for s in stages[:index])
    return slice(start, start + stages[index].regions)


def describe_stages(stages: Sequence[Stage]) -> str:
    return ", ".join(f"stage {s.index} layers [{s.first}, {s.first + s.layers})" for s in stages)


def _region_layers(regions: Sequence[Mapping[str, Any]], first: int = 0) -> list[tuple[int, int]]:
    """``[start, end)`` layers of each region, in order, the first starting at ``first``."""
    out = []
    for region in regions:
        n = int(region.get("layers") or 0)
        out.append((first, first + n))
        first += n
    return out


def _per_layer(region: Mapping[str, Any]) -> dict:
    return {k: v for k, v in region.items() if k != "layers"}


def stage_problem(prefill: Any, decode: Any) -> Optional[str]:
    """Why a prefill's pipeline stages are not read into this decode, or None (``EngineLayout``s)."""
    sides = (f"prefill TP {prefill.tp_size} x PP {prefill.pp_size} ({describe_stages(prefill.stages) or 'no stages'}); "
             f"decode TP {decode.tp_size} x PP {decode.pp_size}")
    if decode.pp_size != 1:
        return f"pipeline parallelism: KvxferConnector reads into a decode of PP 1 only ({sides})"
    if prefill.tp_size != decode.tp_size:
        return f"pipeline parallelism combined with different TP, which KvxferConnector does not read ({sides})"
    if prefill.is_hybrid or decode.is_hybrid:
        return f"pipeline parallelism of a hybrid model (state across stages is not read) ({sides})"
    total = decode.model.get("num_layers")
    last = prefill.stages[-1]
    decode_layers = sum(int(r.get("layers") or 0) for r in decode.regions)
    if last.first + last.layers != decode_layers or (isinstance(total, int) and total != decode_layers):
        return (f"pipeline stages: the prefill's stages hold layers [0, {last.first + last.layers}), the decode "
                f"holds {decode_layers} ({sides})")
    shapes = {str(_per_layer(r)) for r in prefill.regions} | {str(_per_layer(r)) for r in decode.regions}
    if len(shapes) != 1:
        return f"per-layer KV layout across pipeline stages ({sides}; regions {sorted(shapes)[:4]})"
    if prefill.block_size != decode.block_size:
        return (f"block size with pipeline stages: prefill {prefill.block_size}, decode {decode.block_size} "
                f"(KvxferConnector reads stages at equal block sizes only) ({sides})")
    windows = _region_layers(decode.regions)
    for stage in prefill.stages:
        for start, end in _region_layers(prefill.regions[stage_region_slice(prefill.stages, stage.index)], stage.first):
            if end > stage.first + stage.layers or not any(a <= start and end <= b for a, b in windows):
                return (f"pipeline stages: stage {stage.index}'s region of layers [{start}, {end}) is not within one "
                        f"region of the decode's (decode regions {windows}) ({sides})")
    return None


@dataclass(frozen=True)
class StageRead:
    """Decode rank's reads of one stage: every region of stage ``stage`` at rank entry ``src_rank``, each into
    the window of the decode region holding its layers (``targets[i] = (decode region, first layer in it,
    layers)``), whole blocks (``slabs``)."""

    slabs: Any  # tp_reads.SlabRead
    stage: int
    targets: tuple[tuple[int, int, int], ...]

    @property
    def src_rank(self) -> int:
        return self.slabs.src_rank


def stage_targets(prefill: Any, decode: Any, stage: Stage) -> tuple[tuple[int, int, int], ...]:
    """``(decode region, first layer in it, layers)`` for each region of ``stage`` (``stage_problem`` passed)."""
    windows = _region_layers(decode.regions)
    out = []
    for start, end in _region_layers(prefill.regions[stage_region_slice(prefill.stages, stage.index)], stage.first):
        region = next(i for i, (a, b) in enumerate(windows) if a <= start and end <= b)
        out.append((region, start - windows[region][0], end - start))
    return tuple(out)


class StageWindows:
    """The decode's registrations of layer windows of its own regions (``StageRead.targets``), made once each
    and kept: the rows ``[first, first + layers)`` of a region's ``[layers * outer, blocks, slab]`` view."""

    def __init__(self, regions: Sequence[Any], layout: Any) -> None:
        self._regions = list(regions)
        self._layers = [int(r.get("layers") or 0) for r in layout.regions]
        self._made: dict[tuple[int, int, int], Any] = {}

    def get(self, target: tuple[int, int, int]) -> Any:
        region, first, layers = target
        backend = self._regions[region]
        if first == 0 and layers == self._layers[region]:
            return backend
        made = self._made.get(target)
        if made is None:
            view = backend.memory_buffer
            rows = view.shape[0] // self._layers[region]
            window = view[first * rows:(first + layers) * rows]
            made = backend.new_registered_buffer(memory_buffer=window, expected_num_blocks=view.shape[1])
            self._made[target] = made
        return made

    def take(self) -> list[Any]:
        """The window registrations made so far, handed to the caller to close (before the regions they
        are windows of); forgotten here."""
        made, self._made = list(self._made.values()), {}
        return made


def compose_stages(layouts: Mapping[int, Any], windows: Mapping[int, Sequence[int]]) -> Any:
    """A producer's whole layout from its stages' (``layouts[pp_rank]``, TP rank 0's ``EngineLayout``, and
    ``windows[pp_rank] = (first layer, layers)``, vLLM's ``get_layers_start_end_indices``): every stage's
    regions in stage order and ``stages`` naming each one's; the layouts must agree but for their regions."""
    from dataclasses import replace

    from kvxfer.errors import LayoutError

    order = sorted(layouts)
    if order != list(range(len(order))) or sorted(windows) != order:
        raise LayoutError(f"handshake metadata came from pipeline stages {order} (windows for {sorted(windows)}), "
                          f"expected 0..{len(order) - 1}")
    first = layouts[0]
    for p in order:
        if replace(layouts[p], regions=(), num_blocks=0) != replace(first, regions=(), num_blocks=0):
            raise LayoutError(f"pipeline stage {p}'s layout differs from stage 0's beyond its layers: "
                              f"{layouts[p].describe()} against {first.describe()}")
    stages = tuple(Stage(p, int(windows[p][0]), int(windows[p][1]), len(layouts[p].regions)) for p in order)
    layout = replace(first, regions=tuple(r for p in order for r in layouts[p].regions), stages=stages,
                     num_blocks=min(layouts[p].num_blocks for p in order))
    try:  # the same checks a decode makes of them
        parse_stages([[s.first, s.layers, s.regions] for s in stages], first.pp_size, len(layout.regions))
    except PeerMetadataError as exc:
        raise LayoutError(f"this prefill's pipeline stages: {exc}") from None
    return layout
