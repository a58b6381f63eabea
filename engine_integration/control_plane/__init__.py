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
           "plane_class", "plane_service", "push_refusal"]


def plane_class(url: str) -> type[ControlPlane]:
    """The ``ControlPlane`` class that serves ``url`` (nothing is opened)."""
    if url.startswith("etcd://"):
        from engine_integration.control_plane.etcd.plane import EtcdPlane

        return EtcdPlane
    if url.startswith("tcp://"):
        from engine_integration.control_plane.zmq.plane import CoordinatorPlane

        return CoordinatorPlane
    raise ValueError(f"unknown control plane URL {url!r}: expected tcp://host:port (a coordinator) or etcd://host:port")


def push_refusal(plane: Any, backend: str) -> Optional[str]:
    """Why the KV backend ``backend`` cannot run on ``plane`` (a ``ControlPlane``, its URL, or None: the
    embedded coordinator), or None when it can; the caller adds the fix in its own terms. Asked before anything starts (the CLI, the launcher,
    ``engine.connect``): a push backend needs a plane that carries Megatron's push order."""
    if plane is None:
        return None
    cls = type(plane) if isinstance(plane, ControlPlane) else plane_class(str(plane))
    if cls.supports_push:
        return None
    from kvxfer.backends import construct_kv_transfer_backend_class

    try:
        backend_cls = construct_kv_transfer_backend_class(backend)
    except Exception:  # noqa: BLE001 - an unknown or unavailable backend is said by whoever builds it
        return None
    if not backend_cls.is_push:
        return None
    return (f"the push backend {backend_cls.name!r} cannot run on the {cls.kind} control plane: "
            f"{cls.push_refused_because}")


def open_control_plane(url: str, **options: Any) -> ControlPlane:
    """The engine's side of the plane at ``url``, not yet attached to an engine.

    ``tcp://host:port``: a coordinator (``zmq.CoordinatorPlane``; options ``secret``,
    ``secret_file``, ``insecure``, ``heartbeat_interval_s``, ``coordinator_timeout_s``).
    ``etcd://[user@]host:port[,host:port]/[cluster]?ttl=5&poll=0.25``: the etcd fleet
    (``etcd.EtcdPlane``; options ``password_file``, ``secret_file``, ``insecure`` and any
    ``EtcdConfig`` field).
    """
    cls = plane_class(url)
    if url.startswith("etcd://"):
        return cls.open(url, **options)  # type: ignore[attr-defined]
    return cls(url, **options)  # type: ignore[call-arg]


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
