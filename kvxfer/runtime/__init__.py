"""What runs beside the transports and is no part of a hand-off: multi-peer pulls, Prometheus metrics, the
port a local server is started on.

(The generation counters and the torn-read check, a guard, are ``kvxfer.handoff.generations``.)
Its imports: its row of ``LAYERS`` in tests/project/test_library_layout.py (docs/architecture.md, "Layers").
"""
