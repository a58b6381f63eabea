"""Measuring: ``kvxfer bench`` (the sweep, its baselines and report), ``kvxfer bench-vllm`` and ``kvxfer bench-sglang``.

Owns the sweep's axes (``config``), running backends and baselines in worker processes (``run``,
``worker``, ``sweep``, ``source``, ``baselines/``), the targets, the machine description and the report.
``kvxfer.cli`` is its face (``vllm_bench`` takes the ``argparse.Namespace`` the CLI parsed); the
fleet benches, which drive the engine layer, live in ``engine_integration.bench``; the drivers of real
vLLM and SGLang processes, which the tests use too, in ``kvxfer.drive``.
Its imports: its row of ``LAYERS`` in tests/project/test_library_layout.py (docs/architecture.md, "Layers").
"""
