"""The etcd fleet heals itself after etcd loses its state (issue 49, item 2; round 6's attack).

Round 6 restored etcd from an older snapshot under a live fleet: 8 requests in flight got
"no result within 60s", nothing was served in the next 69 s, and both engines lived on and
never registered again. Two causes: every process kept an auth token whose Raft index was
ahead of the restored etcd, which *holds* such a request until it is cancelled (the 1 s
attempt timeout fired first, for ever); and nobody noticed that etcd's revision had gone
backwards, so nobody started again.

Here, with real processes (one prefill and one decode on ``ucx``, TTL 2 s, poll 0.1 s) and
a real, secured etcd run by the test:

- ``restored``: a cold copy of etcd's data taken right after it was secured (the "early
  snapshot") is put back under the running fleet (etcd stopped, data replaced, started
  again on the same ports);
- ``wiped``: etcd's data is removed and etcd started empty on the same ports, then secured
  again with the same password (what an operator rebuilding it does).

The decode is paused (its compute only: ``ClusterConfig.pause_dir``) with 8 requests held,
so that they are in flight when etcd loses its state. Then: every one of the 8 ends with an
error that says etcd went back in time (not a timeout), the engines register again as new
incarnations of the same processes, and 20 new requests are served token-exact within 30 s
of etcd answering again, nobody restarted by hand. Figures print with ``pytest -s``.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from engine_integration.control_plane.etcd.requests import DECODING, decode_result
from engine_integration.control_plane.etcd.server import EtcdServer
from engine_integration.launch import ClusterConfig, DisaggCluster, generate_colocated
from etcd_support import password_file, wait_for

pytestmark = [pytest.mark.usefixtures("etcd_required"), pytest.mark.timeout(300)]

NEW_TOKENS = 12
IN_FLIGHT, AFTER = 8, 20
HEAL_BOUND_S = 30.0


def _prompts(n: int, seed: int) -> list[list[int]]:
    return [[(seed * 97 + i * 41 + j * 13) % 256 for j in range(20 + (i * 5) % 17)] for i in range(n)]


@pytest.fixture
def etcd(tmp_path):
    """A secured etcd and a cold copy of its data taken right after it was secured."""
    server = EtcdServer(data_dir=str(tmp_path / "etcd")).start()
    password, root = "kv-" + os.urandom(8).hex(), os.urandom(8).hex()
    server.secure(root_password=root, user="kvxfer", password=password)
    server.kill()
    early = tmp_path / "early-snapshot"
    shutil.copytree(os.path.join(server.data_dir, "member"), early)
    server.start()
    try:
        yield server, password, root, str(early)
    finally:
        server.stop()


def _lose_state(how: str, server: EtcdServer, password: str, root: str, early: str) -> float:
    """etcd loses its state under the fleet; the monotonic time it answers again."""
    server.kill()
    member = os.path.join(server.data_dir, "member")
    shutil.rmtree(member)
    if how == "restored":
        shutil.copytree(early, member)
        server.start()
    else:
        server.start()
        server.secure(root_password=root, user="kvxfer", password=password)
    return time.monotonic()


@pytest.mark.parametrize("how", ["restored", "wiped"])
def test_etcd_losing_its_state_mid_traffic_heals_the_fleet(etcd, tmp_path, how):
    server, password, root, early = etcd
    pause_dir = tmp_path / "pause"
    pause_dir.mkdir()
    config = ClusterConfig(backend="ucx", decode_blocks=128, request_timeout_s=60.0, transfer_timeout_s=20.0,
                           control_plane=f"etcd://kvxfer@{server.endpoint}/heal?ttl=2&poll=0.1",
                           etcd_password_file=password_file(tmp_path, password), pause_dir=str(pause_dir))
    warm, held, after = _prompts(4, 1), _prompts(IN_FLIGHT, 2), _prompts(AFTER, 3)
    expected = [r.tokens for r in generate_colocated(warm + after, NEW_TOKENS)]
    with DisaggCluster(config) as cluster:
        client = cluster.client
        assert [r.tokens for r in cluster.generate(warm, NEW_TOKENS, timeout_s=60)] == expected[:len(warm)]
        before = {n: client.view().instances[n] for n in ("prefill-0", "decode-0")}

        (pause_dir / "decode-0").touch()   # the decode takes and commits the requests, then computes nothing
        ids = [client.submit(p, NEW_TOKENS) for p in held]

        def all_held():   # the decode committed them all and is decoding them (read from etcd, verified)
            store = cluster.service.store
            states = [decode_result(kv.key.decode(), kv.value, kv.lease, store.layout, store.cluster_key).state
                      for kv in store.range_raw(f"{store.layout.results}{client.name}/")]
            return states.count(DECODING) == len(ids)
        assert wait_for(all_held, 30, 0.05), f"the decode never held all {len(ids)} requests"

        back = _lose_state(how, server, password, root, early)
        (pause_dir / "decode-0").unlink()
        lost = client.collect(ids, timeout_s=HEAL_BOUND_S)
        lost_at = time.monotonic() - back
        errors = [r.error or "" for r in lost]
        assert all(r.tokens is None for r in lost), "a request held across the loss was answered"
        assert all("went back in time" in e for e in errors), errors   # the reason, never a timeout

        t0 = time.monotonic()
        new_ids = [client.submit(p, NEW_TOKENS) for p in after]
        served = client.collect(new_ids, timeout_s=max(1.0, HEAL_BOUND_S - (time.monotonic() - back)))
        healed = time.monotonic() - back
        assert [r.error for r in served] == [None] * AFTER
        assert [r.tokens for r in served] == expected[len(warm):]
        assert healed <= HEAL_BOUND_S

        view = client.view()
        for name, old in before.items():   # the same processes, registered again: nobody restarted them
            now = view.instances.get(name)
            assert now is not None and now.incarnation != old.incarnation, f"{name} never registered again"
            assert (now.pid, now.host) == (old.pid, old.host), f"{name} was restarted, not healed"
        renewals = [r for r in client.lease_renewals if r["rewound"]]
        assert renewals, "the client never took a new lease"
        tokens = cluster.service.store.client.token_drops
        wall_back = time.time() - (time.monotonic() - back)
        print(f"\nMEASURED etcd {how} under {IN_FLIGHT} held requests: all {IN_FLIGHT} failed with the reason "
              f"{lost_at:.2f}s after etcd answered again; {AFTER} new requests submitted {t0 - back:.2f}s after it, "
              f"all served token-exact {healed:.2f}s after it; registered again (s after it): "
              + ", ".join(f"{n} {view.instances[n].started_at - wall_back:.2f}" for n in before)
              + f"; client token drops {tokens}; first error: {errors[0][:160]}")
