"""The control-plane operations of one handoff, counted on both planes (issue 22, item 6).

A 1 x 1 plane-only fleet (``engine_integration.bench.fleet_sim``: the real ``EtcdPlane`` and
``CoordinatorPlane`` in real host processes, a real secured etcd, a real coordinator
process) runs a few handoffs through ``engine_integration.bench.fleet_scale.run_point``, which counts
every etcd gateway call and every coordinator message in the window. The writes of a
handoff and its messages are fixed by the protocol; a change that multiplies them (a
second publish, a claim per poll, a message per block) fails here. Idle polls, keepalives
and heartbeats are bounded by their configured rates.
"""

from __future__ import annotations

import pytest

from engine_integration.bench.fleet_scale import FleetPoint, run_point

from etcd_support import secured_etcd

pytestmark = pytest.mark.timeout(120)

etcd = pytest.fixture(scope="module", name="etcd")(secured_etcd)

#: every write of one handoff on etcd, by who makes it (``fleet_sim.etcd_op_kind``)
ETCD_WRITES = {
    "client put:requests": 1,             # the request, under the client's lease
    "prefill txn:delete:requests": 1,     # the claim: delete the request + write our claim, guarded
    "prefill put:handoffs": 1,            # publish the source key
    "decode txn:put:handoffs": 1,         # PULLING, guarded on the source key's revision
    "decode txn:put:results": 2,          # the commit guard creates the result (decoding), then it is done
    "decode put:handoffs": 1,             # READ_DONE
    "prefill txn:delete:handoffs": 1,     # clear the handoff's keys and the claim
    "client deleterange:results": 1,      # the client took its result
}
#: every message of one handoff through the coordinator (both directions)
ZMQ_MESSAGES = {"in Submit": 1, "out AddRequest": 1, "in HandoffReady": 1, "out StartDecode": 1,
                "in TransferReady": 1, "in ReadDone": 1, "out Release": 1, "in Finished": 1, "out Result": 1}


def _writes(ops: dict) -> dict:
    return {op: v["per_handoff"] for op, v in ops.items()
            if any(w in op for w in ("put:", "txn:", "deleterange:")) and "stats" not in op}


@pytest.mark.usefixtures("etcd_required")
def test_etcd_handoff_ops_counted(etcd):
    point = FleetPoint("etcd", 1, 1, handoffs=6, in_flight=3, idle_s=2.0, ttl_s=2, poll_s=0.1, hosts=2)
    result = run_point(point, etcd)
    assert result["ok"] == point.handoffs
    assert _writes(result["ops"]) == ETCD_WRITES
    ops = result["ops"]
    # idle: one snapshot per poll per instance, a prefill's look at its requests per poll, a keepalive and a
    # look at its own record per TTL/3, its load figures again every 2 s; nothing else while no request is in flight
    assert ops["decode range:snapshot"]["idle_per_instance_s"] <= 1.3 / point.poll_s
    assert ops["prefill range:requests"]["idle_per_instance_s"] <= 1.3 / point.poll_s
    assert ops["prefill lease/keepalive"]["idle_per_instance_s"] <= 2.0 * 3 / point.ttl_s
    idle_writes = [op for op, v in ops.items() if v["idle_per_instance_s"] and op.split()[1].startswith(("put", "txn"))]
    assert idle_writes == ["decode put:stats", "prefill put:stats"], idle_writes
    assert all(ops[op]["idle_per_instance_s"] <= 1.0 for op in idle_writes)
    assert result["etcd"]["snapshot_keys"] == 2            # two instance records, no handoff left
    assert 9 <= result["etcd"]["revisions_per_handoff"] < 11   # 9 writes, plus load figures as they change


def test_zmq_handoff_messages_counted():
    point = FleetPoint("zmq", 1, 1, handoffs=6, in_flight=3, idle_s=2.0, hosts=2)
    result = run_point(point)
    assert result["ok"] == point.handoffs
    ops = result["ops"]
    per_handoff = {op: v["per_handoff"] for op, v in ops.items() if op not in ("in Heartbeat", "out Registered")}
    assert per_handoff == ZMQ_MESSAGES
    # idle: each engine heartbeats every 0.2 s and the coordinator answers each
    assert ops["in Heartbeat"]["idle_per_instance_s"] <= 6.5
    assert ops["out Registered"]["idle_per_instance_s"] <= 6.5
