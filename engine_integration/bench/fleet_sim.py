"""Plane-only simulated engines and the counters ``fleet_scale`` reads: real control planes, no KV.

A ``SimEngine`` is what a control plane sees of an engine (``control_plane.base.PlaneEngine``)
and nothing more: a prefill "computes" a request at once, pins made-up block ids and
publishes a real ``HandoffDescriptor`` through its plane; a decode takes the handoff, asks
the plane's commit guard, reports ``transfer_ready`` / ``read_done`` and finishes with the
prompt as its tokens. No byte of KV moves, so what is measured is the control plane alone:
the real ``EtcdPlane`` / ``CoordinatorPlane`` code, a real etcd or a real coordinator process.

Counting never changes what a plane does: on etcd every ``EtcdHttpClient``'s one request
method (``_http``) is wrapped from here and each call is recorded as an event (time, HTTP
path and the kind of key it touches: ``put:handoffs``, ``txn:delete:requests``,
``range:snapshot``...); for ZeroMQ the coordinator process is started from here with its
channel's ``receive`` and its ``send`` wrapped, so every message is recorded by type and
direction where the whole fleet's traffic passes. Events carry ``time.monotonic()`` (one
clock for every process of this machine) so the driver can cut them into windows.

Run as ``python -m engine_integration.bench.fleet_sim <payload fd> <ready fd>`` (``engine_integration.procs``):
a *host* process (many sim engines on one loop) or the *coordinator*.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import sys
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from kvxfer.meta.agreement import AGREED_FIELDS
from kvxfer.meta.version import WIRE_VERSION

#: its module's name, written out: run with ``python -m`` (a process of its own), ``__name__`` is "__main__"
log = logging.getLogger("engine_integration.bench.fleet_sim")

TOKENS_PER_BLOCK = 4
FINGERPRINT = "fleet-scale-sim"
#: what every sim instance registers as its transfer meta: a value for each field the policy compares
#: (``kvxfer.meta.agreement.AGREED_FIELDS``, checked by ``_check_geometry`` at import)
GEOMETRY = {"schema_version": WIRE_VERSION, "backend": "local", "dtype": "float32", "element_size": 4,
            "tokens_per_block": TOKENS_PER_BLOCK, "heads_per_partition": 2, "head_dim": 16, "num_outer": 4,
            "bytes_per_slice": 512}



def _check_geometry() -> None:
    missing = set(AGREED_FIELDS) - set(GEOMETRY)
    if missing:
        raise AssertionError(f"fleet_sim.GEOMETRY lacks the agreed fields {sorted(missing)}")


_check_geometry()


def sim_meta(name: str, key: Optional[bytes], pad_bytes: int = 0) -> dict[str, Any]:
    """A sealed transfer meta like a backend's ``export_meta()``; ``pad_bytes`` of opaque agent data
    stand in for a real transport's blob (a NIXL agent's metadata is kilobytes)."""
    from kvxfer.meta.seal import HOST_FIELD, host_identity, seal_meta

    meta = {**GEOMETRY, "agent": name, "pid": os.getpid(), HOST_FIELD: host_identity()}
    if pad_bytes:
        meta["agent_blob"] = base64.b64encode(os.urandom(pad_bytes * 3 // 4)).decode()
    return seal_meta(meta, key)


def serial_of(prompt: Sequence[int]) -> int:
    """The benchmark's request serial: the first prompt token (how timings are joined across processes)."""
    return int(prompt[0])


class SimEngine:
    """One prefill or decode instance as its control plane sees it (``PlaneEngine``), with no model.

    ``timeline[serial]`` records when each step of a handoff happened here (``time.monotonic``):
    prefill ``add`` (request taken), ``publish``, ``release`` (pins freed); decode ``start``
    (handoff taken), ``commit`` (``read_done`` reported), ``finish``.
    """

    backend_name = "local"
    is_push = False

    def __init__(self, plane: Any, role: str, identity: str, *, capacity_blocks: int, meta: dict[str, Any]) -> None:
        self.plane, self.role, self.identity = plane, role, identity
        self.shutdown_reason: Optional[str] = None
        self._capacity = capacity_blocks
        self._meta = meta
        self._guard: Optional[Callable[[Any], Optional[str]]] = None
        self._waiting: list[tuple[Any, list[int], int]] = []
        self._handoffs: list[tuple[Any, int]] = []
        self._pinned: dict[Any, int] = {}               # request id -> blocks pinned (prefill)
        self._serials: dict[Any, int] = {}              # request id -> serial
        self._next_block = 0
        self.peers: dict[str, int] = {}                 # prefill identity -> metas received
        self.timeline: dict[int, dict[str, float]] = {}
        self.aborted = 0

    # --- what a plane reads ---------------------------------------------------------------
    @property
    def transfer_meta(self) -> list[dict[str, Any]]:
        return [self._meta]

    @property
    def model_fingerprint(self) -> str:
        return FINGERPRINT

    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    def handoff_stats(self) -> dict[str, int]:
        pinned = sum(self._pinned.values())
        figures = {"free_blocks": self._capacity - pinned, "pinned_blocks": pinned, "pins": len(self._pinned),
                   "queued": len(self._waiting) + len(self._handoffs), "running": 0, "quarantined_blocks": 0, "evictions": 0}
        figures.update(self.plane.figures())
        return figures

    def recent_evictions(self) -> list[int]:
        """A simulated pool caches nothing, so it evicts nothing (the planes report it like a real one)."""
        return []

    # --- what a plane calls ---------------------------------------------------------------
    def _mark(self, request_id: Any, step: str, serial: Optional[int] = None) -> None:
        serial = self._serials.get(request_id) if serial is None else serial
        if serial is not None:
            self.timeline.setdefault(serial, {})[step] = time.monotonic()

    def add_request(self, request_id: Any, prompt: Sequence[int], max_new_tokens: int) -> None:
        self._serials[request_id] = serial_of(prompt)
        self._mark(request_id, "add")
        self._waiting.append((request_id, list(prompt), max_new_tokens))

    def add_peer_transfer_meta(self, identity: str, metas: Sequence[dict[str, Any]]) -> None:
        self.peers[identity] = len(metas)

    def add_handoff(self, descriptor: Any, max_new_tokens: int) -> None:
        self._serials[descriptor.request_id] = serial_of(descriptor.prompt)
        self._mark(descriptor.request_id, "start")
        self._handoffs.append((descriptor, max_new_tokens))

    def release_handoff(self, request_id: Any) -> bool:
        if self._pinned.pop(request_id, None) is None:
            return False
        self._mark(request_id, "release")
        return True

    def push_handoff(self, request_id: Any, decode_metas: Sequence[dict[str, Any]], skip_blocks: int = 0) -> None:
        raise RuntimeError("sim engines pull; they never push")

    def abort_request(self, request_id: Any, reason: str) -> None:
        self.aborted += 1
        self._waiting = [w for w in self._waiting if w[0] != request_id]
        self._handoffs = [h for h in self._handoffs if h[0].request_id != request_id]

    def take_pull_stats(self, request_id: Any) -> None:
        return None

    def set_commit_guard(self, guard: Optional[Callable[[Any], Optional[str]]]) -> None:
        self._guard = guard

    # --- the loop (``DisaggDynamicInferenceEngine.serve_step``'s order) -------------------------
    def step(self) -> list[dict[str, Any]]:
        """Prefill: compute (nothing), pin and publish each waiting request. Decode: "pull" each handoff
        (nothing moves), commit it through the guard, report, finish it."""
        from engine_integration.descriptor import HandoffDescriptor

        finished: list[dict[str, Any]] = []
        waiting, self._waiting = self._waiting, []
        for request_id, prompt, _ in waiting:
            blocks = -(-len(prompt) // TOKENS_PER_BLOCK)
            ids = tuple((self._next_block + i) % self._capacity for i in range(blocks))
            self._next_block = (self._next_block + blocks) % self._capacity
            self._pinned[request_id] = blocks
            serial = self._serials[request_id]
            descriptor = HandoffDescriptor(request_id, self.identity, 0, ids,
                                           tuple(serial * 1000 + i for i in range(len(prompt) // TOKENS_PER_BLOCK)),
                                           tuple(prompt), (1,), tuple(1 for _ in ids))
            self._mark(request_id, "publish")
            self.plane.publish(request_id, descriptor, 0.0)
        handoffs, self._handoffs = self._handoffs, []
        for descriptor, _ in handoffs:
            rid = descriptor.request_id
            refused = self._guard(rid) if self._guard is not None else None
            if refused is not None:
                self.plane.pull_failed(rid, refused)
                self.plane.read_done(rid, refused)
                continue
            self.plane.transfer_ready(rid, 0, None)
            self._mark(rid, "commit")
            self.plane.read_done(rid)
            finished.append({"request_id": rid, "tokens": list(descriptor.prompt) + [1]})
            self._mark(rid, "finish")
        return finished

    def serve_step(self) -> float:
        plane = self.plane
        handled = plane.poll()
        if self.shutdown_reason is not None:
            return plane.wait_s()
        busy = bool(self._waiting or self._handoffs)
        for record in self.step():
            plane.finished(record)
        plane.tick()
        return 0.0 if handled or busy else plane.wait_s()


def serve_all(engines: Sequence[SimEngine], *, idle_wait_s: float = 0.05) -> None:
    """Step every engine in turn, on one thread, until each is told to stop; sleep as their planes ask."""
    import zmq

    poller = None
    if all(e.plane.wake_socket is not None for e in engines):
        poller = zmq.Poller()
        for engine in engines:
            poller.register(engine.plane.wake_socket, zmq.POLLIN)
    while any(e.shutdown_reason is None for e in engines):
        wait = min([idle_wait_s] + [e.serve_step() for e in engines if e.shutdown_reason is None])
        if wait > 0:
            poller.poll(int(wait * 1000) or 1) if poller is not None else time.sleep(wait)


# --- counting etcd calls at the HTTP boundary ------------------------------------------------
def etcd_op_kind(path: str, body: Optional[Mapping[str, Any]], root: str) -> str:
    """What one gateway call is, by path and the kind of key it touches (``put:handoffs``,
    ``txn:put:results``, ``range:snapshot``, ``lease/keepalive``...)."""
    op = path.removeprefix("/v3/").removeprefix("kv/")
    if not body or not isinstance(body, Mapping):
        return op
    key, range_end = body.get("key"), body.get("range_end")
    if op == "txn":
        first = (body.get("success") or [{}])[0]   # what a kvxfer txn does is its first success operation
        request, inner = next(iter(first.items()), ("request_none", {}))
        op = "txn:" + request.removeprefix("request_").replace("_range", "")
        key = inner.get("key")
    if not isinstance(key, str):
        return op
    text = base64.b64decode(key).decode(errors="replace")
    kind = text[len(root):].split("/", 1)[0] if text.startswith(root) else "other"
    if op == "range" and kind == "handoffs" and range_end is not None:
        kind = "snapshot"   # handoffs/ .. instances/: ``EtcdStore.snapshot``
    return f"{op}:{kind}"


def count_etcd_calls(client: Any, root: str, events: list, who: str) -> None:
    """Record every call ``client`` (an ``EtcdHttpClient``) makes: ``(start, who, kind, seconds)``, in ``events``.

    Wraps the instance's one request method; what the call does and answers is unchanged."""
    inner = client._http

    def counted(method: str, path: str, body: Any, token: Any, timeout_s: Any = None, **kw: Any) -> Any:
        started = time.monotonic()
        try:
            return inner(method, path, body, token, timeout_s, **kw)
        finally:
            events.append((started, who, etcd_op_kind(path, body, root), time.monotonic() - started))

    client._http = counted


# --- the processes ----------------------------------------------------------------------------
def _etcd_plane(spec: Mapping[str, Any], events: list, who: str) -> Any:
    from engine_integration.control_plane.etcd.plane import EtcdPlane
    from engine_integration.control_plane.etcd.store import EtcdStore

    store = EtcdStore(etcd_config(spec))
    count_etcd_calls(store.client, store.layout.root, events, who)
    return EtcdPlane(store)


def etcd_config(spec: Mapping[str, Any]) -> Any:
    """The ``EtcdConfig`` of a run (``spec``: endpoint, cluster, password, cluster key hex, ttl, poll)."""
    from engine_integration.control_plane.etcd.store import EtcdConfig

    return EtcdConfig(endpoints=(spec["endpoint"],), cluster=spec["cluster"], user="kvxfer",
                      password=spec["password"], cluster_key=bytes.fromhex(spec["cluster_key"]),
                      ttl_s=int(spec["ttl_s"]), poll_interval_s=float(spec["poll_s"]),
                      timeout_s=float(spec.get("timeout_s", 3.0)))


def host_main(spec: Mapping[str, Any], ready_fd: int) -> None:
    """Build and attach this host's sim engines, report ready, serve until SIGTERM, then write
    ``{"events", "timelines", ...}`` to ``spec["out"]``."""
    from engine_integration.control_plane.zmq.plane import CoordinatorPlane
    from engine_integration import procs

    events: list = []
    key = bytes.fromhex(spec["cluster_key"]) if spec["plane"] == "etcd" else spec["secret"].encode()
    engines = []
    for role, name in spec["engines"]:
        if spec["plane"] == "etcd":
            plane = _etcd_plane(spec, events, role)
        else:
            plane = CoordinatorPlane(spec["address"], secret=spec["secret"])
        engine = SimEngine(plane, role, name, capacity_blocks=int(spec["capacity_blocks"]),
                           meta=sim_meta(name, key if spec["plane"] == "etcd" else None, int(spec["meta_pad"])))
        plane.attach(engine, timeout_s=30.0)
        engines.append(engine)

    def stop(signum: int, _frame: Any) -> None:
        for engine in engines:
            engine.shutdown_reason = engine.shutdown_reason or f"signal {signum}"

    signal.signal(signal.SIGTERM, stop)
    procs.report({"pid": os.getpid(), "engines": len(engines)}, ready_fd)
    serve_all(engines)
    counters = {e.identity: getattr(getattr(e.plane, "store", None), "counters", {}) for e in engines}
    for engine in engines:
        engine.plane.detach("benchmark done")
    with open(spec["out"], "w") as fh:
        json.dump({"events": events, "counters": counters,
                   "timelines": {e.identity: {"role": e.role, "steps": e.timeline, "aborted": e.aborted,
                                              "shutdown": e.shutdown_reason} for e in engines}}, fh)


def coordinator_main(spec: Mapping[str, Any], ready_fd: int) -> None:
    """A real coordinator whose every message in and out is recorded; events written to ``spec["out"]`` at exit."""
    from engine_integration import procs
    from engine_integration.control_plane.zmq.coordinator import Coordinator, CoordinatorConfig

    coord = Coordinator(CoordinatorConfig(secret=spec["secret"]))
    events: list = []
    receive, send = coord.channel.receive, coord.send

    def counted_receive() -> Any:
        got = receive()
        events.append((time.monotonic(), "in", type(got[1]).__name__ if got is not None else "handshake"))
        return got

    def counted_send(zmq_id: bytes, msg: Any) -> None:
        events.append((time.monotonic(), "out", type(msg).__name__))
        send(zmq_id, msg)

    coord.channel.receive, coord.send = counted_receive, counted_send
    procs.report({"address": coord.address, "pid": os.getpid()}, ready_fd)
    coord.serve()
    with open(spec["out"], "w") as fh:
        json.dump({"events": events}, fh)


def main(argv: Optional[Sequence[str]] = None) -> None:
    from engine_integration import procs

    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = procs.read_payload(int(args[0]))
    (coordinator_main if spec["kind"] == "coordinator" else host_main)(spec, int(args[1]))


if __name__ == "__main__":
    main()
