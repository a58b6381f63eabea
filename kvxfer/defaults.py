"""Defaults that several parts of kvxfer (and ``engine_integration``) share, each written once.

Imports nothing, so the command line can show them in its help without importing torch (which
every backend module does), and any part may import it.
"""

from __future__ import annotations

#: Seconds a transfer handle may take before ``wait()`` raises ``TransferTimeoutError``, when the
#: caller names no timeout: the backends' own default (``KVXFER_TRANSFER_TIMEOUT_S`` overrides it
#: there), the engines' ``transfer_timeout_s`` and ``kvxfer soak --timeout``.
TRANSFER_TIMEOUT_S = 30.0
