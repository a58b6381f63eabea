"""Engine soak on the etcd control plane (issue 16): many handoffs through ``generate``, nothing left behind.

A private, secured etcd on loopback (TTL 2 s, poll 0.1 s), one prefill and one decode
process on ``ucx``, short prompts (1-3 tokens), 2 new tokens each, submitted in windows of
``WINDOW`` requests. At the end: every result token-exact, nothing pinned, queued,
running, reading or quarantined on either engine, every decode block free, and no
handoff, request or result key left in etcd; after both engines exit (SIGTERM: goodbye),
their instance and stats keys and their leases are gone (only the test client's lease,
revoked last, remains).

``KVXFER_ETCD_SOAK_N`` sets the count (default 1,000: about 11 s of handoffs, 16 s for the
whole test on this 2-core machine; numbers in docs/fleet.md). The rate is printed
(``pytest -s``).
"""

from __future__ import annotations

import os
import time

import pytest

from engine_integration import procs
from engine_integration.launch import ClusterConfig, DisaggCluster, generate_colocated

from engine_helpers import ETCD_PLANE, engine_idle, short_prompts

pytestmark = [pytest.mark.usefixtures("etcd_required"), pytest.mark.timeout(240)]

DEFAULT_N = int(os.environ.get("KVXFER_ETCD_SOAK_N", "1000"))
WINDOW = 50
NEW_TOKENS = 2
DECODE_BLOCKS = 128


def test_soak_handoffs_through_generate_leave_nothing_behind():
    n = DEFAULT_N
    prompts = short_prompts(n)
    distinct = {tuple(p) for p in prompts}
    expected = {p: r.tokens for p, r in zip(distinct, generate_colocated([list(p) for p in distinct], NEW_TOKENS))}
    config = ClusterConfig(backend="ucx", decode_blocks=DECODE_BLOCKS, prefill_blocks=512, request_timeout_s=60.0,
                           transfer_timeout_s=20.0, control_plane=ETCD_PLANE)
    with DisaggCluster(config) as cluster:
        client, plane = cluster.client, cluster.service.store
        cluster.generate(prompts[:4], NEW_TOKENS, timeout_s=60)   # warm-up (not counted): transports connected
        t0 = time.monotonic()
        results = []
        for start in range(0, n, WINDOW):
            results.extend(cluster.generate(prompts[start:start + WINDOW], NEW_TOKENS, timeout_s=60))
        elapsed = time.monotonic() - t0
        print(f"\netcd engine soak: {n} handoffs through generate in {elapsed:.1f}s = {n / elapsed:.1f}/s "
              f"(window {WINDOW}, ucx, TTL 2 s, poll 0.1 s)")
        assert [r.error for r in results] == [None] * n
        assert [r.tokens for r in results] == [expected[tuple(p)] for p in prompts]
        assert all(r.pulled_blocks + r.cached_prefix_blocks >= 1 for r in results)

        # nothing pinned, reserved, queued, reading or quarantined (figures published every 0.2 s)
        stats = cluster.wait_for_stats(lambda s: s.requests_in_flight == 0
                                       and engine_idle(s.engines.get("prefill-0", {}))
                                       and engine_idle(s.engines.get("decode-0", {}), DECODE_BLOCKS), timeout_s=10)
        assert stats.engines["prefill-0"]["pins"] == 0
        layout = plane.layout
        for prefix in (layout.handoffs, layout.requests, layout.results):
            left = [kv.key.decode() for kv in plane.range_raw(prefix)]
            assert left == [], f"keys left under {prefix}: {left[:5]} ({len(left)})"

        # both engines exit (SIGTERM: goodbye revokes the lease): their keys and leases go with them
        instance_leases = {rec.lease for rec in client.view().live()}
        assert len(instance_leases) == 2
        for host in list(cluster.hosts):
            procs.stop(host.process, 10.0, terminate_first=True)
        cluster.hosts.clear()
        leases = set(plane.client.leases())
        assert not instance_leases & leases, (instance_leases, leases)
        assert leases == {client.lease}, leases   # only the test client's own, revoked at close
        left = [kv.key.decode() for kv in plane.range_raw(layout.root)]
        assert left == [], f"keys left in etcd after both engines exited: {left}"
