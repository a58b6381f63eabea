"""What runs beside the transports: counters, Prometheus metrics, torn-read checks.

Owns what runs on top of a backend: generation counters and the torn-read check, multi-peer
pulls, metrics.
Its imports: its row of ``LAYERS`` in tests/test_library_layout.py (docs/architecture.md, "Layers").
"""
