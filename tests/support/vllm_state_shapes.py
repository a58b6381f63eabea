"""vLLM's own Mamba state shapes, printed as JSON: run in the vLLM environment by ``tests/integrations/vllm/test_vllm_state_shapes.py``.

``python -m tests.support.vllm_state_shapes`` prints, for model-sized configs of each state type kvxfer maps
across TP sizes (Mamba1 Jamba-like, Mamba2 Nemotron-H-like with groups split and replicated, GDN
Qwen3-Next-like) and TP 1/2/4/8, the per-rank shapes ``MambaStateShapeCalculator`` gives in both conv
layouts and, in DS (the layout it requires), the per-rank conv sub-projection widths NixlConnector
derives (``ssm_conv_transfer_utils.derive_mamba_conv_split``).
"""

from __future__ import annotations

import json
import sys

CONFIGS = {
    "MAMBA1": {"intermediate_size": 8192, "state_size": 16, "conv_kernel": 4},
    "MAMBA2": {"intermediate_size": 128 * 64, "n_groups": 8, "num_heads": 128, "head_dim": 64, "state_size": 128,
               "conv_kernel": 4},
    "MAMBA2-1group": {"intermediate_size": 8 * 64, "n_groups": 1, "num_heads": 8, "head_dim": 64, "state_size": 16,
                      "conv_kernel": 4},
    "GDN_ATTN": {"num_k_heads": 16, "num_v_heads": 32, "head_k_dim": 128, "head_v_dim": 128, "conv_kernel_size": 4},
}


def _shapes(kind: str, tp: int) -> tuple:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as calc

    config = CONFIGS[kind]
    if kind == "MAMBA1":
        return calc.mamba1_state_shape(tp, **config)
    if kind == "GDN_ATTN":
        return calc.gated_delta_net_state_shape(tp, **config)
    return calc.mamba2_state_shape(tp, **config)


def main() -> None:
    import os

    import torch

    out = []
    for layout in ("DS", "SD"):
        os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = layout
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout, is_conv_state_dim_first

        get_conv_state_layout.cache_clear()  # vLLM reads the variable once per process

        assert is_conv_state_dim_first() == (layout == "DS"), "the conv layout did not take"
        for kind in CONFIGS:
            for tp in (1, 2, 4, 8):
                shapes = [list(s) for s in _shapes(kind, tp)]
                entry = {"kind": kind.split("-")[0], "config": kind, "tp": tp, "conv_layout": layout, "shapes": shapes}
                if layout == "DS":
                    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import (
                        derive_mamba_conv_split,
                    )
                    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
                    from vllm.v1.kv_cache_interface import MambaSpec

                    spec = MambaSpec(block_size=2048, shapes=tuple(tuple(s) for s in shapes),
                                     dtypes=(torch.bfloat16, torch.float32),
                                     mamba_type=MambaAttentionBackendEnum[entry["kind"]])
                    entry["nixl_proj_dims"] = list(derive_mamba_conv_split(spec, tp).local_proj_dims)
                out.append(entry)
    print("KVXFER-SHAPES " + json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
