"""The etcd control plane: the fleet's state lives in etcd, which outlives every kvxfer process.

No coordinator: each engine holds one etcd lease and writes, under it, its instance
record and its own side of each handoff; every process acts on verdicts computed from
one snapshot of the store (docs/fleet.md has the key layout, leases, fencing and
authentication). Modules, one job each:

  gateway       a stdlib client for etcd's v3 HTTP/JSON gateway (``EtcdHttpClient``)
  records       key layout, instance and handoff records, signing and verification, ``FleetView`` verdicts (pure)
  requests      request, result and load-figure records beside them (pure)
  store         ``EtcdStore``: one process's lease, keepalive, self-fencing, snapshots, handoff keys
  membership    ``Membership``: one instance's registration, lease, fencing and reincarnation
  prefill_role  ``PrefillRole``: claim requests, route (by ``policy``) and publish handoffs, act on source verdicts
  decode_role   ``DecodeRole``: take handoffs, pull, commit under the lease, act on reader verdicts
  plane         ``EtcdPlane``: the engine's side (``control_plane.base.ControlPlane``), composed of the three above
  client        ``EtcdGenerationClient``: submit prompts, collect results
  server        start, secure and stop a local etcd (tests, demos)
  service       ``EtcdService``: an etcd reached or started for a launcher, with its client

Nothing here imports torch or zmq.
"""

from __future__ import annotations

from typing import Any


def open_etcd_store(url: str, **options: Any) -> Any:
    """An unregistered ``EtcdStore`` from its URL (clients, tools); ``options`` override ``EtcdConfig`` fields."""
    from engine_integration.control_plane.etcd.store import EtcdStore, parse_etcd_url

    return EtcdStore(parse_etcd_url(url, **options))
