"""Fleet faults through the engine on a real etcd (issue 22, item 3): nothing lost, nothing served twice.

One fleet for the module: a private, secured etcd on loopback (TTL 2 s, poll 0.1 s), two
prefill and two decode processes on ``ucx``; ``decode-1`` reaches etcd through a loopback
proxy the test can cut. Each fault happens mid-traffic, to real processes:

- a prefill ``kill -9``ed while it holds requests it claimed and has not prefilled (and
  others mid-pull): every request is run again on the other prefill and answered once;
- a prefill ``SIGSTOP``ped for three TTLs, then resumed: its lease is gone, so it fences
  itself, drops what it held, registers again as a new incarnation (same process) and
  serves again; its requests were run again elsewhere meanwhile;
- a decode cut off from etcd for two TTLs mid-pull: it commits nothing past its lease,
  its requests run again on the other decode, and once etcd answers it registers again
  and serves;
- a decode whose keepalive answers are lost (etcd renews its lease, it never hears): it
  fences itself for a moment, pulls completed then are refused at commit and run again,
  and it serves on as the same incarnation, holding nothing afterwards.

"Answered once" is checked where it could break: every request has exactly one result,
token-exact against co-located generation, and the decodes together committed exactly
one pull per answered request (an attempt given up is never committed: ``commits``). At
the end nothing is pinned, queued or quarantined and etcd holds no handoff, request,
claim or result key. Figures are printed (``pytest -s``) for docs/fleet.md.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from engine_integration.launch import ClusterConfig, DisaggCluster, generate_colocated
from etcd_support import TcpProxy, wait_for

from engine_helpers import ETCD_PLANE, ETCD_TTL_S

pytestmark = [pytest.mark.usefixtures("etcd_required"), pytest.mark.timeout(240)]

DECODE_BLOCKS = 64
NEW_TOKENS = 12
PREFILLS, DECODES = ("prefill-0", "prefill-1"), ("decode-0", "decode-1")


@pytest.fixture(scope="module")
def fleet():
    config = ClusterConfig(backend="ucx", decode_blocks=DECODE_BLOCKS, prefill_blocks=1024, request_timeout_s=60.0,
                           transfer_timeout_s=20.0, control_plane=ETCD_PLANE)
    with DisaggCluster(config) as cluster:
        store = cluster.service.store
        proxy = TcpProxy(store.config.endpoints[0])
        cut_url = cluster.address.replace(store.config.endpoints[0], proxy.endpoint)
        cluster.start_engine(cluster.spec("prefill", "prefill-1"))
        cluster.start_engine(cluster.spec("decode", "decode-1", control_plane=cut_url))
        try:
            yield cluster, proxy
        finally:
            proxy.close()


def _prompts(n: int, seed: int) -> list[list[int]]:
    return [[(seed * 131 + i * 37 + j * 11) % 256 for j in range(36 + (i * 7) % 24)] for i in range(n)]


_expected: dict[tuple[int, ...], tuple[int, ...]] = {}


def _check_answers(prompts, results) -> None:
    """One result per request, every one with tokens, token-exact."""
    todo = [p for p in prompts if tuple(p) not in _expected]
    for p, r in zip(todo, generate_colocated(todo, NEW_TOKENS)):
        _expected[tuple(p)] = r.tokens
    assert [r.error for r in results] == [None] * len(prompts)
    assert [r.tokens for r in results] == [_expected[tuple(p)] for p in prompts]


def _figures(cluster, name):
    return cluster.stats().engines.get(name, {})


def _commits(cluster) -> int:
    return sum(_figures(cluster, d).get("commits", 0) for d in DECODES)


def _idle(s, names=PREFILLS + DECODES) -> bool:
    engines = [s.engines.get(n, {}) for n in names]
    return s.requests_in_flight == 0 and all(
        e.get("alive") and e.get("pins") == 0 and e.get("queued") == 0 and e.get("running") == 0
        and e.get("quarantined_blocks") == 0 and e.get("published") == 0 and e.get("reads") == 0
        and e.get("awaiting_death") == 0 for e in engines)


def _settled(cluster) -> None:
    """Nothing pinned, queued, running or quarantined anywhere; no handoff, request, claim or result left."""
    cluster.wait_for_stats(_idle, timeout_s=30)
    store = cluster.service.store
    layout = store.layout
    cluster.client.poll()

    def empty():
        cluster.client.poll()   # removes the results of given-up attempts after their grace
        return all(store.range_raw(prefix) == [] for prefix in (layout.handoffs, layout.requests, layout.claims,
                                                                layout.results))
    assert wait_for(empty, 4 * ETCD_TTL_S, 0.2), {
        p: [kv.key.decode() for kv in store.range_raw(p)] for p in (layout.handoffs, layout.requests,
                                                                   layout.claims, layout.results)}


def _claimed_not_published(cluster, prefill: str) -> int:
    store = cluster.service.store
    claims = {kv.key.decode().rsplit("/", 1)[1] for kv in store.range_raw(f"{store.layout.claims}{prefill}/")}
    published = {kv.key.decode().split("/")[-2] for kv in store.range_raw(f"{store.layout.handoffs}{prefill}/")}
    return len(claims - published)


def _run(cluster, prompts, fault, timeout_s: float = 60.0, survivors=PREFILLS + DECODES):
    """Submit ``prompts``, inject ``fault()`` (returns the wall-clock time it started), collect; (results,
    seconds from the fault to the last answer, pulls committed meanwhile, "a-b s" from the fault to the
    first and last attempt run again)."""
    client = cluster.client
    before, logged = _commits(cluster), len(client.reroute_log)
    ids = [client.submit(p, NEW_TOKENS) for p in prompts]
    started = fault()
    results = client.collect(ids, timeout_s=timeout_s)   # the client keeps polling while the fault lasts
    answered = time.time() - started
    for timer in _timers:
        timer.join()
    _timers.clear()
    cluster.wait_for_stats(lambda s: _idle(s, survivors), timeout_s=30)   # back and reporting their figures
    again = [entry["at"] - started for entry in client.reroute_log[logged:]]
    rerouted = f"{min(again):.2f}-{max(again):.2f}s" if again else "-"
    return results, answered, _commits(cluster) - before, rerouted


_timers: list[threading.Timer] = []


def _later(delay_s: float, action) -> None:
    """End a fault ``delay_s`` from now, while the test's client goes on collecting."""
    timer = threading.Timer(delay_s, action)
    timer.start()
    _timers.append(timer)


def _registered_again(cluster, old, since: float):
    """(the new incarnation of ``old``'s name, seconds from ``since`` (wall clock) to its registration);
    the same process must have registered it."""
    def new():
        now = cluster.client.view().instances.get(old.name)
        return now if now is not None and now.incarnation != old.incarnation else None

    again = wait_for(new, 15, 0.02)
    assert again is not None, f"{old.name} never registered again"
    assert again.pid == old.pid and again.host == old.host, "registered again by another process"
    return again, again.started_at - since


def test_warm_up(fleet):
    cluster, _ = fleet
    prompts = _prompts(8, seed=1)
    _check_answers(prompts, cluster.generate(prompts, NEW_TOKENS, timeout_s=60))
    _settled(cluster)


def test_a_prefill_killed_holding_claimed_requests_they_run_on_the_other_prefill_once(fleet):
    cluster, _ = fleet
    client = cluster.client
    reroutes = client.reroutes
    prompts = _prompts(40, seed=2)

    def kill():
        assert wait_for(lambda: _claimed_not_published(cluster, "prefill-0") >= 2, 20, 0.002), \
            "prefill-0 never held claimed requests it had not handed off"
        held = _claimed_not_published(cluster, "prefill-0")
        t = time.time()
        cluster.host_of("prefill-0").kill()
        print(f"\nkill -9 of prefill-0 holding {held} claimed requests it had not handed off")
        return t

    results, answered, commits, rerouted = _run(cluster, prompts, kill, survivors=("prefill-1",) + DECODES)
    _check_answers(prompts, results)
    print(f"MEASURED prefill kill -9: {client.reroutes - reroutes} run again on prefill-1 {rerouted} after the kill, "
          f"all {len(prompts)} answered {answered:.2f}s after it, {commits} pulls committed")
    assert client.reroutes - reroutes >= 2
    assert commits == len(prompts), "a request was committed twice (or an answer came from nowhere)"
    cluster.start_engine(cluster.spec("prefill", "prefill-0"))   # the fleet as it was, for the next test
    _settled(cluster)


def test_a_prefill_paused_three_ttls_fences_registers_again_and_serves(fleet):
    cluster, _ = fleet
    client = cluster.client
    reroutes = client.reroutes
    host = cluster.host_of("prefill-0")
    old = client.view().instances["prefill-0"]
    taken_before = _figures(cluster, "prefill-0").get("taken", 0)
    prompts = _prompts(30, seed=3)
    marks: dict[str, float] = {}

    def pause():
        assert wait_for(lambda: _claimed_not_published(cluster, "prefill-0") >= 1, 20, 0.002)
        os.kill(host.pid, signal.SIGSTOP)
        marks["stopped"] = time.time()
        _later(3 * ETCD_TTL_S, lambda: (os.kill(host.pid, signal.SIGCONT), marks.update(resumed=time.time())))
        return marks["stopped"]

    results, answered, commits, rerouted = _run(cluster, prompts, pause)
    _check_answers(prompts, results)
    again, registered = _registered_again(cluster, old, since=marks["resumed"])
    assert again.pid == host.pid, "it must come back as a new incarnation of the same process"
    print(f"\nMEASURED prefill SIGSTOP {3 * ETCD_TTL_S}s: {client.reroutes - reroutes} run again {rerouted} after the "
          f"stop, all {len(prompts)} answered {answered:.2f}s after it; registered again {registered:.2f}s after SIGCONT "
          f"(pid {again.pid}, incarnation {old.incarnation} -> {again.incarnation}); {commits} pulls committed")
    assert commits == len(prompts)
    assert client.reroutes - reroutes >= 1
    figures = _figures(cluster, "prefill-0")
    assert figures.get("reincarnations") == 1 and host.alive()
    # it serves again, without a restart
    more = _prompts(12, seed=4)
    _check_answers(more, cluster.generate(more, NEW_TOKENS, timeout_s=60))
    assert cluster.wait_for_stats(lambda s: s.engines["prefill-0"].get("taken", 0) > taken_before, timeout_s=5)
    _settled(cluster)


def test_a_decode_cut_off_from_etcd_past_its_lease_commits_nothing_stale_and_serves_again(fleet):
    cluster, proxy = fleet
    client = cluster.client
    store = cluster.service.store
    old = client.view().instances["decode-1"]
    commits_before = _figures(cluster, "decode-1").get("commits", 0)
    prompts = _prompts(30, seed=5)
    marks: dict[str, float] = {}

    def reading():   # decode-1 holds a pull in flight (its reader key says so)
        return [kv for kv in store.range_raw(store.layout.handoffs)
                if kv.key.endswith(b"/reader") and b'"owner":"decode-1"' in kv.value and b'"pulling"' in kv.value]

    def cut():
        assert wait_for(reading, 20, 0.002), "decode-1 never pulled"
        proxy.cut()
        marks["cut"] = time.time()
        _later(2 * ETCD_TTL_S, lambda: (proxy.restore(), marks.update(restored=time.time())))
        return marks["cut"]

    reroutes = client.reroutes
    results, answered, commits, rerouted = _run(cluster, prompts, cut)
    _check_answers(prompts, results)
    again, registered = _registered_again(cluster, old, since=marks["restored"])
    print(f"\nMEASURED decode etcd cut {2 * ETCD_TTL_S}s: {client.reroutes - reroutes} run again {rerouted} after the "
          f"cut, all {len(prompts)} answered {answered:.2f}s after it; registered again {registered:.2f}s after etcd "
          f"answered again; {commits} pulls committed")
    assert commits == len(prompts)
    figures = _figures(cluster, "decode-1")
    assert figures.get("reincarnations") == 1
    more = _prompts(16, seed=6)
    _check_answers(more, cluster.generate(more, NEW_TOKENS, timeout_s=60))
    assert _figures(cluster, "decode-1").get("commits", 0) > commits_before, "decode-1 never served again"
    _settled(cluster)


def test_a_decode_whose_keepalive_answers_are_lost_fences_keeps_its_lease_and_serves_on(fleet):
    """etcd renews the lease (the keepalives reach it) but the decode never hears: past its local
    deadline it fences itself (commits nothing, acts on nothing) while the fleet still counts it alive.
    When the answers come again it is valid again, as the same incarnation: nothing to re-register.
    Pulls completed inside the fence are refused at commit and run again (answered once); the leader's
    loss in a 3-member etcd can fence an instance the same way (test_engine_etcd_cluster_soak.py)."""
    cluster, proxy = fleet
    client = cluster.client
    old = client.view().instances["decode-1"]
    before = _figures(cluster, "decode-1")
    prompts = _prompts(30, seed=7)
    lost = 8   # keepalive requests (and the gateway's repeats of them) whose answers are dropped: > one TTL

    def lose():
        proxy.lose_answers(b"/v3/lease/keepalive", lost)
        return time.time()

    reroutes = client.reroutes
    results, answered, commits, rerouted = _run(cluster, prompts, lose)
    _check_answers(prompts, results)
    assert wait_for(lambda: proxy.lost_answers >= lost, 20, 0.05), "the keepalive answers were not all dropped"
    now = client.view().instances["decode-1"]
    after = _figures(cluster, "decode-1")
    refused = after.get("refused_commits", 0) - before.get("refused_commits", 0)
    print(f"\nMEASURED decode keepalive answers lost ({lost}): {refused} commits refused while fenced, "
          f"{client.reroutes - reroutes} run again {rerouted}, all {len(prompts)} answered {answered:.2f}s after the "
          f"first loss; same incarnation {now.incarnation == old.incarnation}; {commits} pulls committed")
    assert now.incarnation == old.incarnation and now.lease == old.lease, "the lease was lost: etcd renewed it"
    assert after.get("reincarnations") == before.get("reincarnations")
    assert commits == len(prompts)
    _settled(cluster)   # nothing pinned or read (a pull refused at commit used to stay counted), nothing left
