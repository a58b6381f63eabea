"""Issue 15, item 6: pins freed after a reader's presumed death are safe, end to end.

A real cluster on a cross-process transport (nixl, ucx): a coordinator process, a prefill
engine in this process (so its allocator and pool can be inspected), and a decode process
that freezes itself with SIGSTOP right *after* posting its pull (frozen any earlier, the
coordinator's Abort would drop the StartDecode before any read, and nothing would be
proved). Then:

1. the coordinator removes the silent decode and, ``pin_grace_s`` later, presumes it dead
   and frees the prefill's pins of its torn-read-checked request (not before the grace);
2. the prefill reuses those blocks: its pool is tiny, and more requests, served by a second
   decode, overwrite them (their results still equal co-located generation);
3. SIGCONT: the zombie's import must fail its torn-read check (``TornReadError``), and it
   never admits the request, i.e. never commits the reused KV.

The decode side of this file (``python tests/engine/test_engine_frozen_reader.py``) reads its
settings, secret included, from stdin and reports on stdout, one JSON object per line.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as the frozen decode: make the repository importable
    sys.path.insert(0, str(ROOT))

SECRET = "frozen-reader-test-secret-0123456789"
HEARTBEAT_TIMEOUT_S = 1.0
PIN_GRACE_S = 1.0
PREFILL_BLOCKS = 5            # one 4-block prompt pinned leaves a single free block: reuse is forced
PROMPT_A = [(11 * j + 3) % 256 for j in range(15)]  # 4 blocks (tokens_per_block 4), read by the frozen decode
MAX_NEW = 3
REPORT = "frozen-decode: "


# --- the decode that freezes itself ------------------------------------------------------
def _emit(**fields) -> None:
    sys.stdout.write(REPORT + json.dumps(fields) + "\n")  # the transports log on stdout too
    sys.stdout.flush()


def frozen_decode_main() -> int:
    import torch

    from kvxfer.handoff.poll import KVPoll
    from engine_integration.worker import EngineSpec, build_engine

    torch.set_num_threads(1)
    settings = json.loads(sys.stdin.readline())
    spec = EngineSpec(role="decode", identity="d-frozen", num_blocks=64, backend=settings["backend"],
                      transfer_timeout_s=60.0, heartbeat_interval_s=0.1, coordinator_timeout_s=60.0,
                      secret=settings["secret"])
    engine = build_engine(spec, settings["address"])
    sink = engine._handoff_sink
    posted: list = []
    start_pull = sink._start_pull

    def start_pull_then_freeze(entry, meta):
        events = start_pull(entry, meta)
        rid = entry.descriptor.request_id
        if rid in sink._transferring and not posted:  # the read is posted (not yet checked): freeze now
            posted.append(rid)
            _emit(event="posted", request_id=rid, verified=entry.verified)
            os.kill(os.getpid(), signal.SIGSTOP)
            _emit(event="resumed", request_id=rid)
        return events

    sink._start_pull = start_pull_then_freeze
    on_event = engine._on_handoff_event

    def report(event) -> None:
        _emit(event="handoff", request_id=event.request_id, state=event.state.name, reason=event.reason,
              error=type(event.error).__name__ if event.error is not None else None,
              quarantine_cleared=event.quarantine_cleared)
        on_event(event)

    engine._on_handoff_event = report
    _emit(event="ready", pid=os.getpid())
    deadline = time.monotonic() + 120
    while not posted and time.monotonic() < deadline:
        wait = engine.serve_step()
        if wait and not posted:
            engine.socket.poll(int(wait * 1000) or 1)
    # Resumed. The coordinator has long removed us (and told us to shut down): drive the
    # handoff path directly until the posted request is settled one way or the other.
    settle = time.monotonic() + 30
    finished = []
    while time.monotonic() < settle:
        finished += [record["request_id"] for record in engine.step()]
        stats = engine.handoff_stats()
        if not engine.has_unfinished_requests() and stats["quarantined_blocks"] == 0:
            break
        time.sleep(0.002)
    admitted = [r.request_id for r in list(engine.running) + list(engine.waiting)]
    _emit(event="final", admitted=admitted, finished=finished, stats=engine.handoff_stats())
    try:
        engine.disconnect("frozen reader test done")
    except Exception as exc:  # the coordinator removed us long ago; closing must not mask the report
        _emit(event="disconnect-error", error=repr(exc))
    return 0


if __name__ == "__main__":
    sys.exit(frozen_decode_main())


# --- the test ----------------------------------------------------------------------------
import pytest  # noqa: E402
import torch  # noqa: E402

from engine_integration.control_plane.zmq.client import CoordinatorClient  # noqa: E402
from engine_integration.control_plane.zmq.coordinator import CoordinatorConfig, start_coordinator_process, stop_coordinator_process  # noqa: E402
from engine_integration.launch import generate_colocated  # noqa: E402
from engine_integration.worker import EngineSpec, build_engine, start_engine_host  # noqa: E402

torch.set_num_threads(1)

BACKENDS = ["nixl", "ucx"]  # not installed here: the test fails with the backend's own install hint


class FrozenDecode:
    """The decode process above, its stdout read into a queue by a thread."""

    def __init__(self, backend: str, address: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.proc.stdin.write(json.dumps({"backend": backend, "address": address, "secret": SECRET}) + "\n")
        self.proc.stdin.close()
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(REPORT):
                self.lines.put(json.loads(line[len(REPORT):]))
        self.lines.put({"event": "exit"})

    def expect(self, event: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the frozen decode did not report {event!r} within {timeout_s}s") from None
            if msg["event"] == event:
                return msg
            if msg["event"] == "exit":
                raise AssertionError(f"the frozen decode exited before reporting {event!r}")

    def state(self) -> str:
        with open(f"/proc/{self.proc.pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]

    def stopped_state(self, timeout_s: float = 5.0) -> str:
        """The state once the SIGSTOP it sends itself right after reporting "posted" has landed
        (under load the report can arrive first), or the last state seen."""
        deadline = time.monotonic() + timeout_s
        state = self.state()
        while state != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
            state = self.state()
        return state

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


class Pump:
    """Runs the in-process prefill's engine loop on a thread; ``lock`` to look inside it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop and self.engine.shutdown_reason is None:
            with self.lock:
                wait = self.engine.serve_step()
            time.sleep(min(wait, 0.01) or 0.0005)

    def stop(self) -> None:
        self._stop = True
        self.thread.join(10)


def _wait(predicate, timeout_s: float, what: str, lock: threading.Lock) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with lock:
            if predicate():
                return time.monotonic()
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout_s}s: {what}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_decode_fails_its_torn_read_check_after_its_pins_were_freed_and_reused(backend):
    coordinator, address = start_coordinator_process(CoordinatorConfig(
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, pin_grace_s=PIN_GRACE_S, request_timeout_s=60.0, secret=SECRET))
    frozen = FrozenDecode(backend, address)
    prefill = pump = client = starter = None
    host_box: list = []
    try:
        prefill = build_engine(EngineSpec(role="prefill", identity="p-frozen-test", num_blocks=PREFILL_BLOCKS,
                                          backend=backend, heartbeat_interval_s=0.1, secret=SECRET), address)
        pump = Pump(prefill)
        frozen.expect("ready", 90)
        client = CoordinatorClient(address, secret=SECRET)
        source = prefill._handoff_source
        alloc = prefill.context.allocator
        pool = prefill.context.kv_pool

        # 1. request A is prefilled, pinned and routed to the decode, which posts its read and freezes
        cid_a = client.submit(PROMPT_A, MAX_NEW)
        posted = frozen.expect("posted", 30)
        assert posted["verified"], "the decode's pull must be torn-read checked (generations in the descriptor)"
        assert frozen.stopped_state() == "T"
        frozen_at = time.monotonic()
        with pump.lock:
            [rid_a] = source.in_flight
            blocks_a = list(source._live[rid_a].descriptor.block_ids)
            generations_a = prefill._generations.snapshot(blocks_a)
            kv_a = pool[:, :, blocks_a].clone()
        assert len(blocks_a) == 4 and rid_a == posted["request_id"]

        # a second decode to serve what comes next (registering once A is routed does not change A)
        starter = threading.Thread(target=lambda: host_box.append(start_engine_host(
            [EngineSpec(role="decode", identity="d-live", num_blocks=64, backend=backend,
                        heartbeat_interval_s=0.1, secret=SECRET)], address)), daemon=True)
        starter.start()

        # 2. pins kept while the decode is merely silent, freed once it is presumed dead (grace past removal)
        freed_at = _wait(lambda: rid_a not in source.in_flight, 30, "the frozen reader's pins freed", pump.lock)
        assert freed_at - frozen_at >= PIN_GRACE_S + HEARTBEAT_TIMEOUT_S / 2, \
            f"pins freed {freed_at - frozen_at:.2f}s after the freeze: before removal + grace"
        [result_a] = client.collect([cid_a], 10)
        assert result_a.error is not None  # A failed to the client when its decode was removed

        # 3. the prefill reuses A's blocks: more requests through a tiny pool, served by the live decode
        starter.join(90)
        assert host_box, "the second decode did not start"
        reused: set = set()
        allocate = alloc.allocate

        def allocate_and_record(n):
            out = allocate(n)
            if out:
                reused.update(out)
            return out

        alloc.allocate = allocate_and_record
        prompts = [[(37 * i + 5 * j + 101) % 256 for j in range(13 + i % 3)] for i in range(4)]
        results = client.generate(prompts, MAX_NEW, timeout_s=60)
        assert [r.error for r in results] == [None] * len(prompts)
        assert [r.tokens for r in results] == [r.tokens for r in generate_colocated(prompts, MAX_NEW)]
        with pump.lock:
            assert set(blocks_a) <= reused, f"A's blocks {blocks_a} were not all reused ({sorted(reused)})"
            moved = [a != b for a, b in zip(generations_a, prefill._generations.snapshot(blocks_a))]
            overwritten = not torch.equal(pool[:, :, blocks_a], kv_a)
        assert all(moved) and overwritten
        assert frozen.state() == "T"  # still frozen through all of it

        # 4. the zombie wakes up: its import fails the torn-read check and nothing is committed
        os.kill(frozen.proc.pid, signal.SIGCONT)
        woke_at = time.monotonic()
        frozen.expect("resumed", 10)
        event = frozen.expect("handoff", 30)
        assert event["request_id"] == rid_a and event["state"] == "Failed", event
        assert event["error"] == "TornReadError" and "torn read detected" in event["reason"], event
        final = frozen.expect("final", 30)
        assert final["admitted"] == [] and rid_a not in final["finished"], final
        assert final["stats"]["quarantined_blocks"] == 0
        print(f"{backend}: frozen {woke_at - frozen_at:.1f}s; pins freed {freed_at - frozen_at:.2f}s after the "
              f"freeze (heartbeat timeout {HEARTBEAT_TIMEOUT_S}s + grace {PIN_GRACE_S}s); torn read reported "
              f"{time.monotonic() - woke_at:.2f}s after SIGCONT")
        with pump.lock:
            assert source.in_flight == [] and alloc.num_pinned == 0
    finally:
        if client is not None:
            client.close()
        frozen.stop()
        if starter is not None:
            starter.join(90)
        for host in host_box:
            host.stop()
        if pump is not None:
            pump.stop()
        if prefill is not None:
            prefill.disconnect("test done")
        stop_coordinator_process(coordinator, timeout_s=5)
