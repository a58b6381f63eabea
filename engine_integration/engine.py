"""The engines, by the names Megatron and the docs give them: ``engine_integration.engine``.

One job: keep the public import path. The engines live in their own modules:

- ``handoff_engine`` -- ``InferenceStateHandoffMixin`` (transport setup, handoff plumbing) and
  ``StateHandoffDynamicInferenceEngine`` (control-plane neutral: ``handoff_outbox`` /
  ``handoff_events``, ``add_handoff`` / ``release_handoff``);
- ``disagg_engine`` -- ``DisaggDynamicInferenceEngine``, the same engine with a control plane
  object (``connect(plane, role=, name=)``, ``serve_step``);
- ``reference_adapter`` -- ``ReferenceEngineAdapter``, what ``source``/``sink`` see of the engine.

Nothing in ``engine_integration`` imports this module (its imports: its row of ``LAYERS`` in
tests/project/test_library_layout.py).
"""

from __future__ import annotations

from engine_integration.control_plane.base import RegistrationRefused
from engine_integration.disagg_engine import DisaggDynamicInferenceEngine
from engine_integration.handoff_engine import (DECODE, PREFILL, ROLES, InferenceStateHandoffMixin,
                                               StateHandoffDynamicInferenceEngine)
from engine_integration.reference_adapter import ReferenceEngineAdapter

__all__ = ["DECODE", "PREFILL", "ROLES", "DisaggDynamicInferenceEngine", "InferenceStateHandoffMixin",
           "ReferenceEngineAdapter", "RegistrationRefused", "StateHandoffDynamicInferenceEngine"]
