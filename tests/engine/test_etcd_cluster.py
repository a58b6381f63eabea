"""The etcd plane on a real three-member etcd cluster losing members (issue 22, item 3).

Three etcd processes on loopback form one Raft cluster (``etcd_support.secured_cluster``);
a store is given every member's endpoint. A member killed (``kill -9``) costs a call one
refused connection; the leader killed mid-call makes the members still up answer
"leader changed" / "request timed out" (gRPC code 14) until they have elected another,
and the gateway asks again, next member first. Such a call may already have been
applied, so it counts as repeated, and every repeated write must still be idempotent:
two prefills race to claim the same requests while the leader dies under them, and each
request is taken exactly once. Leases outlive the election (the new leader renews them),
so nobody is declared dead. Figures are printed (``pytest -s``) for docs/fleet.md.

Why a follower is started again before the leader is killed: a three-member cluster
survives one lost member. With a follower and then the leader down, one member of three
is left, no quorum: etcd serves nothing (that is Raft, not a fault kvxfer could hide), and
every instance fences itself as with a single etcd killed (``test_etcd_control_plane.py``).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from engine_integration.control_plane.etcd.gateway import EtcdHttpClient
from etcd_support import Fleet, register_stand_in, secured_cluster, wait_for

pytestmark = [pytest.mark.usefixtures("etcd_required"), pytest.mark.timeout(180)]

etcd_cluster = pytest.fixture(scope="module", name="etcd_cluster")(secured_cluster)


def _fleet(etcd_cluster, name: str) -> Fleet:
    cluster, password = etcd_cluster
    return Fleet(endpoint=cluster.endpoints[0], endpoints=tuple(cluster.endpoints), user="kvxfer", password=password,
                 cluster_key=os.urandom(32), cluster=name)


def _leader(etcd_cluster):
    cluster, password = etcd_cluster
    return cluster.leader(user="kvxfer", password=password, timeout_s=20)


def test_two_prefills_claiming_while_the_leader_dies_take_each_request_once(etcd_cluster):
    cluster, password = etcd_cluster
    fleet = _fleet(etcd_cluster, "claims")
    leader = _leader(etcd_cluster)
    followers = [m.endpoint for m in cluster.members if m is not leader]
    # each claimer asks a follower first: the follower forwards to the leader, and answers "leader
    # changed" for what was in flight when it died
    claimers = [fleet.plane(timeout_s=5.0, endpoints=(f, *[e for e in cluster.endpoints if e != f]))
                for f in followers]
    writer = EtcdHttpClient(cluster.endpoints, user="kvxfer", password=password, timeout_s=5.0)
    try:
        for i, store in enumerate(claimers):
            register_stand_in(store, f"p{i}", "prefill", fleet.cluster_key)
        layout = claimers[0].layout
        n = 300
        keys = [f"{layout.requests}p/r{i}" for i in range(n)]
        revisions = [writer.put(k.encode(), b"request") for k in keys]
        won: list[list[int]] = [[], []]
        slowest = [0.0, 0.0]

        def claim_all(who: int) -> None:
            order = range(n) if who == 0 else range(n - 1, -1, -1)   # they meet in the middle and race
            for i in order:
                t = time.monotonic()
                if claimers[who].claim(keys[i], revisions[i], f"r{i}"):
                    won[who].append(i)
                claimers[who].snapshot()   # a linearizable read, as every poll makes
                slowest[who] = max(slowest[who], time.monotonic() - t)
                time.sleep(0.004)

        threads = [threading.Thread(target=claim_all, args=(who,)) for who in (0, 1)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        leader.kill()   # mid-stream: calls in flight to and through it
        for t in threads:
            t.join(120)
        repeated = sum(s.client.retried_calls for s in claimers)
        unavailable = sum(s.client.unavailable_answers for s in claimers)
        print(f"\nMEASURED leader kill -9 under claims: {len(won[0])} + {len(won[1])} of {n} taken, slowest claim "
              f"{max(slowest):.2f}s, {repeated} calls repeated, {unavailable} 'unavailable' answers asked again")
        assert sorted(won[0] + won[1]) == list(range(n)), "a request was lost or taken twice"
        assert writer.range_prefix(layout.requests.encode())[1] == []
        claims = writer.range_prefix(layout.claims.encode())[1]
        assert len(claims) == n   # exactly one claim mark per request, under its winner's lease
        assert all(not s.health().lease_lost for s in claimers)
        new_leader = _leader(etcd_cluster)
        assert new_leader is not leader
        leader.start()   # back with its data, for the next test
    finally:
        for store in claimers:
            store.deregister(), store.close()
        writer.close()


def test_a_follower_then_the_leader_lost_leases_live_on_and_writes_go_through(etcd_cluster):
    cluster, _ = etcd_cluster
    fleet = _fleet(etcd_cluster, "members")
    store = fleet.plane(timeout_s=5.0)
    try:
        me = register_stand_in(store, "d0", "decode", fleet.cluster_key)
        pauses: dict[str, float] = {}
        for loss in ("follower", "leader"):
            leader = _leader(etcd_cluster)
            victim = leader if loss == "leader" else next(m for m in cluster.members if m is not leader)
            victim.kill()
            t0 = time.monotonic()
            worst = 0.0
            while time.monotonic() - t0 < 4 * fleet.ttl_s:   # writes and snapshots through the loss
                t = time.monotonic()
                store.publish_handoff("r", reader="d1", reader_incarnation="i", descriptor={})
                assert "d0" in store.snapshot().instances
                worst = max(worst, time.monotonic() - t)
                time.sleep(0.02)
            pauses[loss] = worst
            assert not store.health().lease_lost, f"the lease was lost with the {loss}"
            assert wait_for(store.lease_valid, 10), "never valid again"
            victim.start()   # back with its data: three members again
        assert store.snapshot().instances["d0"].incarnation == me.incarnation   # never registered again
        assert store.client.lease_ttl(me.lease) > 0
        print(f"\nMEASURED 3-member etcd, plane: follower kill -9 -> slowest call {pauses['follower']:.2f}s; "
              f"leader kill -9 -> slowest call {pauses['leader']:.2f}s; lease kept, same incarnation; "
              f"{store.client.failovers} failovers, {store.client.unavailable_answers} 'unavailable' answers")
    finally:
        store.deregister(), store.close()
