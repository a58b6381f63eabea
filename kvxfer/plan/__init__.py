"""Pure planning: buffer geometry, shard layouts, copy plans and reshard plans.

Nothing here does I/O or imports a transport: every function takes numbers (or
frozen dataclasses) and returns a plan, so the planners are tested by applying
their plans to tensors and comparing bytes.

Beyond ``kvxfer.errors`` it uses only numpy and torch dtypes.
Its imports: its row of ``LAYERS`` in tests/project/test_library_layout.py (docs/architecture.md, "Layers").
"""
