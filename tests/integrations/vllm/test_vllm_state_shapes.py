"""``hybrid_tp`` reads vLLM's own Mamba state shapes as vLLM and NixlConnector cut them.

The shapes come from vLLM 0.32's ``MambaStateShapeCalculator`` run in the vLLM environment
(``tests/support/vllm_state_shapes.py``) for model-sized configs of each state type kvxfer maps across TP
sizes (Mamba1 Jamba-like, Mamba2 Nemotron-H-like with 8 groups and with 1 replicated group, GDN
Qwen3-Next-like), TP 1/2/4/8, both conv layouts. For each, ``hybrid_tp`` must decompose the conv
state into the widths NixlConnector derives for it (``derive_mamba_conv_split``, DS), and every pair
of TP sizes must be readable by parts, each decode rank's parts covering its page's state exactly.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess

import pytest

from kvxfer.integrations.vllm.handshake import EngineLayout
from kvxfer.integrations.vllm.hybrid_tp import _side, hybrid_tp_problem, page_reads
from tests.support.vllm_support import REPO_ROOT, require_vllm_python

pytestmark = pytest.mark.timeout(300)
KV_HEADS, HEAD, BLOCK = 8, 128, 16
GROUPS = {"MAMBA2": 8, "MAMBA2-1group": 1}


@pytest.fixture(scope="module")
def shapes() -> list[dict]:
    out = subprocess.run([require_vllm_python(), "-m", "tests.support.vllm_state_shapes"], capture_output=True, text=True,
                         timeout=240, cwd=str(REPO_ROOT))
    line = next((x for x in out.stdout.splitlines() if x.startswith("KVXFER-SHAPES ")), None)
    assert out.returncode == 0 and line, out.stderr[-3000:]
    return json.loads(line.split(" ", 1)[1])


def layout(entry: dict) -> EngineLayout:
    """The layout a worker of that TP rank would serve for this state (one attention group beside it)."""
    conv, ssm = entry["shapes"]
    tp = entry["tp"]
    state = math.prod(conv) * 2 + math.prod(ssm) * 4
    attention = KV_HEADS // tp * BLOCK * 2 * HEAD * 2
    page = max(state, attention)
    groups = [{"spec": "FullAttentionSpec", "layers": 1, "block_size": BLOCK, "page_bytes": page, "dtype": "bfloat16",
               "kv_layout": "LBHNC", "kv_page": [KV_HEADS // tp, BLOCK, 2 * HEAD * 2], "kv_split": 1},
              {"spec": "MambaSpec", "layers": 1, "block_size": 2048, "page_bytes": page, "shapes": [conv, ssm],
               "dtypes": ["bfloat16", "float32"], "mamba_cache_mode": "none", "spec_blocks": 0,
               "conv_layout": entry["conv_layout"], "mamba_type": entry["kind"]}]
    model = {"num_layers": 2, "num_kv_heads": KV_HEADS, "head_size": HEAD, "dtype": "bfloat16", "kv_dtype": "auto",
             "kv_groups": groups, "use_mla": False}
    if entry["config"] in GROUPS:
        model["mamba_ngroups"] = GROUPS[entry["config"]]
    region = {"name": "hma", "layers": 1, "layer_shape": [1, None, page], "blocks_axis": 1, "layout": "HMA-pages",
              "dtype": "uint8"}
    return EngineLayout(model=model, tp_size=tp, pp_size=1, block_size=BLOCK, regions=(region,), num_blocks=64)


def test_the_conv_bands_are_nixl_connectors_sub_projections(shapes):
    seen = set()
    for entry in shapes:
        side = _side(layout(entry), "vLLM")
        assert side.conv_channels == (entry["shapes"][0][0] if entry["conv_layout"] == "DS" else entry["shapes"][0][1])
        if "nixl_proj_dims" in entry:
            assert [side.local(b) * b.width for b in side.bands] == entry["nixl_proj_dims"], entry
            seen.add(entry["config"])
    assert seen == {"MAMBA1", "MAMBA2", "MAMBA2-1group", "GDN_ATTN"}


def test_every_pair_of_tp_sizes_reads_each_decode_page_exactly(shapes):
    by_key = {(e["config"], e["conv_layout"], e["tp"]): layout(e) for e in shapes}
    pairs = 0
    for (config, conv_layout, src_tp), prefill in by_key.items():
        for dst_tp in (1, 2, 4, 8):
            if dst_tp == src_tp:
                continue
            decode = by_key[(config, conv_layout, dst_tp)]
            assert hybrid_tp_problem(prefill, decode) is None, (config, conv_layout, src_tp, dst_tp)
            dst = _side(decode, "decode")
            for rank in range(dst_tp):
                covered = sorted((p.dst_offset, p.length) for read in page_reads(rank, prefill, decode)
                                 for p in read.parts_for("mamba"))
                # the parts tile the decode's conv + SSM state: no byte twice, none left out
                ends = list(itertools.accumulate(length for _, length in covered))
                assert [offset for offset, _ in covered] == [0] + ends[:-1], (config, src_tp, dst_tp, rank)
                assert ends[-1] == dst.conv_bytes + dst.ssm_bytes
            pairs += 1
    assert pairs == 4 * 2 * 12  # configs x conv layouts x ordered pairs of distinct TP sizes
