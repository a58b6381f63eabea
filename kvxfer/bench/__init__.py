"""Measuring: ``kvxfer bench`` (the sweep, its baselines and report) and ``kvxfer bench-vllm``'s runs.

Owns the sweep's axes (``config``), running backends and baselines in worker processes (``run``,
``worker``, ``sweep``, ``source``, ``baselines/``), the targets, the machine description and the report.
``kvxfer.cli`` is its face (``vllm_bench`` takes the ``argparse.Namespace`` the CLI parsed); the
fleet benches, which drive the engine layer, live in ``engine_integration.bench``.
Its imports: its row of ``LAYERS`` in tests/project/test_library_layout.py (docs/architecture.md, "Layers").
"""
