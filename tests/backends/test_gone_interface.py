"""A source whose UCX worker published an interface that is gone since (docs/nixl.md).

A UCX worker publishes an address for every TCP interface with an IPv4 address when it starts. In one
network namespace (one host, an interface that stays and the default route through it): the prefill
starts while a second interface exists; the interface is removed; the decode starts and pulls. Its UCX
picks the address that is gone and is refused, on every try: the pull fails before any byte moves, and
the error names the fix. With ``UCX_NET_DEVICES`` set on both sides to the interface that stays, the same
sequence moves the blocks byte-exact. This is what the suite hit twice while a two-host test gave the
root namespace an interface for a while (``tests/project/test_suite_hygiene.py``).

Real processes, real NIXL and UCX, an interface really removed. Needs root and ``ip netns``, as the
two-host tests do; fails with the reason elsewhere.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from netns_support import Peer, ip, require_namespaces

STAYS, GONE = "kvstay", "kvgone"


@pytest.fixture
def host():
    """A namespace with an interface that stays (10.96.0.1/24, the default route) and a way to add the one
    that goes (10.97.0.1/24); each is one end of a veth pair whose other end is in the namespace too."""
    require_namespaces()
    ns = f"kvxgone{os.getpid() % 100000}"
    ip("netns", "add", ns)
    try:
        ip("-n", ns, "link", "set", "lo", "up")
        _add_interface(ns, STAYS, "10.96.0.1/24")
        ip("-n", ns, "route", "add", "default", "dev", STAYS)
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _add_interface(ns: str, name: str, address: str) -> None:
    ip("-n", ns, "link", "add", name, "type", "veth", "peer", "name", f"{name}b")
    ip("-n", ns, "addr", "add", address, "dev", name)
    ip("-n", ns, "link", "set", name, "up")
    ip("-n", ns, "link", "set", f"{name}b", "up")


def _prefill_then_decode(ns: str, devices: str, backend: str, tmp) -> tuple[Peer, Peer]:
    """The prefill started while ``GONE`` exists, ``GONE`` removed, then the decode started."""
    tmp.mkdir()
    _add_interface(ns, GONE, "10.97.0.1/24")
    prefill = Peer("prefill", ns, devices, backend, tmp)
    try:
        ip("-n", ns, "link", "del", GONE)
        return prefill, Peer("decode", ns, devices, backend, tmp)
    except BaseException:
        prefill.close()
        raise


@pytest.mark.parametrize("backend", ["ucx", "nixl"])
def test_an_address_gone_since_the_source_started_fails_loudly_and_pinned_devices_fix_it(host, backend, tmp_path):
    src, dst = [3, 9, 17, 40], [1, 2, 60, 8]
    prefill, decode = _prefill_then_decode(host, "all", backend, tmp_path / "all")
    try:
        reply = decode.call_reply("pull", prefill.meta, src, dst, 1, timeout=120)
        if reply[0] == "posted":
            reply = decode.call_reply("wait", 1, timeout=120)
        assert reply[0] in ("error", "failed"), f"the pull reached an address that is gone: {reply}"
        assert reply[1] == "TransferError" and "UCX_NET_DEVICES" in reply[2], reply
        assert decode.call_reply("drain") == ([], [])  # nothing arrived, nothing half-done
    finally:
        decode.close()
        prefill.close()

    prefill, decode = _prefill_then_decode(host, STAYS, backend, tmp_path / "pinned")
    try:
        assert decode.call_reply("pull", prefill.meta, src, dst, 2, timeout=120) == ("posted",)
        status, exact, _ = decode.call_reply("wait", 2, timeout=120)
        assert status == "done" and exact
    finally:
        decode.close()
        prefill.close()
