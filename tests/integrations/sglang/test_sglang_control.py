"""The control for kvxfer's SGLang backend: the same rooms through SGLang's own transfer backends, in the
same harness and the same processes (sglang 0.5.23, ``.venv-sglang``).

One prefill rank and one decode rank (``sglang_peer.py``), each holding one manager per backend, every
manager made by SGLang's own ``PrefillBootstrapQueue`` / ``DecodePreallocQueue`` (their ``__init__`` and
``_init_kv_manager``, SGLang's staging buffer off), each backend with its own SGLang bootstrap server
and its own pool (filled with other random bytes on the prefill). In turn, through SGLang's ``nixl``
(NIXL's UCX plugin on host memory; the one change: its KV regions declared ``DRAM``, see
``kvxfer.drive.sglang_build.host_kv_for_sglang_nixl``), SGLang's ``mooncake`` (when the SGLang environment can import
``mooncake.engine``: TCP, ``MOONCAKE_PROTOCOL=tcp``), then kvxfer's ``kvxfer_ucx`` and ``kvxfer_nixl``:

1. four rooms in flight, two or three chunks each, senders made by the queue's ``create_sender`` and
   receivers by its ``_create_receiver_and_enqueue``: every page of every layer and every aux row
   byte-exact (by digest), both sides ``KVPoll.Success``;
2. three rooms in two and three chunks driven by SGLang's own queues (``add``, ``pop_bootstrapped``,
   ``pop_preallocated``, ``pop_transferred``, as in ``test_sglang_backend.py``): byte-exact, SGLang
   commits each room's first token from the aux row after its bootstrap-room check, every queue and
   metadata slot released.

The rule of the control: SGLang's own backend must pass in this harness (else the harness or the
environment is at fault, and the test says so); where it passes and a kvxfer backend fails, the fault is
kvxfer's, and the failure says that.
"""

from __future__ import annotations

import subprocess
import time
import warnings
from typing import Optional

from kvxfer.drive.sglang_control import byte_faults
from sglang_support import Peer, free_port, peer_env, rooms_plan, sglang_python

SGLANG_OWN = ("nixl", "mooncake")
KVXFER = ("kvxfer_ucx", "kvxfer_nixl")
#: kvxfer's bound on an unread chunk is twice this: generous, as in test_sglang_backend's byte steps
CALM_TIMEOUT_S = "15"


def mooncake_unavailable(env: dict[str, str]) -> Optional[str]:
    """Why SGLang's ``mooncake`` backend cannot run in the SGLang environment here, or None. It needs
    ``mooncake-transfer-engine-non-cuda`` importable (``.venv-sglang`` does not install it) and its
    rdma-core libraries (``libibverbs.so.1``, ``librdmacm.so.1``, ``libnl-3``) on the loader's path."""
    probe = subprocess.run([sglang_python(), "-c", "import mooncake.engine"], capture_output=True, text=True,
                           timeout=60, env=env)
    if probe.returncode == 0:
        return None
    last = (probe.stderr.strip().splitlines() or ["?"])[-1]
    return (f"SGLang's mooncake backend not run: {last} (pip install --no-deps "
            "mooncake-transfer-engine-non-cuda into the SGLang environment, with libibverbs1 librdmacm1 libnl-3-200)")


def _run_arm(backend: str, prefill: Peer, decode: Peer, port: int, main: bool) -> list[str]:
    """The two steps on one backend's managers; what went wrong, as lines (empty: all byte-exact)."""
    which = {} if main else {"manager": backend}
    bootstrap = f"127.0.0.1:{port}"
    if not main:  # SGLang's queue makes the manager now (and, on the prefill, its bootstrap server)
        prefill.ask(op="build", **which)
        decode.ask(op="build", **which)
    faults = []
    serve, receive = rooms_plan(100, 4, pages_per_room=6, chunks=[(2, 4), (1, 2, 3)], src_base=30, dst_base=2)
    prefill.send(op="serve", rooms=serve, timeout=60, **which)
    received = decode.ask(op="receive", bootstrap=bootstrap, rooms=receive, timeout=60, **which)
    faults += [f"four rooms: {f}" for f in byte_faults(serve, prefill.read(), received)]

    serve, receive = rooms_plan(700, 3, pages_per_room=5, chunks=[(2, 3), (1, 2, 2)], src_base=3, dst_base=50)
    prefill.send(op="serve_queued", rooms=serve, timeout=60, **which)
    queued = decode.ask(op="receive_queued", bootstrap=bootstrap, rooms=receive, timeout=60, **which)
    served = prefill.read()
    faults += [f"SGLang's queues: {f}" for f in byte_faults(serve, served, queued)]
    if any(served["left"].values()) or any(queued["left"].values()):
        faults.append(f"SGLang's queues: left behind: prefill {served['left']}, decode {queued['left']}")
    for r in serve:  # SGLang committed the first token from the aux row, after its bootstrap-room check
        if queued["rooms"][str(r["room"])]["output_ids"] != [1000 + r["room"]]:
            faults.append(f"SGLang's queues: room {r['room']} committed {queued['rooms'][str(r['room'])]}")
    if backend in KVXFER:  # kvxfer's own tables are empty once every room is concluded
        sizes_p = prefill.ask(op="sizes", settle_s=0.3, **which)["sizes"]
        sizes_d = decode.ask(op="sizes", **which)["sizes"]
        if any(sizes_p.values()) or any(sizes_d.values()):
            faults.append(f"kvxfer's tables not empty: prefill {sizes_p}, decode {sizes_d}")
    return faults


def test_same_rooms_through_sglang_own_backends_and_kvxfer():
    """SGLang's own backends and kvxfer's, the same rooms, in the same two SGLang ranks (module docstring)."""
    env = peer_env(KVXFER_TRANSFER_TIMEOUT_S=CALM_TIMEOUT_S, MOONCAKE_PROTOCOL="tcp")
    skipped = mooncake_unavailable(env)
    if skipped:
        warnings.warn(skipped)
    arms = ["nixl"] + ([] if skipped else ["mooncake"]) + list(KVXFER)
    ports = {backend: free_port() for backend in arms}
    further = {backend: {"backend": backend, "bootstrap_port": ports[backend], "seed": 11 + i}
               for i, backend in enumerate(arms[1:])}
    prefill = Peer("prefill", arms[0], ports[arms[0]], env=env, **further)
    decode = Peer("decode", arms[0], ports[arms[0]], env=env, **further)
    results, timings = {}, {}
    try:
        prefill.ready(), decode.ready()
        assert prefill.info["manager"] == decode.info["manager"] == "HostKVNixlKVManager", (prefill.info, decode.info)
        for i, backend in enumerate(arms):
            began = time.monotonic()
            try:
                results[backend] = _run_arm(backend, prefill, decode, ports[backend], main=i == 0)
            except AssertionError as exc:  # a rank answered with an error, or not at all
                raise AssertionError(f"{backend}: {exc}\n--- prefill's log:\n{prefill.log()}") from None
            timings[backend] = time.monotonic() - began
        reads = {peer.role: peer.ask(op="unset_reads")["unset_reads"] for peer in (prefill, decode)}
    finally:
        logs = "".join(f"\n--- {p.role}'s log:\n{p.log()}" for p in (prefill, decode))
        for peer in (prefill, decode):
            peer.close()
    print("control: " + ", ".join(f"{b} {'byte-exact' if not results[b] else 'FAILED'} ({timings[b]:.1f}s)"
                                  for b in arms))
    for backend in SGLANG_OWN:
        assert not results.get(backend), (f"SGLang's own {backend} backend failed in this harness: the harness or "
                                          f"the environment is at fault, not kvxfer: {results[backend]}{logs}")
    for backend in KVXFER:
        assert not results[backend], (f"{backend} failed where SGLang's own "
                                      f"{' and '.join(b for b in SGLANG_OWN if b in results)} handed the same rooms "
                                      f"over byte-exact in the same processes: the fault is kvxfer's: "
                                      f"{results[backend]}{logs}")
    for role, seen in reads.items():  # kvxfer read no KVArgs field SGLang left unset (SGLang's own may)
        assert not [r for r in seen if r[1].startswith("kvxfer.integrations")], (role, seen)
