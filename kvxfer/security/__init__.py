"""Trust between processes: authenticated control frames and the cluster key.

Owns HMAC-authenticated control frames and sessions and the cluster key (``auth.py``); the seal
on exported metas is ``kvxfer.meta.seal``, which uses that key. May import: ``kvxfer.errors``.
"""
