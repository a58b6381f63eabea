"""Adapters for inference engines that load kvxfer as their KV transport.

``kvxfer.integrations.vllm``: ``KvxferConnector``, a vLLM V1 KV connector (``docs/vllm.md``).

``kvxfer.integrations.sglang``: kvxfer as an SGLang PD transfer backend (``docs/sglang.md``).

May import: ``kvxfer.runtime``, ``kvxfer.handoff``, ``kvxfer.backends``, ``kvxfer.meta``, ``kvxfer.plan``,
``kvxfer.security``, ``kvxfer.errors``, and the engine each adapter serves.
"""
