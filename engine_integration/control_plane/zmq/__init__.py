"""The ZeroMQ control plane: one coordinator process holds the fleet's picture.

Right for one machine or a small fleet (one process to start, no store to run); a single
point of failure for a large one (``etcd/`` keeps the same state in etcd instead).
Modules, one job each:

  wire         every control message: msgspec structs with their bounds, one encode/decode
  channel      connections: CURVE encryption, per-connection sessions, frame and connection caps
  coordinator  registration, routing (``control_plane.policy``), failure handling; a process, no torch
  plane        ``CoordinatorPlane``: the engine's side of the protocol (``control_plane.base.ControlPlane``)
  client       ``CoordinatorClient``: submit prompts, collect results
  service      ``CoordinatorService``: a coordinator process started and stopped by a launcher
"""

from __future__ import annotations
