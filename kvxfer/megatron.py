"""Make Megatron-LM's disaggregation engine construct kvxfer backends (``docs/megatron.md``).

Megatron's handoff module imports ``construct_kv_transfer_backend_class`` from its own
``transfer_backends.base``, which knows ``nixl`` and ``nccl`` only. ``install()`` points
that one name at kvxfer's registry, so the name given to
``DisaggDynamicInferenceEngine.setup_kv_transfer(role, backend=...)`` (default ``"nixl"``;
Megatron has no launcher flag for it) selects kvxfer's backends (``nixl``, ``ucx``, ``local``,
``nccl`` and plugins). The lookup happens when ``setup_kv_transfer`` runs, so ``install()``
must run before it, in every engine process.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any, Callable, Optional

from kvxfer.backends import construct_kv_transfer_backend_class

logger = logging.getLogger(__name__)

#: The module whose name lookup is replaced (the pinned commit's layout).
HANDOFF_MODULE = "megatron.core.inference.disaggregation.inference_state_handoff"


def install(module: Optional[ModuleType] = None) -> Callable[[str], Any]:
    """Replace Megatron's backend lookup with kvxfer's; returns the previous lookup.

    ``module`` defaults to Megatron's handoff module (imported here); a clear
    ``ImportError`` names it when Megatron is not installed.
    """
    if module is None:
        try:
            module = importlib.import_module(HANDOFF_MODULE)
        except ImportError as exc:
            raise ImportError(f"kvxfer.megatron.install() needs Megatron-LM ({HANDOFF_MODULE}): {exc}") from exc
    previous = getattr(module, "construct_kv_transfer_backend_class", None)
    if previous is None:
        raise AttributeError(
            f"{module.__name__} has no construct_kv_transfer_backend_class; this Megatron version is not the one "
            "docs/megatron.md describes"
        )
    module.construct_kv_transfer_backend_class = construct_kv_transfer_backend_class
    logger.info("Megatron's %s now constructs kvxfer backends", module.__name__)
    return previous
