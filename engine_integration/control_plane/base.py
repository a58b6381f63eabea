"""What an engine needs from a control plane, and what a launcher needs to run one.

A control plane is where a fleet's engines meet: it registers them (refusing one whose KV
geometry or model differs), brings each prefill its requests, routes each pinned prompt
to a decode, tells the decode where to read, and tells the prefill when its pins may go.
kvxfer has two, one package each, behind the same three contracts:

- ``ControlPlane``: the engine's side. ``DisaggDynamicInferenceEngine`` takes one
  (``engine.connect(plane, ...)``) and calls it from its loop; the plane calls back only
  the engine's public handoff methods (``PlaneEngine``). ``zmq.CoordinatorPlane`` speaks
  to a coordinator process; ``etcd.EtcdPlane`` keeps its state in etcd, no coordinator.
- ``GenerationClient``: submit prompts, collect results in input order.
- ``PlaneService``: the fleet side a launcher starts and stops on one machine
  (the coordinator process; or an etcd, reached or started in demo mode).

Policy (compatibility, admission, routing) is not here and not in either package: both
call ``control_plane.policy``. Nothing here does I/O.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from kvxfer.errors import KVXferError

RequestId = int | str


class ControlPlaneError(KVXferError):
    """A control-plane operation failed; the message says what to check."""


class ControlPlaneUnavailable(ControlPlaneError):
    """The control-plane store could not be reached within the configured time."""


class RegistrationRefused(KVXferError):
    """The control plane refused this engine; the message says why (e.g. a geometry mismatch)."""


@dataclass(frozen=True)
class GenerationResult:
    """One prompt's outcome: ``tokens`` or an ``error`` saying why not."""

    tokens: Optional[tuple[int, ...]]
    error: Optional[str] = None
    timings: dict[str, float] = field(default_factory=dict)
    cached_prefix_blocks: int = 0      #: prompt blocks the decode reused from its own cache
    pulled_blocks: int = 0             #: prompt blocks it pulled from the prefill
    decode: Optional[str] = None       #: the decode instance that served it (None: not known)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class FleetStats:
    """A fleet's figures as a client sees them (the coordinator's ``wire.Stats`` has these fields and more)."""

    engines: dict[str, dict[str, Any]]      #: name -> its last load figures, with ``alive``
    requests_in_flight: int


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


class PlaneEngine(Protocol):
    """The engine as a control plane sees it (``DisaggDynamicInferenceEngine`` implements it)."""

    role: Optional[str]
    identity: str
    backend_name: str
    is_push: bool
    shutdown_reason: Optional[str]

    @property
    def transfer_meta(self) -> list[dict[str, Any]]: ...
    @property
    def model_fingerprint(self) -> str: ...
    @property
    def capacity_blocks(self) -> int: ...
    def add_request(self, request_id: RequestId, prompt: Sequence[int], max_new_tokens: int) -> None: ...
    def add_peer_transfer_meta(self, identity: str, metas: Sequence[dict[str, Any]]) -> None: ...
    def add_handoff(self, descriptor: Any, max_new_tokens: int) -> None: ...
    def release_handoff(self, request_id: RequestId) -> bool: ...
    def push_handoff(self, request_id: RequestId, decode_metas: Sequence[dict[str, Any]],
                     skip_blocks: int = 0) -> None: ...
    def abort_request(self, request_id: RequestId, reason: str) -> None: ...
    def handoff_stats(self) -> dict[str, int]: ...
    def recent_evictions(self) -> list[int]: ...
    def take_pull_stats(self, request_id: RequestId) -> Any: ...
    def set_commit_guard(self, guard: Optional[Callable[[RequestId], Optional[str]]]) -> None: ...


class ControlPlane(abc.ABC):
    """The engine's side of a control plane; the engine loop calls it, it calls ``PlaneEngine``.

    Per ``serve_step`` the engine calls ``poll`` (act on what the plane says), runs one
    engine step, hands every finished record to ``finished``, then ``tick`` (heartbeats,
    load figures); between those the engine reports its handoffs as they happen
    (``publish`` on a prefill, ``handoff_event`` on a decode).
    """

    kind: str = ""                 #: ``zmq`` / ``etcd``
    supports_push: bool = False    #: push backends (``nccl``) need the plane to carry Megatron's SEND_KV
    #: where ``supports_push`` is False: why, in a user's words
    push_refused_because: str = "it does not carry Megatron's push order (the decode's ask, after its receives are posted)"

    @abc.abstractmethod
    def attach(self, engine: PlaneEngine, *, timeout_s: float) -> None:
        """Register ``engine`` (set up for its role already); ``RegistrationRefused`` with the reason."""

    @abc.abstractmethod
    def poll(self) -> int:
        """Act on what the plane says now (requests, peer metas, handoffs, releases, aborts); how many."""

    @abc.abstractmethod
    def publish(self, request_id: RequestId, descriptor: Any, prefill_s: float) -> None:
        """Prefill: the request's blocks are pinned and described; route it to a decode."""

    @abc.abstractmethod
    def transfer_ready(self, request_id: RequestId, cached_prefix_blocks: int, stats: Any) -> None:
        """Decode: the request's KV is committed here and it is decoding (``stats``: ``sink.PullStats``)."""

    @abc.abstractmethod
    def read_done(self, request_id: RequestId, failure: str = "") -> None:
        """Decode: no read of this request can still be in flight; its source may release the pins.

        ``failure`` is empty after a committed pull, else why the pull failed."""

    @abc.abstractmethod
    def pull_failed(self, request_id: RequestId, reason: str) -> None:
        """Decode: the request failed here (its pull failed, was refused or aborted)."""

    @abc.abstractmethod
    def finished(self, record: Mapping[str, Any]) -> None:
        """A request ended in the engine's step: ``{"request_id", "tokens"}`` or ``{"request_id", "error"}``."""

    def request_push(self, request_id: RequestId, skip_blocks: int) -> None:
        """Decode, push backends: our receives are posted; have the prefill push (Megatron's SEND_KV)."""
        raise RuntimeError(f"the {self.kind} control plane does not carry pushes")

    def push_failed(self, request_id: RequestId, reason: str) -> None:
        """Prefill, push backends: a push of ours failed (its pins are released already)."""

    def tick(self) -> None:
        """Once per ``serve_step``, after the engine step: heartbeats, load figures."""

    def wait_s(self) -> float:
        """How long an idle engine loop may sleep before the plane needs ``poll`` again."""
        return 0.05

    @property
    def wake_socket(self) -> Any:
        """A zmq socket that turns readable when the plane has news (``None``: poll on a timer)."""
        return None

    def figures(self) -> dict[str, int]:
        """The plane's own load figures, added to ``engine.handoff_stats()``."""
        return {}

    def health(self) -> Optional[Health]:
        """The plane's reachability (``None`` where the plane has nothing to say)."""
        return None

    @abc.abstractmethod
    def detach(self, reason: str = "") -> None:
        """Goodbye: leave the fleet and release connections; idempotent."""


class GenerationClient(abc.ABC):
    """Submit prompts to a fleet and collect each one's ``GenerationResult``, matched by id."""

    @abc.abstractmethod
    def submit(self, prompt: Sequence[int], max_new_tokens: int) -> Any:
        """Send one request; returns its id (a refused one's result is ready at once)."""

    @abc.abstractmethod
    def collect(self, ids: Sequence[Any], timeout_s: float) -> list[GenerationResult]:
        """Results for ``ids`` in that order; one not back within ``timeout_s`` is an error result."""

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 timeout_s: float = 120.0) -> list[GenerationResult]:
        ids = [self.submit(p, max_new_tokens) for p in prompts]
        return self.collect(ids, timeout_s)

    @abc.abstractmethod
    def stats(self) -> Any:
        """``FleetStats``-shaped figures: ``engines`` (name -> figures with ``alive``), ``requests_in_flight``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections (and on etcd the client's lease, with its requests and results)."""


class PlaneService(abc.ABC):
    """A control plane's fleet side, as ``launch.DisaggCluster`` runs it on one machine."""

    url: str = ""   #: what engines connect to: ``tcp://host:port`` or ``etcd://user@host:port/cluster?...``

    @abc.abstractmethod
    def start(self) -> None:
        """Bring the plane up (a coordinator process; an etcd reached, or started and secured)."""

    @abc.abstractmethod
    def engine_options(self) -> dict[str, Any]:
        """``EngineSpec`` fields an engine process needs to join (they travel on its pipe, never in argv)."""

    @property
    @abc.abstractmethod
    def client(self) -> GenerationClient:
        """This machine's client of the fleet (made on first use)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop what ``start`` started; idempotent."""
