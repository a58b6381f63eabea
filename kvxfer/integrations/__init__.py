"""Adapters for inference engines that load kvxfer as their KV transport.

``kvxfer.integrations.vllm``: ``KvxferConnector``, a vLLM V1 KV connector (``docs/vllm.md``).

``kvxfer.integrations.sglang``: kvxfer as an SGLang PD transfer backend (``docs/sglang.md``).

Its imports: its row of ``LAYERS`` in tests/project/test_library_layout.py (docs/architecture.md, "Layers"),
and the engine each adapter serves.
"""
