"""SGLang's ``KVArgs`` (raw pointers) -> tensors kvxfer can register, and the layout both sides must share.

SGLang hands a transfer backend raw memory: ``kv_data_ptrs/lens/item_lens`` (K layers, then V
layers; one *item* is one page of one layer), ``aux_data_*`` (metadata rows, one item per
request slot) and ``state_data_*`` (Mamba/SWA state, one item per state slot). kvxfer registers
tensors, so each buffer is viewed as a ``uint8`` tensor over that memory (no copy; the engine
owns it and outlives the manager). The view's shape is ``[items, a, b]`` with ``a * b`` the item
length, chosen so that exactly one axis has ``items`` entries: kvxfer finds a pool's blocks axis
by its size. One registration per buffer (``buffer_regions`` says why).

``kv_layout`` is what a peer's pool must match for a page to mean the same bytes on both sides
(``tp.plan_pair`` compares two, and plans a head split across attention TP sizes); pool lengths are
left out (each instance sizes its pool from its own memory).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from kvxfer.errors import GeometryError


@dataclass(frozen=True)
class RawBuffer:
    """One of SGLang's buffers: where it is, how long, and its item (page or row) length."""

    ptr: int
    nbytes: int
    item_len: int

    @property
    def items(self) -> int:
        return self.nbytes // self.item_len


@dataclass(frozen=True)
class Region:
    """One registrable view of ``buffers`` (indices into the kind's list in ``KVArgs``), ``[items, a, b]``."""

    kind: str  # "kv", "aux" or "state"
    buffers: tuple[int, ...]
    view: torch.Tensor
    items: int


def raw_view(ptr: int, nbytes: int, device: str) -> torch.Tensor:
    """A flat ``uint8`` tensor over memory SGLang allocated (no copy, not owned)."""
    if nbytes <= 0:
        raise GeometryError(f"SGLang buffer at {ptr:#x} has length {nbytes}; nothing to register")
    if device.startswith("cuda"):
        class _Cai:  # the CUDA array interface: torch wraps device memory it did not allocate
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}
        return torch.as_tensor(_Cai(), device=device)
    array = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(array, dtype=torch.uint8)


def _split_item(item_len: int, avoid: set[int]) -> tuple[int, int]:
    """``(a, b)`` with ``a * b == item_len`` and neither in ``avoid`` (so the blocks axis is unambiguous)."""
    for a in range(1, item_len + 1):
        if item_len % a == 0 and a not in avoid and item_len // a not in avoid:
            return a, item_len // a
    raise GeometryError(f"cannot shape an item of {item_len} bytes so that no axis has {sorted(avoid)} entries")


def _shaped(flat: torch.Tensor, outer: int, items: int, item_len: int) -> Optional[torch.Tensor]:
    if outer > 1 and outer == items:
        return None
    a, b = _split_item(item_len, {items})
    shape = (outer, items, a, b) if outer > 1 else (items, a, b)
    return flat.view(shape)


def buffers_of(ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int], what: str) -> list[RawBuffer]:
    if not (len(ptrs) == len(lens) == len(item_lens)):
        raise GeometryError(f"KVArgs {what}: {len(ptrs)} pointers, {len(lens)} lengths, {len(item_lens)} item lengths")
    out = []
    for i, (ptr, n, item) in enumerate(zip(ptrs, lens, item_lens)):
        if item <= 0 or n % item:
            raise GeometryError(f"KVArgs {what}[{i}]: length {n} is not a multiple of its item length {item}")
        out.append(RawBuffer(int(ptr), int(n), int(item)))
    return out


def buffer_regions(kind: str, buffers: Sequence[RawBuffer], device: str) -> list[Region]:
    """One registration per buffer. Layers that happen to lie back to back in one process need not
    in its peer (each allocates its own), and a page must be read region to region, so regions
    follow SGLang's buffers one to one; page runs within a buffer are still coalesced by kvxfer."""
    return [Region(kind, (i,), _shaped(raw_view(b.ptr, b.nbytes, device), 1, b.items, b.item_len), b.items)
            for i, b in enumerate(buffers)]


def kv_layout(kv_args: Any, *, model: str, tp_size: int, pp_size: int, tp_rank: int = 0, mla: bool = False,
              heads: Optional[tuple[int, int]] = None,
              stage: Optional[tuple[int, Optional[int]]] = None) -> dict[str, Any]:
    """What the two sides must agree on (``tp.plan_pair`` compares them, naming what differs).

    Read from ``kv_args``: only fields SGLang 0.5.23's ``_init_kv_manager`` sets on both roles in every
    mode (``PrefillBootstrapQueue``'s and ``DecodePreallocQueue``'s; the state fields through
    ``setup_state_kv_args``, which both call). ``kv_head_num`` / ``total_kv_head_num`` are not among
    them: SGLang's decode sets them only with ``SGLANG_DISAGG_STAGING_BUFFER`` on, its prefill only for
    non-MLA pools, so the caller passes ``heads`` (``(kv_head_num, total_kv_head_num)``) only where SGLang
    set them (a non-MLA prefill). Heads need no field of their own to be compared: an item (one page of one
    layer) is ``page_size x heads x head_dim x dtype size`` bytes, so pools of other heads or head sizes
    differ in ``kv_item_lens``; across TP sizes the prefill's head count says how a page splits.
    ``tp_rank``, ``mla``: the manager's attention-TP rank and SGLang's ``is_mla_backend``.

    Pipeline stages: ``pp_rank`` is set on both roles; ``stage`` is the prefill's ``(prefill_start_layer,
    prefill_end_layer)`` (SGLang sets them on the prefill only; the caller passes None on a decode). The
    layers a rank's KV buffers hold (``layers``, ``[start, stop)``) are counted from its buffers (K then V per
    layer, or one latent per layer for MLA; draft buffers left out), starting at ``prefill_start_layer`` on a
    prefill, as SGLang's own backends map a stage (``get_mha_kv_ptrs_with_pp``), and at 0 on a decode of PP 1
    (one rank holds every layer; a decode of PP > 1 states no first layer, so None). ``prefill_end_layer`` is
    carried as SGLang states it (``tp.plan_pair`` checks it against the count under PP)."""
    draft = int(kv_args.num_draft_entries or 0)
    count = len(kv_args.kv_data_ptrs) - draft
    count = count if mla else count // 2
    if stage is not None:
        layers: Optional[list[int]] = [int(stage[0]), int(stage[0]) + count]
    else:
        layers = [0, count] if int(pp_size) == 1 else None
    out = {
        "model": model,
        "page_size": int(kv_args.page_size),
        "kv_cache_dtype": str(kv_args.kv_cache_dtype_str),
        "kv_layout": kv_args.kv_layout,
        "attn_tp_size": int(tp_size),
        "attn_tp_rank": int(tp_rank),
        "pp_size": int(pp_size),
        "pp_rank": int(kv_args.pp_rank or 0),
        "layers": layers,
        "mla": bool(mla),
        "kv_head_num": None if heads is None else int(heads[0]),
        "total_kv_head_num": None if heads is None else int(heads[1]),
        "num_draft_entries": draft,
        "kv_buffers": len(kv_args.kv_data_ptrs),
        "kv_item_lens": [int(x) for x in kv_args.kv_item_lens],
        "aux_item_lens": [int(x) for x in kv_args.aux_item_lens],
        "state_types": [str(getattr(t, "value", t)) for t in kv_args.state_types],
        "state_item_lens": [[int(x) for x in comp] for comp in kv_args.state_item_lens],
        # per state tensor: its TP-sharded axis on this rank (0: replicated), the rows before that axis, and a conv
        # state's independently sharded sub-blocks (GDN); how a slot splits across attention TP sizes (tp.plan_state)
        "state_dims": [[int(x) for x in comp] for comp in kv_args.state_dim_per_tensor],
        "state_outer_counts": [[int(x) for x in comp] for comp in kv_args.state_slice_outer_counts],
        "state_conv_groups": [[None if g is None else [int(x) for x in g] for g in comp]
                              for comp in kv_args.state_conv_shard_groups],
    }
    if stage is not None:
        out["prefill_end_layer"] = None if stage[1] is None else int(stage[1])
    return out


def region_bytes(regions: Sequence[Region]) -> int:
    return sum(math.prod(r.view.shape) for r in regions)
