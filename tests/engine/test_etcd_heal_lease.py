"""A client whose etcd lease is gone takes a new one (issue 49, item 2; round 6's attack).

A client's requests and results live under its own lease. Round 6 found that a client
whose lease was gone never took a new one: revoked by the etcd user (who holds no cluster
key), or outlived by a pause past the TTL (a GC or VM pause; here ``SIGSTOP``). Its 4
requests in flight were lost in silence ("no result within 30s"), then 20 of 20 submits
raised ``LeaseGone``.

One fleet for the module (one prefill and one decode process on ``ucx``, a private secured
etcd, TTL 2 s, poll 0.1 s). The decode is paused (its compute only) while it holds the
client's requests, so that they are in flight when the lease goes. Then: every one of them
ends with an error that names the lost lease and who held the request (its answer was to be
written under that lease), and 20 new requests from the same client are served token-exact.

- the lease revoked by the etcd user, no cluster key, from outside (the in-process client);
- the client (a process of its own: ``etcd_support.ClientChild``) ``SIGSTOP``ped for three
  TTLs, then ``SIGCONT``ed;
- on the plane alone: of two requests in flight when the lease goes, the one a prefill claimed
  fails naming that prefill, and the one nobody took is sent again under the new lease.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from engine_integration.control_plane.etcd.client import EtcdGenerationClient
from engine_integration.control_plane.etcd.gateway import EtcdHttpClient
from engine_integration.control_plane.etcd.requests import DECODING, decode_result
from engine_integration.control_plane.etcd.store import EtcdConfig, EtcdStore
from engine_integration.launch import ClusterConfig, DisaggCluster, generate_colocated
from etcd_support import ClientChild, register_stand_in, wait_for

from engine_helpers import ETCD_PLANE, ETCD_TTL_S

pytestmark = [pytest.mark.usefixtures("etcd_required"), pytest.mark.timeout(240)]

NEW_TOKENS = 12
IN_FLIGHT, AFTER = 6, 20
SERVE_BOUND_S = 30.0


def _prompts(n: int, seed: int) -> list[list[int]]:
    return [[(seed * 89 + i * 43 + j * 7) % 256 for j in range(18 + (i * 5) % 19)] for i in range(n)]


_expected: dict[tuple[int, ...], tuple[int, ...]] = {}


def _tokens(prompts) -> list[tuple[int, ...]]:
    todo = [p for p in prompts if tuple(p) not in _expected]
    for p, r in zip(todo, generate_colocated(todo, NEW_TOKENS)):
        _expected[tuple(p)] = tuple(r.tokens)
    return [_expected[tuple(p)] for p in prompts]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    pause_dir = tmp_path_factory.mktemp("pause")
    config = ClusterConfig(backend="ucx", decode_blocks=128, request_timeout_s=60.0, transfer_timeout_s=20.0,
                           control_plane=ETCD_PLANE, pause_dir=str(pause_dir))
    with DisaggCluster(config) as cluster:
        warm = _prompts(4, 1)
        assert [r.tokens for r in cluster.generate(warm, NEW_TOKENS, timeout_s=60)] == _tokens(warm)
        yield cluster, pause_dir


def _decoding(cluster, client_name: str) -> set[str]:
    """The attempts of ``client_name`` that decode-0 committed and is decoding, read from etcd (verified)."""
    store = cluster.service.store
    out = set()
    for kv in store.range_raw(f"{store.layout.results}{client_name}/"):
        rec = decode_result(kv.key.decode(), kv.value, kv.lease, store.layout, store.cluster_key)
        if rec.state == DECODING and rec.by == "decode-0":
            out.add(rec.request_id)
    return out


def _check_lost(errors: list[str], lease: int) -> None:
    """Every request held when the lease went failed, naming the lease, why, and who held it."""
    for error in errors:
        assert f"lost its etcd lease {lease}" in error and "expired or was revoked" in error, errors
        assert "held attempt" in error and "decode 'decode-0'" in error, errors


def test_a_client_whose_lease_the_etcd_user_revoked_takes_a_new_one(fleet):
    cluster, pause_dir = fleet
    client = cluster.client
    service = cluster.service
    with open(service.password_file) as f:   # the etcd user's password; no cluster key
        stranger = EtcdHttpClient(list(service.store.config.endpoints), user="kvxfer", password=f.read().strip())
    (pause_dir / "decode-0").touch()
    try:
        ids = [client.submit(p, NEW_TOKENS) for p in _prompts(IN_FLIGHT, 2)]

        def all_held():   # the decode committed them all (it computes nothing while paused), and the client saw it
            client.poll()
            return len(_decoding(cluster, client.name)) == len(ids)
        assert wait_for(all_held, 30, 0.05), "the decode never held all the requests"
        client.poll()
        lease = client.lease
        stranger.lease_revoke(lease)
        revoked = time.monotonic()
        assert stranger.lease_ttl(lease) <= 0
    finally:
        (pause_dir / "decode-0").unlink()
        stranger.close()
    held = ids
    lost = client.collect(held, timeout_s=20)
    failed_in = time.monotonic() - revoked
    assert all(r.tokens is None for r in lost)
    _check_lost([r.error or "" for r in lost], lease)
    assert client.lease != lease

    prompts = _prompts(AFTER, 3)
    ids = [client.submit(p, NEW_TOKENS) for p in prompts]   # each raised LeaseGone before
    served = client.collect(ids, timeout_s=SERVE_BOUND_S)
    served_in = time.monotonic() - revoked
    assert [r.error for r in served] == [None] * AFTER
    assert [r.tokens for r in served] == _tokens(prompts)
    renewal = client.lease_renewals[-1]
    assert renewal["old"] == lease and sorted(renewal["failed"]) == sorted(held) and renewal["sent_again"] == []
    print(f"\nMEASURED client lease revoked by the etcd user under {IN_FLIGHT} held requests: all {IN_FLIGHT} failed "
          f"with the reason {failed_in:.2f}s after the revoke; {AFTER} new requests served token-exact "
          f"{served_in:.2f}s after it; error: {lost[0].error}")


def test_a_client_paused_past_three_ttls_takes_a_new_lease_and_is_served(fleet):
    cluster, pause_dir = fleet
    service = cluster.service
    child = ClientChild(cluster.address, service.password_file, service.secret_file)
    try:
        lease = int(child.ready["lease"])
        (pause_dir / "decode-0").touch()
        try:
            ids = child.do("submit", prompts=_prompts(IN_FLIGHT, 4), max_new_tokens=NEW_TOKENS)["ids"]
            assert wait_for(lambda: child.do("poll") and len(_decoding(cluster, child.ready["name"])) == len(ids),
                            30, 0.05), "the decode never held the child client's requests"
            child.do("poll")   # the client has seen them all decoding
            child.signal(signal.SIGSTOP)
            stopped = time.monotonic()
            assert wait_for(lambda: service.store.client.lease_ttl(lease) <= 0, 3 * ETCD_TTL_S + 5, 0.1), \
                "the paused client's lease never expired"
        finally:
            (pause_dir / "decode-0").unlink()   # the decode finishes them now: their answers have no lease to go under
        time.sleep(max(0.0, stopped + 3 * ETCD_TTL_S + 0.5 - time.monotonic()))
        child.signal(signal.SIGCONT)
        resumed = time.monotonic()
        reply = child.do("collect", timeout_s=40, ids=ids, wait_s=20)
        failed_in = time.monotonic() - resumed
        lost = reply["results"]
        assert all(tokens is None for tokens, _ in lost)
        _check_lost([error or "" for _, error in lost], lease)
        assert reply["lease"] != lease

        prompts = _prompts(AFTER, 5)
        ids = child.do("submit", prompts=prompts, max_new_tokens=NEW_TOKENS)["ids"]
        served = child.do("collect", timeout_s=SERVE_BOUND_S + 10, ids=ids, wait_s=SERVE_BOUND_S)["results"]
        served_in = time.monotonic() - resumed
        assert [error for _, error in served] == [None] * AFTER
        assert [tuple(tokens) for tokens, _ in served] == _tokens(prompts)
        print(f"\nMEASURED client SIGSTOPped {resumed - stopped:.1f}s (TTL {ETCD_TTL_S}s) under {IN_FLIGHT} held "
              f"requests: all {IN_FLIGHT} failed with the reason {failed_in:.2f}s after SIGCONT; {AFTER} new requests "
              f"served token-exact {served_in:.2f}s after it; error: {lost[0][1]}")
    finally:
        if child.proc.poll() is None:
            child.signal(signal.SIGCONT)
        child.stop()


def test_a_client_whose_lease_is_gone_sends_again_only_what_nobody_took(fleet):
    """The plane alone (a stand-in prefill registered in its own cluster prefix of the same etcd): of two
    requests in flight when the client's lease is revoked, the one the prefill claimed fails naming the
    prefill, and the one nobody took is sent again, as a new attempt under the new lease."""
    cluster, _ = fleet
    service = cluster.service
    with open(service.password_file) as f:
        password = f.read().strip()
    key = os.urandom(32)
    config = EtcdConfig(endpoints=tuple(service.store.config.endpoints), cluster="heal-plane", user="kvxfer",
                        password=password, cluster_key=key, ttl_s=ETCD_TTL_S, poll_interval_s=0.1, timeout_s=2.0)
    prefill, client_store = EtcdStore(config), EtcdStore(config)
    stranger = EtcdHttpClient(list(config.endpoints), user="kvxfer", password=password)
    client = None
    try:
        register_stand_in(prefill, "prefill-x", "prefill", key)
        client = EtcdGenerationClient(client_store)
        taken, waiting = client.submit([1, 2, 3], 4), client.submit([4, 5, 6], 4)
        requests = f"{prefill.layout.requests}prefill-x/"
        kv = next(kv for kv in prefill.range_raw(requests) if kv.key.decode().endswith(f"/{taken}"))
        assert prefill.claim(kv.key.decode(), kv.mod_revision, taken)   # as a prefill takes it
        old = client.lease
        stranger.lease_revoke(old)

        def renewed():
            client.poll()
            return client.lease != old
        assert wait_for(renewed, 3 * ETCD_TTL_S, 0.05), "the client never took a new lease"
        (result,) = client.collect([taken], timeout_s=1)
        assert result.tokens is None and f"lost its etcd lease {old}" in (result.error or "") \
            and "prefill 'prefill-x' held attempt" in (result.error or ""), result.error
        again = [kv for kv in prefill.range_raw(requests) if kv.key.decode().endswith(f"/{waiting}.2")]
        assert len(again) == 1 and again[0].lease == client.lease, "the request nobody took was not sent again"
        assert client.in_flight == 1 and client.lease_renewals[-1]["sent_again"] == [waiting]
    finally:
        if client is not None:
            client.close()
        stranger.close()
        prefill.deregister()
        prefill.close()
        client_store.close()
