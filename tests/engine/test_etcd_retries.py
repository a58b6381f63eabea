"""Every etcd call the client repeats is idempotent (issue 22, item 3).

The HTTP gateway client repeats a call whose connection broke; when it broke *after* etcd
applied the request (the answer was lost), the repeat must not do it twice nor report the
first attempt's success as a failure. That failure is produced for real here: a loopback
proxy (``etcd_support.TcpProxy.lose_answers``) lets the request reach a real etcd, which
applies it, and resets the client's connection instead of passing the answer on. Seen once
in the wild: ``user name already exists`` while securing a fresh etcd.
"""

from __future__ import annotations

import threading

import pytest

from engine_integration.control_plane.etcd.gateway import EtcdHttpClient
from engine_integration.control_plane.etcd.records import KeyLayout
from engine_integration.control_plane.etcd.requests import RequestRecord
from engine_integration.control_plane.etcd.server import EtcdServer, secure_etcd
from etcd_support import TcpProxy, fresh_fleet, register_stand_in, secured_etcd

pytestmark = [pytest.mark.usefixtures("etcd_required"), pytest.mark.timeout(120)]

etcd = pytest.fixture(scope="module", name="etcd")(secured_etcd)


@pytest.fixture
def fleet(etcd):
    return fresh_fleet(etcd, "r")


@pytest.fixture
def proxy(etcd):
    p = TcpProxy(etcd[0].endpoint)
    yield p
    p.close()


_register = register_stand_in


def test_securing_a_fresh_etcd_survives_lost_answers():
    """Every call of ``secure`` loses its first answer once: users and roles already made, auth already on."""
    server = EtcdServer().start()
    proxy = TcpProxy(server.endpoint)
    try:
        for path, n in ((b"/v3/auth/user/add", 2), (b"/v3/auth/user/grant", 2), (b"/v3/auth/role/add", 1),
                        (b"/v3/auth/role/grant", 1), (b"/v3/auth/enable", 1)):
            proxy.lose_answers(path, n)
        secure_etcd([proxy.endpoint], root_password="root-pw", user="kvxfer", password="kv-pw")
        assert proxy.lost_answers == 7   # two user adds and two grants, a role add and grant, the enable
        user = EtcdHttpClient([server.endpoint], user="kvxfer", password="kv-pw")
        user.put(b"/kvxfer/x", b"1")
        with pytest.raises(Exception, match="permission denied"):
            user.put(b"/elsewhere", b"1")
        anonymous = EtcdHttpClient([server.endpoint])
        with pytest.raises(Exception):
            anonymous.put(b"/kvxfer/y", b"1")
        user.close(), anonymous.close()
    finally:
        proxy.close()
        server.stop()


def test_a_lease_grant_whose_answer_is_lost_makes_one_lease(fleet, proxy):
    client = EtcdHttpClient([proxy.endpoint], user=fleet.user, password=fleet.password)
    before = set(client.leases())
    proxy.lose_answers(b"/v3/lease/grant", 1)
    lease, ttl = client.lease_grant(5)
    assert proxy.lost_answers == 1 and client.retried_calls == 1
    assert set(client.leases()) - before == {lease} and 0 < ttl <= 5   # one lease: the first attempt's
    client.lease_revoke(lease)
    client.close()


def test_a_claim_whose_answer_is_lost_is_neither_lost_nor_doubled(fleet, proxy):
    prefill = fleet.plane(endpoints=(proxy.endpoint,))
    client = fleet.plane()
    try:
        me = _register(prefill, "p0", "prefill", fleet.cluster_key)
        lease, _ = client.client.lease_grant(10)
        layout = KeyLayout(fleet.cluster)
        for rid in ("c.1", "c.2"):
            rec = RequestRecord(rid, "c", lease, "p0", me.incarnation, (1, 2, 3), 2)
            client.put_record(layout.request("p0", rid), rec.body(), lease)
        [kv1, kv2] = prefill.range_raw(f"{layout.requests}p0/")
        proxy.lose_answers(b"/v3/kv/txn", 1)
        assert prefill.claim(kv1.key.decode(), kv1.mod_revision, "c.1") is True   # applied, answer lost: ours
        assert proxy.lost_answers == 1
        assert prefill.claim(kv1.key.decode(), kv1.mod_revision, "c.1") is False  # nothing left to take twice
        mark = client.read(layout.claim("p0", "c.1"))
        assert mark is not None and mark.value.startswith(me.incarnation.encode()) and mark.lease == me.lease
        # a request rewritten since it was read is not taken on the old reading
        client.put_record(layout.request("p0", "c.2"), RequestRecord("c.2", "c", lease, "p0", me.incarnation,
                                                                     (9,), 1).body(), lease)
        assert prefill.claim(kv2.key.decode(), kv2.mod_revision, "c.2") is False
        [kv2b] = prefill.range_raw(f"{layout.requests}p0/")
        assert prefill.claim(kv2b.key.decode(), kv2b.mod_revision, "c.2") is True
        assert prefill.range_raw(f"{layout.requests}p0/") == []
        prefill.clear_handoff("p0", "c.1")   # a handoff's end drops the claim with it
        assert client.read(layout.claim("p0", "c.1")) is None
        client.client.lease_revoke(lease)
    finally:
        prefill.deregister(), prefill.close(), client.close()


def test_concurrent_claims_take_each_request_exactly_once(fleet):
    """Two takers (the prefill and a client taking its request back) race on 40 requests: one wins each."""
    a, b, client = fleet.plane(), fleet.plane(), fleet.plane()
    try:
        me = _register(a, "p0", "prefill", fleet.cluster_key)
        _register(b, "p1", "prefill", fleet.cluster_key)
        lease, _ = client.client.lease_grant(10)
        layout = KeyLayout(fleet.cluster)
        for i in range(40):
            rec = RequestRecord(f"c.{i}", "c", lease, "p0", me.incarnation, (1,), 1)
            client.put_record(layout.request("p0", f"c.{i}"), rec.body(), lease)
        kvs = a.range_raw(f"{layout.requests}p0/")
        wins: dict[str, list[str]] = {kv.key.decode(): [] for kv in kvs}

        def take(store, who):
            for kv in kvs:
                if store.claim(kv.key.decode(), kv.mod_revision, kv.key.decode().rsplit("/", 1)[1]):
                    wins[kv.key.decode()].append(who)

        threads = [threading.Thread(target=take, args=(s, w)) for s, w in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(len(w) == 1 for w in wins.values()), wins
        client.client.lease_revoke(lease)
    finally:
        for s in (a, b):
            s.deregister(), s.close()
        client.close()


def test_guarded_writes_and_registration_resolve_their_own_lost_answer(fleet, proxy):
    store = fleet.plane(endpoints=(proxy.endpoint,))
    try:
        proxy.lose_answers(b"/v3/kv/txn", 1)   # the registration's guarded put
        me = _register(store, "d0", "decode", fleet.cluster_key)
        assert proxy.lost_answers == 1 and store.snapshot().instances["d0"].incarnation == me.incarnation
        layout = KeyLayout(fleet.cluster)
        key = layout.result("c", "c.1")
        proxy.lose_answers(b"/v3/kv/txn", 1)
        revision = store.create_record(key, {"kind": "x", "n": 1}, me.lease)
        assert revision and proxy.lost_answers == 2          # created once, by us, though unanswered
        assert store.create_record(key, {"kind": "x", "n": 2}, me.lease) is None   # exists: not ours to create
        proxy.lose_answers(b"/v3/kv/txn", 1)
        again = store.update_record(key, {"kind": "x", "n": 3}, me.lease, revision)
        assert again and again > revision
        assert store.update_record(key, {"kind": "x", "n": 4}, me.lease, revision) is None   # stale revision
    finally:
        store.deregister(), store.close()
