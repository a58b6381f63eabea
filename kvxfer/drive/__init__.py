"""Engine drivers: what starts and steers real vLLM instances and SGLang ranks from another process.

``kvxfer bench-vllm`` and ``kvxfer bench-sglang`` (``kvxfer.bench``) and the vLLM and SGLang tests use them:
``vllm_control`` / ``vllm_engine`` (a vLLM instance and the process it runs in; ``vllm_timing``, one
handoff clock for both connectors; ``vllm_model``, the tiny local model), ``sglang_control`` /
``sglang_rank`` / ``sglang_build`` (an SGLang rank built with SGLang's own pools and queues, and its
process), and ``forkserver`` (a server that imported torch and SGLang once and forks the ranks). README.md
beside this file is the map.
Its imports: its row of ``LAYERS`` in tests/project/test_library_layout.py (docs/architecture.md, "Layers").
"""
