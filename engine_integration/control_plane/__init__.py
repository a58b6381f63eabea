"""Control planes: where a fleet's engines meet. One interface, one policy, one package per plane.

  base     the contracts: ``ControlPlane`` (the engine's side), ``GenerationClient``,
           ``PlaneService`` (what a launcher runs), errors, ``GenerationResult``
  policy   compatibility, admission and routing, written once (pure; both planes call it)
  zmq/     one coordinator process holds the fleet's picture (the default; one machine)
  etcd/    the state lives in etcd, no coordinator (a fleet that outlives any process)

``open_control_plane(url)`` gives an engine its plane from a URL; ``plane_service(url)``
gives a launcher the fleet side it runs. Nothing here imports torch; the ZeroMQ modules
import pyzmq, the etcd ones only the standard library.
"""

from __future__ import annotations

from typing import Any, Optional

from engine_integration.control_plane.base import (ControlPlane, ControlPlaneError, ControlPlaneUnavailable,
                                                   FleetStats, GenerationClient, GenerationResult, Health,
                                                   PlaneService, RegistrationRefused)

__all__ = ["ControlPlane", "ControlPlaneError", "ControlPlaneUnavailable", "FleetStats", "GenerationClient",
           "GenerationResult", "Health", "PlaneService", "RegistrationRefused", "open_control_plane",
           "plane_service"]


def open_control_plane(url: str, **options: Any) -> ControlPlane:
    """The engine's side of the plane at ``url``, not yet attached to an engine.

    ``tcp://host:port``: a coordinator (``zmq.CoordinatorPlane``; options ``secret``,
    ``secret_file``, ``insecure``, ``heartbeat_interval_s``, ``coordinator_timeout_s``).
    ``etcd://[user@]host:port[,host:port]/[cluster]?ttl=5&poll=0.25``: the etcd fleet
    (``etcd.EtcdPlane``; options ``password_file``, ``secret_file``, ``insecure`` and any
    ``EtcdConfig`` field).
    """
    if url.startswith("etcd://"):
        from engine_integration.control_plane.etcd.plane import EtcdPlane

        return EtcdPlane.open(url, **options)
    if url.startswith("tcp://"):
        from engine_integration.control_plane.zmq.plane import CoordinatorPlane

        return CoordinatorPlane(url, **options)
    raise ValueError(f"unknown control plane URL {url!r}: expected tcp://host:port (a coordinator) or etcd://host:port")


def plane_service(url: Optional[str], **options: Any) -> PlaneService:
    """The fleet side a launcher runs: ``None`` starts a coordinator (``zmq.CoordinatorService``;
    options are ``CoordinatorConfig`` fields), ``etcd://...`` reaches or starts etcd
    (``etcd.EtcdService``; options ``password_file``, ``secret``)."""
    if not url:
        from engine_integration.control_plane.zmq.coordinator import CoordinatorConfig
        from engine_integration.control_plane.zmq.service import CoordinatorService

        return CoordinatorService(CoordinatorConfig(**options))
    if url.startswith("etcd://"):
        from engine_integration.control_plane.etcd.service import EtcdService

        return EtcdService(url, **options)
    raise ValueError(f"unknown control plane URL {url!r}: expected etcd://host:port, or none for a coordinator")
