"""Engine integration: hand a request's KV from a prefill engine to a decode engine.

Layers, bottom up (one job per module):
  poll        ``KVPoll``, the one lifecycle enum
  descriptor  ``HandoffDescriptor``: what a prefill publishes per request
  adapter     ``HandoffEngineAdapter``: what the state machines need from an engine
  source      prefill side: pin, publish, release on read-done / safe failure
  sink        decode side: FIFO reserve, cached prefix, pull, quarantine, admit
  engine      ``StateHandoffDynamicInferenceEngine``, ``DisaggDynamicInferenceEngine``
  wire        every control message and its encoding (HMAC-ready)
  coordinator registration, routing, failure handling (a process; no torch)
  worker, procs, client, launch   processes and the ``kvxfer generate`` command
  reference/  a small Llama-style engine with a paged KV cache (the test bed)

Names are imported lazily so the coordinator process never imports torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "KVPoll": "engine_integration.poll",
    "HandoffDescriptor": "engine_integration.descriptor",
    "HandoffEngineAdapter": "engine_integration.adapter",
    "ImportedRequest": "engine_integration.adapter",
    "HandoffSource": "engine_integration.source",
    "HandoffSink": "engine_integration.sink",
    "SinkEvent": "engine_integration.sink",
    "StateHandoffDynamicInferenceEngine": "engine_integration.engine",
    "DisaggDynamicInferenceEngine": "engine_integration.engine",
    "RegistrationRefused": "engine_integration.engine",
    "Coordinator": "engine_integration.coordinator",
    "CoordinatorConfig": "engine_integration.coordinator",
    "CoordinatorClient": "engine_integration.client",
    "GenerationResult": "engine_integration.client",
    "ClusterConfig": "engine_integration.launch",
    "DisaggCluster": "engine_integration.launch",
    "generate_colocated": "engine_integration.launch",
    "generate_disaggregated": "engine_integration.launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine_integration' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
