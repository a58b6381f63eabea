"""Pure planning: buffer geometry, shard layouts, copy plans and reshard plans.

Nothing here does I/O or imports a transport: every function takes numbers (or
frozen dataclasses) and returns a plan, so the planners are tested by applying
their plans to tensors and comparing bytes.

May import: ``kvxfer.errors`` only (and numpy, torch dtypes).
"""
