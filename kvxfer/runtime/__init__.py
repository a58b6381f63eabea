"""What runs beside the transports: counters, Prometheus metrics, torn-read checks.

Owns what runs on top of a backend: generation counters and the torn-read check, multi-peer
pulls, metrics. May import: ``kvxfer.handoff``, ``kvxfer.backends``, ``kvxfer.meta``, ``kvxfer.plan``,
``kvxfer.security``, ``kvxfer.errors``.
"""
