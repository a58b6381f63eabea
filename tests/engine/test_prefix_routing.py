"""Prefix-aware routing, end to end on both control planes (issue 22, item 4).

A real fleet per plane (the ZeroMQ coordinator; a private, secured etcd): one prefill and
two decode processes of the reference engine on ``ucx``. Prompts share the prefixes of two
families. Checked, on each plane, from the results the client gets (which decode served a
request, how many prompt blocks it reused from its own cache and how many it pulled):

- a request whose family a decode has cached goes to that decode, which reuses the prefix
  (``cached_prefix_blocks``) and pulls only the rest;
- while that decode has no room (a long request of the family holds its whole pool), the
  next request of the family goes to the other decode and pulls everything. The long
  request is held on its decode (``ClusterConfig.pause_dir``: that decode computes nothing
  while its pause file exists, its plane and pulls go on) until the test has seen its pool
  full and routed the next request: a state a test waits for must last until it is seen,
  and the load figures are sampled (issue 26: a blocker that finished between two samples
  was never seen on a fast machine, and a slow one could finish it before the next request);
- every token equals co-located generation.

The routing decision itself, on a table of fleets and on both planes alike, is in
``tests/engine/test_plane_policy.py``; the pure pieces (eviction reports, eviction order) are here.
"""

from __future__ import annotations

import os
import time

import pytest

from engine_integration.control_plane.policy import RoutedPrefixes
from engine_integration.launch import ClusterConfig, DisaggCluster, generate_colocated
from engine_integration.reference.kv_cache import BlockAllocator, block_hashes

from engine_helpers import ETCD_PLANE

pytestmark = pytest.mark.timeout(180)

TPB = 4                      # the reference model's tokens per block
PREFIX_BLOCKS = 4
DECODE_BLOCKS = 128
FAMILIES = {name: [(seed * 37 + 11 * j) % 256 for j in range(PREFIX_BLOCKS * TPB)]
            for seed, name in ((1, "A"), (2, "B"))}
NEW = 4                      # new tokens of an ordinary request
BLOCKER_NEW = DECODE_BLOCKS * TPB - (PREFIX_BLOCKS * TPB + 7)   # fills a decode's whole pool


def prompt(family: str, n: int) -> list[int]:
    """The family's prefix, then 7 tokens of its own: 5 full blocks (4 shared) and a partial one."""
    return FAMILIES[family] + [(n * 13 + j * 5 + len(family)) % 256 for j in range(7)]


PROMPT_BLOCKS = -(-len(prompt("A", 0)) // TPB)   # 6


# --- the pure pieces --------------------------------------------------------------------------
def test_routed_prefixes_forget_what_the_decode_reports_evicted():
    routed = RoutedPrefixes()
    routed.add([1, 2, 3])
    routed.add([7, 8])
    assert routed.expected_prefix([1, 2, 3, 4]) == 3
    routed.evicted(1, [2])                   # a middle block: the chain stops there
    assert routed.expected_prefix([1, 2, 3]) == 1 and routed.expected_prefix([7, 8]) == 2
    routed.evicted(1, [2])                   # the same report again changes nothing
    routed.add([2])
    assert routed.expected_prefix([1, 2, 3]) == 3
    routed.evicted(2, [2, 7])                # one new eviction since: only the newest hash counts
    assert routed.expected_prefix([1, 2, 3]) == 3 and routed.expected_prefix([7, 8]) == 0
    routed.evicted(10, [5, 6])               # 8 new, 2 named: some were missed, forget everything
    assert len(routed) == 0 and routed.expected_prefix([1, 2, 3]) == 0


def test_allocator_evicts_a_freed_prefix_from_its_end_and_counts_evictions():
    alloc = BlockAllocator(6)
    hashes = block_hashes(list(range(16)), TPB)
    table = alloc.allocate(4)
    alloc.register(table, hashes)
    alloc.release(table)                      # cached, free, findable
    assert alloc.num_free == 6 and alloc.evictions == 0
    alloc.allocate(4)                         # 2 clean blocks, then 2 evicted: the chain's last two
    assert alloc.evictions == 2 and list(alloc.recent_evictions) == [hashes[3], hashes[2]]
    assert alloc.acquire_prefix(hashes) == table[:2]   # the first two still serve a prefix


# --- end to end, both planes ------------------------------------------------------------------
@pytest.fixture(scope="module", params=["zmq", "etcd"])
def fleet(request, tmp_path_factory):
    if request.param == "etcd":
        request.getfixturevalue("etcd_required")
    config = ClusterConfig(backend="ucx", decode_blocks=DECODE_BLOCKS, prefill_blocks=512, request_timeout_s=60.0,
                           control_plane=ETCD_PLANE if request.param == "etcd" else None,
                           pause_dir=str(tmp_path_factory.mktemp("pause")))
    with DisaggCluster(config) as cluster:
        cluster.start_engine(cluster.spec("decode", "decode-1"))
        cluster.wait_for_stats(lambda s: all(s.engines.get(d, {}).get("alive") and
                                             s.engines[d].get("free_blocks") == DECODE_BLOCKS
                                             for d in ("decode-0", "decode-1")), timeout_s=30)
        yield request.param, cluster


def _generate(cluster, prompts, max_new):
    results = cluster.generate(prompts, max_new, timeout_s=60)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.tokens for r in results] == [r.tokens for r in generate_colocated(prompts, max_new)]
    return results


def test_a_family_follows_its_cached_prefix_while_the_decode_has_room(fleet):
    plane, cluster = fleet
    # the first request of each family pulls everything and leaves its prefix cached where it ran
    [a0] = _generate(cluster, [prompt("A", 0)], NEW)
    [b0] = _generate(cluster, [prompt("B", 0)], NEW)
    for first in (a0, b0):
        assert first.decode in ("decode-0", "decode-1")
        assert (first.cached_prefix_blocks, first.pulled_blocks) == (0, PROMPT_BLOCKS)
    home = {"A": a0.decode, "B": b0.decode}
    served_home_a = sum(r.decode == home["A"] for r in (a0, b0))

    # later requests of a family, alone or two families at once, go home and pull only the rest
    for n in (1, 2):
        results = _generate(cluster, [prompt("A", n), prompt("B", n)], NEW)
        for family, result in zip("AB", results):
            assert result.decode == home[family], (plane, n, family, result)
            served_home_a += result.decode == home["A"]
            assert (result.cached_prefix_blocks, result.pulled_blocks) == (PREFIX_BLOCKS,
                                                                           PROMPT_BLOCKS - PREFIX_BLOCKS)

    # a long request of family A fills A's home; while it runs (held there), the next one of A falls back
    client = cluster.client
    other = "decode-1" if home["A"] == "decode-0" else "decode-0"
    # The blocker needs home's whole pool, so it is sent only once home's load figures say the
    # pool is whole again: on etcd a prefill counts the blocks it routed to a decode until that
    # decode's next figures, and a blocker sent at once went to the other decode (issue 26). Figures
    # published after home's last commit (etcd counts commits; the coordinator's own count is exact).
    cluster.wait_for_stats(lambda s: s.engines.get(home["A"], {}).get("free_blocks") == DECODE_BLOCKS
                           and s.engines[home["A"]].get("running") == 0
                           and s.engines[home["A"]].get("commits", served_home_a) >= served_home_a, timeout_s=20)
    pause = os.path.join(cluster.config.pause_dir, home["A"])
    open(pause, "w").close()
    try:
        blocker = client.submit(prompt("A", 3), BLOCKER_NEW)
        cluster.wait_for_stats(lambda s: s.engines.get(home["A"], {}).get("free_blocks") == 0, timeout_s=30)
        t0 = time.monotonic()
        [fallback] = _generate(cluster, [prompt("A", 4)], NEW)
        still_running = client.stats().engines.get(home["A"], {}).get("running", 0)
    finally:
        os.unlink(pause)
    [blocked] = client.collect([blocker], timeout_s=60)
    assert blocked.ok and blocked.decode == home["A"] and blocked.cached_prefix_blocks == PREFIX_BLOCKS
    assert blocked.tokens == generate_colocated([prompt("A", 3)], BLOCKER_NEW)[0].tokens
    print(f"\n{plane}: fallback served by {fallback.decode} in {time.monotonic() - t0:.2f}s")
    assert still_running == 1     # the blocker held its pool the whole time
    assert fallback.decode == other, (plane, fallback)
    assert (fallback.cached_prefix_blocks, fallback.pulled_blocks) == (0, PROMPT_BLOCKS)   # it never saw family A

    # once the pool is free again, family A is cached on both decodes: wherever it goes, a hit
    [again] = _generate(cluster, [prompt("A", 5)], NEW)
    assert (again.cached_prefix_blocks, again.pulled_blocks) == (PREFIX_BLOCKS, PROMPT_BLOCKS - PREFIX_BLOCKS)
    cluster.wait_for_stats(lambda s: all(s.engines.get(d, {}).get("free_blocks") == DECODE_BLOCKS
                                         and s.engines[d].get("queued") == 0 for d in ("decode-0", "decode-1"))
                           and s.engines.get("prefill-0", {}).get("pins", 0) == 0, timeout_s=20)
