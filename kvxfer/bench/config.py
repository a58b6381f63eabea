"""What a bench run measures: the sweep axes, and the points they expand to.

A *point* is one request shape: a slice size (the bytes of one (block, layer plane)),
a number of blocks, an id pattern and a reshard flag. Points that share a slice size
share one registered pool per side, so registration cost is paid once per size, not
once per point. Block counts are capped so one request never exceeds
``max_request_bytes`` (a 4 MiB slice times 128 blocks times every plane would not fit
this machine, and would say nothing new); capped duplicates are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

from kvxfer.defaults import MAX_TIMEOUT_S, MIN_TIMEOUT_S, TRANSFER_TIMEOUT_S, bounded_float
from kvxfer.harness.loopback_config import LoopbackConfig

KiB = 1024
MiB = 1024 * KiB

DEFAULT_SLICE_SIZES = (4 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
DEFAULT_BLOCK_COUNTS = (16, 128)
#: Slice sizes that also get TP-reshard points: a reshard reads one fragment per token, so
#: small slices cost seconds per point; two sizes show the effect within the time budget.
DEFAULT_RESHARD_SIZES = (32 * KiB, 1 * MiB)
PATTERNS = ("contiguous", "scattered")
DEFAULT_BASELINES = ("memcpy", "naive-nixl", "ucx-perftest", "ucp-get-cold", "mooncake")
#: Baselines that measure the pool's own device: on a GPU, memcpy is torch's device-to-device copy.
DEVICE_BASELINES = ("memcpy",)

#: Pool shape besides the head dim: [2, layers, blocks, TOKENS, HEADS, head_dim] in bf16.
TOKENS_PER_BLOCK = 16
NUM_HEADS = 8
DTYPE = "bfloat16"
ELEMENT_SIZE = 2
#: The reshard axis: prefill TP 2 (4 heads per rank) -> decode TP 1 (all 8 heads).
RESHARD_SRC_TP = 2


@dataclass(frozen=True)
class Point:
    """One request shape; ``num_blocks`` is already capped."""

    slice_bytes: int
    num_blocks: int
    pattern: str
    reshard: bool = False

    @property
    def key(self) -> str:
        tag = "-tp2to1" if self.reshard else ""
        return f"{self.slice_bytes}B-{self.num_blocks}blk-{self.pattern}{tag}"


@dataclass(frozen=True)
class BenchConfig:
    """Every knob of a run. Defaults are the documented full sweep (a few minutes)."""

    backends: tuple[str, ...] = ("local",)
    slice_sizes: tuple[int, ...] = DEFAULT_SLICE_SIZES
    block_counts: tuple[int, ...] = DEFAULT_BLOCK_COUNTS
    patterns: tuple[str, ...] = PATTERNS
    reshard: str = "on"  # "on": TP 2 -> 1 points at ``reshard_sizes``; "off": plain pulls only
    reshard_sizes: tuple[int, ...] = DEFAULT_RESHARD_SIZES  # slice sizes that get reshard points too
    num_layers: int = 4  # planes per block = 2 * num_layers (K and V)
    repeats: int = 10
    warmup: int = 2
    max_request_bytes: int = 16 * MiB
    baselines: tuple[str, ...] = DEFAULT_BASELINES
    seed: int = 0
    timeout_s: float = TRANSFER_TIMEOUT_S
    mooncake_python: Optional[str] = None  # interpreter with mooncake installed (default: this one)
    get_region_bytes: Optional[int] = None  # ucp-get-cold's region per side (None: 2x the LLC, see get_region())
    device: str = "cpu"  # where both pools live; "cuda" measures VRAM pools against a device-to-device copy
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for size in self.slice_sizes:
            if size <= 0 or size % (TOKENS_PER_BLOCK * NUM_HEADS * ELEMENT_SIZE):
                raise ValueError(f"slice size {size} must be a positive multiple of "
                                 f"{TOKENS_PER_BLOCK * NUM_HEADS * ELEMENT_SIZE} bytes (16 tokens x 8 heads x bf16)")
        if any(n <= 0 for n in self.block_counts):
            raise ValueError(f"block counts must be positive, got {self.block_counts}")
        for pattern in self.patterns:
            if pattern not in PATTERNS:
                raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("repeats must be >= 1 and warmup >= 0")
        bounded_float("timeout_s", self.timeout_s, MIN_TIMEOUT_S, MAX_TIMEOUT_S, unit="seconds")
        if self.reshard not in ("on", "off"):
            raise ValueError(f"reshard must be 'on' or 'off', got {self.reshard!r}")
        unknown = set(self.baselines) - set(DEFAULT_BASELINES)
        if unknown:
            raise ValueError(f"unknown baselines {sorted(unknown)}; known: {', '.join(DEFAULT_BASELINES)}")
        if self.device != "cpu":
            if self.device.split(":")[0] != "cuda":
                raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
            host_only = sorted(set(self.baselines) - set(DEVICE_BASELINES))
            if host_only:
                raise ValueError(f"baselines {', '.join(host_only)} measure host memory only; with device "
                                 f"{self.device} use {', '.join(DEVICE_BASELINES)} (a device-to-device copy) or none")

    @property
    def planes(self) -> int:
        return 2 * self.num_layers

    def capped_blocks(self, slice_bytes: int, num_blocks: int) -> int:
        """``num_blocks``, lowered so the request fits ``max_request_bytes`` (at least one block)."""
        return max(1, min(num_blocks, self.max_request_bytes // (slice_bytes * self.planes)))

    def points(self, reshard: bool = False) -> Iterator[Point]:
        """Every point of the sweep, grouped by (slice size, reshard) -- the pools they share --,
        capped and de-duplicated. Reshard points exist only when ``reshard`` is True."""
        for size in self.slice_sizes:
            counts = sorted({self.capped_blocks(size, n) for n in self.block_counts})
            for tp_change in (False, True) if reshard and size in self.reshard_sizes else (False,):
                for n in counts:
                    for pattern in self.patterns:
                        yield Point(size, n, pattern, reshard=tp_change)

    def coalesced_sizes(self) -> list[int]:
        """The message sizes plain pulls post: a slice (scattered ids) and a whole contiguous request's run
        per plane (``blocks x slice``); the inter-process ceiling is measured at each."""
        sizes = set(self.slice_sizes)
        if "contiguous" in self.patterns:
            sizes |= {self.capped_blocks(s, n) * s for s in self.slice_sizes for n in self.block_counts}
        return sorted(sizes)

    def get_region(self, llc_bytes: Optional[int], memory_bytes: Optional[int]) -> int:
        """Bytes per side for ucp-get-cold: ``get_region_bytes``, else 2x the LLC (at least 256 MiB), never
        more than an eighth of the memory nor 4 GiB; always at least twice the largest message."""
        if self.get_region_bytes:
            region = self.get_region_bytes
        else:
            region = max(2 * (llc_bytes or 128 * MiB), 256 * MiB)
            region = min(region, 4096 * MiB, (memory_bytes or 1 << 40) // 8)
        return max(region, 2 * max(self.coalesced_sizes()))

    def pool_config(self, backend: str, slice_bytes: int) -> LoopbackConfig:
        """The pool (both sides) for one slice size: twice the largest request, so scattered ids scatter."""
        largest = max(self.capped_blocks(slice_bytes, n) for n in self.block_counts)
        head_dim = slice_bytes // (TOKENS_PER_BLOCK * NUM_HEADS * ELEMENT_SIZE)
        pool_blocks = max(2 * largest, 4)
        while pool_blocks in (2, self.num_layers, TOKENS_PER_BLOCK, NUM_HEADS, NUM_HEADS // RESHARD_SRC_TP, head_dim):
            pool_blocks += 1  # the blocks axis is found by its size: keep it unique
        return LoopbackConfig(
            backend=backend, num_layers=self.num_layers, tokens_per_block=TOKENS_PER_BLOCK, num_heads=NUM_HEADS,
            head_dim=head_dim, dtype=DTYPE, pool_blocks=pool_blocks, request_blocks=largest, seed=self.seed,
            timeout_s=self.timeout_s, device=self.device,
        )

    def request_config(self, pool: LoopbackConfig, point: Point, repeat: int) -> LoopbackConfig:
        """The request's ids come from ``LoopbackConfig.block_ids``: a fresh scatter per repeat."""
        return replace(pool, request_blocks=point.num_blocks, pattern=point.pattern,
                       seed=self.seed + 7919 * repeat + point.num_blocks)


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20}


def parse_size(text: str) -> int:
    """``4K``, ``32KiB``, ``1M``, ``4096`` -> bytes (binary units)."""
    t = text.strip().upper()
    digits = t.rstrip("KMIB")
    unit = t[len(digits):]
    if not digits.isdigit() or unit not in _UNITS or int(digits) == 0:
        raise ValueError(f"not a size: {text!r} (examples: 4K, 32KiB, 1M, 4096)")
    return int(digits) * _UNITS[unit]


def tiny_config(**overrides: object) -> BenchConfig:
    """A seconds-long sweep (tests, smoke runs): one small size, 8 blocks, 1 repeat."""
    base = dict(slice_sizes=(4 * KiB,), reshard_sizes=(4 * KiB,), block_counts=(8,), num_layers=2, repeats=1, warmup=1,
                max_request_bytes=4 * MiB, get_region_bytes=32 * MiB)
    base.update(overrides)
    return BenchConfig(**base)  # type: ignore[arg-type]
