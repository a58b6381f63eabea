"""The control-plane interface the engines need, whatever holds the state.

Today one ZeroMQ coordinator process holds the fleet's picture (who is alive, their
transfer metas, every handoff's state); if it dies, every handoff is orphaned. This
interface names what an engine needs from *any* control plane so that a store which
outlives every kvxfer process (etcd, ``engine_integration.control_plane.etcd``) can hold
the same state:

- ``register``: this instance and its transfer metas, under a lease it keeps alive;
  a restart under the same name is a new incarnation (fresh metas, never the old ones).
- ``snapshot``/``instances``: the live set, every record verified before it is returned.
- ``publish_handoff`` (prefill) / ``set_reader_state`` (decode): a handoff's state in
  keys owned by the lease of the side that owns that state, so a dead side's state
  vanishes with it and the other side learns it within the lease TTL plus one poll.
- ``clear_handoff``: the source removes a finished handoff (nothing left behind).
- ``poll_changes``: what changed since the last call (instances up/down, handoffs).
- ``health``: for ``kvxfer info`` and for self-fencing (``lease_valid``).

Pure data (records, verdicts) lives in ``records``; nothing here does I/O.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from kvxfer.errors import KVXferError


class ControlPlaneError(KVXferError):
    """A control-plane operation failed; the message says what to check."""


class ControlPlaneUnavailable(ControlPlaneError):
    """The control-plane store could not be reached within the configured time."""


class LeaseLost(ControlPlaneError):
    """This instance's lease expired (or was revoked): it is dead to the fleet and must
    re-register as a new incarnation; nothing it holds under the old lease may be trusted."""


class HandoffState(str, enum.Enum):
    """A handoff's states; ``PUBLISHED`` is the source's, the rest are the reader's."""

    PUBLISHED = "published"   #: source: blocks pinned, descriptor routed to one reader
    RESERVED = "reserved"     #: reader: destination blocks reserved, no read posted yet
    PULLING = "pulling"       #: reader: one-sided reads may be in flight (written *before* posting)
    READ_DONE = "read_done"   #: reader: every read completed; the source may unpin
    FAILED = "failed"         #: reader: the pull failed and no read can still be in flight

    @property
    def side(self) -> str:
        return "source" if self is HandoffState.PUBLISHED else "reader"

    @property
    def terminal(self) -> bool:
        return self in (HandoffState.READ_DONE, HandoffState.FAILED)


@dataclass(frozen=True)
class Change:
    """One difference between two consecutive snapshots (``ControlPlane.poll_changes``)."""

    kind: str                 #: ``instance_up``, ``instance_down``, ``handoff``, ``handoff_gone``
    name: str                 #: instance name, or ``source/request_id`` for handoffs
    record: Any = None        #: the new record (``InstanceRecord`` / ``HandoffPair``), the old one when gone
    reason: str = ""          #: for ``instance_down``: ``lease expired or deregistered`` / ``restarted``


@dataclass(frozen=True)
class Health:
    """What ``kvxfer info`` prints and what an engine checks before committing a pull."""

    backend: str
    endpoint: str
    ok: bool                                  #: the store answered and our lease (if any) is valid
    detail: str = ""
    server_version: str = ""
    name: str = ""
    incarnation: str = ""
    lease_id: int = 0
    lease_ttl_s: float = 0.0
    lease_remaining_s: float = 0.0            #: local, conservative: from the last acknowledged keepalive
    lease_lost: bool = False
    superseded: bool = False                  #: another process registered under our name since
    refused_records: int = 0                  #: records seen that failed verification (never acted on)
    counters: dict[str, int] = field(default_factory=dict)


class ControlPlane(abc.ABC):
    """A fleet control plane: registration, live set, handoff state, changes, health."""

    backend: str = ""

    @abc.abstractmethod
    def register(self, *, name: str, role: str, transfer_meta: Sequence[dict[str, Any]], capacity_blocks: int,
                 extra: Optional[dict[str, Any]] = None) -> Any:
        """Register this instance under a fresh lease and incarnation; returns its record."""

    @abc.abstractmethod
    def deregister(self) -> None:
        """Goodbye: drop this instance's lease, and with it every key it owns."""

    @abc.abstractmethod
    def snapshot(self) -> Any:
        """A verified ``FleetView`` of the live instances and handoffs."""

    def instances(self, role: Optional[str] = None) -> list[Any]:
        """The live instances (optionally of one role), verified."""
        return self.snapshot().live(role)

    @abc.abstractmethod
    def publish_handoff(self, request_id: str, *, reader: str, reader_incarnation: str,
                        descriptor: dict[str, Any]) -> None:
        """Prefill: a request's blocks are pinned and routed to ``reader`` (under our lease)."""

    @abc.abstractmethod
    def set_reader_state(self, source: str, request_id: str, state: HandoffState, *, source_incarnation: str,
                         detail: str = "") -> None:
        """Decode: our state for one handoff (under our lease); PULLING must be acknowledged before reading."""

    @abc.abstractmethod
    def clear_handoff(self, source: str, request_id: str) -> None:
        """Remove every key of one handoff (the source, once it has acted on a terminal state)."""

    @abc.abstractmethod
    def poll_changes(self) -> list[Change]:
        """What changed since the previous call (the first call reports everything as new)."""

    @abc.abstractmethod
    def health(self) -> Health:
        """The store's reachability and this instance's lease."""

    @abc.abstractmethod
    def lease_valid(self) -> bool:
        """False once our lease may have expired: a reader must not commit a pull then (self-fencing)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop keeping the lease alive and release connections (does not deregister)."""
