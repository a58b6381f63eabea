"""Trust between processes: authenticated control frames and the cluster key.

Owns HMAC-authenticated control frames and sessions and the cluster key (``auth.py``); the seal
on exported metas is ``kvxfer.meta.seal``, which uses that key.
Its imports: its row of ``LAYERS`` in tests/project/test_library_layout.py (docs/architecture.md, "Layers").
"""
