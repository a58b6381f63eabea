"""The engine on etcd across two hosts: two network namespaces, one etcd (issue 16).

Host A (namespace ``kvea*``) runs the prefill engine and the one etcd member, listening on
its address on the A-B cable (10.79.0.1); host B (``kveb*``) runs the decode engine and
reaches etcd over that cable, as it reaches the prefill's KV blocks (ucx, or nixl, over
TCP on the veth: ``UCX_TLS=tcp``, ``UCX_NET_DEVICES`` the cable; B's namespace has no
other route to A). The test process (the
client) stays in the root namespace and reaches etcd through a third veth (root <-> A: a route to
10.79.0.1 over it, and no IPv4 address on its root end, which UCX workers in the root namespace would
publish and which is gone once the test ends). Metas are signed: both hosts get
``KVXFER_SECRET_FILE``; etcd runs with auth on (a ``kvxfer`` user limited to ``/kvxfer/``).

Engine hosts are started with ``ip netns exec`` by ``_start_host`` below (the worker
module and its pipe protocol of ``engine_integration.procs``, with the command prefixed).
Checked: one generation token-exact against co-located; then ``kill -9`` of the decode
mid-handoff, and the prefill frees its pins within TTL + etcd's expiry sweep + one poll
(+ slack for this shared 2-core machine, as in tests/engine/test_engine_etcd.py).
Needs root and ``ip netns``; without them the tests fail with the reason (tests/support/netns_support.py), never skip.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from engine_integration import procs
from engine_integration.launch import generate_colocated
from engine_integration.worker import EngineHost, EngineSpec

from netns_support import ip, require_namespaces
from engine_helpers import ETCD_POLL_S, ETCD_TTL_S, MODEL, varied_prompts

ROOT = Path(__file__).resolve().parents[2]
ETCD_ADDR, ETCD_PORT = "10.79.0.1", 2379          # host A's address on the A-B cable
DETECT_BOUND_S = ETCD_TTL_S + 0.5 + ETCD_POLL_S + 2.5
DECODE_BLOCKS = 24


pytestmark = [pytest.mark.usefixtures("etcd_required"),
              pytest.mark.timeout(180)]


@pytest.fixture
def hosts():
    """Namespaces A and B joined by a veth (10.79.0.1 <-> 10.79.0.2); root <-> A by another (no address in root)."""
    require_namespaces()
    tag = os.getpid() % 100000
    ns_a, ns_b = f"kvea{tag}", f"kveb{tag}"
    ab_a, ab_b, ra_root, ra_a = f"kvab{tag}", f"kvba{tag}", f"kvra{tag}", f"kvar{tag}"
    ip("netns", "add", ns_a)
    ip("netns", "add", ns_b)
    try:
        ip("link", "add", ab_a, "type", "veth", "peer", "name", ab_b)
        ip("link", "set", ab_a, "netns", ns_a)
        ip("link", "set", ab_b, "netns", ns_b)
        ip("link", "add", ra_root, "type", "veth", "peer", "name", ra_a)
        ip("link", "set", ra_a, "netns", ns_a)
        for ns, dev, addr in ((ns_a, ab_a, "10.79.0.1/24"), (ns_b, ab_b, "10.79.0.2/24"), (ns_a, ra_a, "10.79.1.1/24")):
            ip("-n", ns, "addr", "add", addr, "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        # The root end gets no IPv4 address: every UCX worker of the root namespace (other tests' ranks,
        # running in parallel) would publish it, and a peer made after this test removed it could pick
        # it and be refused ("Destination is unreachable"). The root reaches A by a device route with
        # its own address as the source; A answers by its default route back over the cable.
        ip("link", "set", ra_root, "up")
        ip("route", "add", "10.79.0.1/32", "dev", ra_root)
        ip("-n", ns_a, "route", "add", "default", "dev", ra_a)
        yield {"a": (ns_a, ab_a), "b": (ns_b, ab_b)}
    finally:
        subprocess.run(["ip", "link", "del", ra_root], capture_output=True, timeout=30)   # its route goes with it
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _etcd_in(ns: str, tmp: Path):
    """One etcd member started inside ``ns`` (a wrapper binary), secured; (server, password file)."""
    from engine_integration.control_plane.etcd.server import EtcdServer, etcd_binary

    wrapper = tmp / "etcd-in-ns"
    wrapper.write_text(f'#!/bin/sh\nexec ip netns exec {ns} {etcd_binary()} "$@"\n')
    wrapper.chmod(0o700)
    server = EtcdServer(host=ETCD_ADDR, client_port=ETCD_PORT, peer_port=ETCD_PORT + 1, binary=str(wrapper))
    server.start()
    try:
        password = secrets.token_hex(16)
        server.secure(root_password=secrets.token_hex(16), user="kvxfer", password=password)
    except BaseException:
        server.stop()
        raise
    path = tmp / "etcd-password"
    path.write_text(password)
    path.chmod(0o600)
    return server, str(path)


def _start_host(spec: EngineSpec, ns: str, dev: str, secret_file: str, timeout_s: float = 90.0) -> EngineHost:
    """``engine_integration.worker`` for ``spec``, run under ``ip netns exec ns`` (our other host)."""
    payload = {"address": spec.control_plane, "specs": [asdict(spec)]}
    proc = procs.launch("engine_integration.worker", payload, prefix=["ip", "netns", "exec", ns],
                        extra_env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev, "KVXFER_SECRET_FILE": secret_file})
    ready = procs.wait_ready(proc, "engine_integration.worker", timeout_s)
    if "ready" not in ready:
        procs.stop(proc)
        raise RuntimeError(f"engine host {spec.identity} in {ns}: {ready.get('refused')}")
    return EngineHost(proc, list(ready["ready"]))


@pytest.mark.parametrize("backend", ["ucx", "nixl"])
def test_two_hosts_one_etcd_token_exact_and_decode_kill_frees_pins(hosts, backend, tmp_path):
    from engine_integration.control_plane import open_control_plane
    from engine_integration.control_plane.etcd.client import EtcdGenerationClient

    (ns_a, dev_a), (ns_b, dev_b) = hosts["a"], hosts["b"]
    secret = tmp_path / "cluster.secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    server, password_file = _etcd_in(ns_a, tmp_path)
    url = f"etcd://kvxfer@{ETCD_ADDR}:{ETCD_PORT}/netns?ttl={ETCD_TTL_S}&poll={ETCD_POLL_S}"
    started: list[EngineHost] = []
    plane = client = None
    try:
        def spec(role: str, name: str, blocks: int) -> EngineSpec:
            return EngineSpec(role=role, identity=name, num_blocks=blocks, backend=backend, model=MODEL,
                              transfer_timeout_s=20.0, secret_file=str(secret), control_plane=url,
                              etcd_password_file=password_file)

        started.append(_start_host(spec("prefill", "prefill-0", 512), ns_a, dev_a, str(secret)))
        decode = _start_host(spec("decode", "decode-0", DECODE_BLOCKS), ns_b, dev_b, str(secret))
        started.append(decode)
        plane = open_control_plane(url, password_file=password_file, secret_file=str(secret))
        client = EtcdGenerationClient(plane)
        view = client.view()
        assert {i.name for i in view.live()} == {"prefill-0", "decode-0"}

        # 1. one generation across the cable, token-exact against co-located
        prompts = varied_prompts(6, seed=4)
        results = client.generate(prompts, 5, timeout_s=60)
        assert [r.error for r in results] == [None] * len(prompts)
        assert [r.tokens for r in results] == [r.tokens for r in generate_colocated(prompts, 5)]
        assert sum(r.pulled_blocks for r in results) > 0   # blocks crossed the veth

        # 2. kill -9 the decode mid-handoff: the prefill frees its pins through the decode's lease
        long_prompts = [[(11 * i + j) % 256 for j in range(9 + i)] for i in range(10)]   # one at a time at decode
        ids = [client.submit(p, 64) for p in long_prompts]
        deadline = time.monotonic() + 30
        while True:
            stats = client.engine_stats()
            readers = [pair for pair in client.view().handoffs.values() if pair.reader is not None]
            if stats.get("prefill-0", {}).get("pins", 0) > 0 and readers:
                break
            assert time.monotonic() < deadline, f"no handoff in flight: {stats}"
            time.sleep(0.02)
        decode.kill()
        t0 = time.monotonic()
        while client.engine_stats().get("prefill-0", {}).get("pins") != 0:
            assert time.monotonic() - t0 < 20, "the prefill kept its pins"
            time.sleep(0.02)
        freed_after = time.monotonic() - t0
        results = client.collect(ids, timeout_s=30)
        print(f"\n{backend} across namespaces: decode kill -9 -> prefill pins freed in {freed_after:.2f}s "
              f"(TTL {ETCD_TTL_S} s, poll {ETCD_POLL_S} s)")
        assert freed_after < DETECT_BOUND_S
        errors = [r.error for r in results if r.error]
        assert errors and all("decode 'decode-0'" in e for e in errors), errors
        assert "decode-0" not in {i.name for i in client.view().live()}
    finally:
        if client is not None:
            client.close()
        if plane is not None:
            plane.close()
        for host in started:
            procs.stop(host.process, 10.0, terminate_first=True)
        server.stop()
