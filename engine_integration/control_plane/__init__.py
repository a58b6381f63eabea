"""Fleet control planes: where instances, transfer metas and handoff state live.

The ZeroMQ coordinator (``engine_integration.coordinator``) keeps all of it in one
process: right for one machine, a single point of failure for a fleet. Here is the
interface an engine needs from any control plane (``base.ControlPlane``) and an
implementation whose state lives in etcd (``etcd.EtcdControlPlane``), which outlives
every kvxfer process. Modules, one job each:

  base         the interface, states, errors, ``Health``
  records      key layout, records, signing and verification, ``FleetView`` decisions (pure)
  etcd_http    a stdlib client for etcd's v3 HTTP/JSON gateway
  etcd         ``EtcdControlPlane``: lease, keepalive, self-fencing, snapshots, handoff keys
  etcd_server  start/secure/stop a local etcd (tests, demos)

``open_control_plane("etcd://user@host:2379/cluster")`` builds one from a URL. Nothing
here imports torch or zmq.
"""

from __future__ import annotations

from typing import Any

from engine_integration.control_plane.base import (Change, ControlPlane, ControlPlaneError, ControlPlaneUnavailable,
                                                   HandoffState, Health, LeaseLost)
from engine_integration.control_plane.records import (FleetView, HandoffPair, HandoffRecord, InstanceRecord,
                                                      KeyLayout, Verdict)

__all__ = ["Change", "ControlPlane", "ControlPlaneError", "ControlPlaneUnavailable", "FleetView", "HandoffPair",
           "HandoffRecord", "HandoffState", "Health", "InstanceRecord", "KeyLayout", "LeaseLost", "Verdict",
           "open_control_plane"]


def open_control_plane(url: str, **options: Any) -> ControlPlane:
    """A control plane from its URL: ``etcd://[user@]host:port[,host:port]/[cluster]?ttl=5&poll=0.25``.

    ``options`` override ``EtcdConfig`` fields (``password_file``, ``secret_file``, ...).
    The embedded coordinator keeps its own entry point (``tcp://``) until the engine is
    wired to this interface.
    """
    if url.startswith("etcd://"):
        from engine_integration.control_plane.etcd import EtcdControlPlane, parse_etcd_url

        on_lease_lost = options.pop("on_lease_lost", None)
        return EtcdControlPlane(parse_etcd_url(url, **options), on_lease_lost=on_lease_lost)
    raise ValueError(f"unknown control plane URL {url!r}: expected etcd://host:port")
