"""Adapters for inference engines that load kvxfer as their KV transport.

``kvxfer.integrations.vllm``: ``KvxferConnector``, a vLLM V1 KV connector (``docs/vllm.md``).
"""
