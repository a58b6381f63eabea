"""Measuring: ``kvxfer bench`` (the sweep, its baselines and report) and ``kvxfer bench-vllm``'s runs.

Owns the sweep's axes (``config``), running backends and baselines in worker processes (``run``,
``worker``, ``sweep``, ``source``, ``baselines/``), the targets, the machine description and the report.
It knows nothing of the command line (``kvxfer.cli`` is its face) nor of the engine layer (the fleet
benches live in ``engine_integration.bench``). May import: ``kvxfer.harness``, ``kvxfer.integrations``,
``kvxfer.runtime``, ``kvxfer.backends``, ``kvxfer.meta``, ``kvxfer.plan``, ``kvxfer.security``,
``kvxfer.errors``.
"""
