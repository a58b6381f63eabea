"""Engine integration: hand a request's KV from a prefill engine to a decode engine.

The parts (one job per module; the hand-off lifecycle they run, ``KVPoll`` included, is
``kvxfer.handoff``'s; README.md beside this file is the map). Which may import which: ``LAYERS`` in
tests/project/test_library_layout.py (docs/architecture.md, "Layers"), the one statement for the whole tree.
  descriptor    ``HandoffDescriptor``: what a prefill publishes per request
  adapter       ``HandoffEngineAdapter``: what the state machines need from an engine
  source        prefill side: pin, publish, release on read-done / safe failure
  sink          decode side: FIFO reserve, cached prefix, pull, quarantine, admit
  reference_adapter  ``ReferenceEngineAdapter``: the reference engine as ``source``/``sink`` see it
  handoff_engine  ``InferenceStateHandoffMixin``, ``StateHandoffDynamicInferenceEngine`` (no plane)
  disagg_engine ``DisaggDynamicInferenceEngine``, which takes a control plane object
  engine        the engines' public names, re-exported (``engine_integration.engine.DisaggDynamicInferenceEngine``)
  control_plane the interface (``base``), the policy written once (``policy``: compatibility,
                admission, routing) and one package per plane: ``zmq/`` (a coordinator
                process) and ``etcd/`` (state in etcd, no coordinator)
  worker, procs, launch   engine host processes, ``DisaggCluster`` (either plane), ``kvxfer generate``
  reference/    a small Llama-style engine with a paged KV cache (the test bed)

Nothing below the engines imports them, and no control-plane package imports the engine: a
plane sees the engine only through ``control_plane.base.PlaneEngine``. Names are imported
lazily so the coordinator process never imports torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "KVPoll": "kvxfer.handoff.poll",
    "HandoffDescriptor": "engine_integration.descriptor",
    "HandoffEngineAdapter": "engine_integration.adapter",
    "ImportedRequest": "engine_integration.adapter",
    "HandoffSource": "engine_integration.source",
    "HandoffSink": "engine_integration.sink",
    "SinkEvent": "engine_integration.sink",
    "StateHandoffDynamicInferenceEngine": "engine_integration.handoff_engine",
    "DisaggDynamicInferenceEngine": "engine_integration.disagg_engine",
    "RegistrationRefused": "engine_integration.control_plane.base",
    "ControlPlane": "engine_integration.control_plane.base",
    "GenerationResult": "engine_integration.control_plane.base",
    "open_control_plane": "engine_integration.control_plane",
    "CoordinatorPlane": "engine_integration.control_plane.zmq.plane",
    "Coordinator": "engine_integration.control_plane.zmq.coordinator",
    "CoordinatorConfig": "engine_integration.control_plane.zmq.coordinator",
    "CoordinatorClient": "engine_integration.control_plane.zmq.client",
    "EtcdPlane": "engine_integration.control_plane.etcd.plane",
    "EtcdGenerationClient": "engine_integration.control_plane.etcd.client",
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
