"""nixl over TCP is told at setup (issue 39, item 7).

Where NIXL's UCX would serve reads over TCP, a reader SIGKILLed while its source is stalled makes the
source abort inside NIXL's UCX GET path (docs/nixl.md; ``test_peer_death.py`` keeps that case). Before,
nothing said so until it happened. Now a nixl backend set up where that applies logs one warning per
process naming the risk and the ``ucx`` backend, keeps it as ``tcp_read_risk``, and ``kvxfer info``
shows it. Which reads go over TCP, measured here with ``UCX_PROTO_INFO=y`` (nixl 1.5.1's UCX 1.22,
two processes of one host, no RDMA NIC): with ``UCX_TLS`` unset a nixl READ is "zero-copy cma/memory";
with ``UCX_TLS=tcp`` "software emulation tcp/lo". Reads from another host have no CMA: without an RDMA
device they go over TCP, so the warning applies whenever this process accepts metas from other hosts
(a cluster key, or ``KVXFER_ALLOW_UNAUTHENTICATED_METAS``) unless ``KVXFER_NIXL_SAME_HOST=1``.

Each case is a fresh process (UCX reads its environment when the agent is made) building real NIXL
agents on host memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest

from kvxfer.backends.nixl.ucx_env import nixl_transport_info

ROOT = Path(__file__).resolve().parents[2]

SETUP = textwrap.dedent("""
    import json, logging
    import torch
    from kvxfer.backends.nixl import NixlBackend

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []
        def emit(self, record):
            self.lines.append(record.getMessage())

    keep = Keep()
    logging.getLogger("kvxfer.backends.nixl").addHandler(keep)
    backends = [NixlBackend(f"tcp-warn-{i}", torch.zeros(2, 2, 8, 4, 2, 16, dtype=torch.bfloat16), 8) for i in range(2)]
    print("RESULT " + json.dumps({"warnings": [line for line in keep.lines if "TCP" in line],
                                  "risks": [b.tcp_read_risk for b in backends]}))
    for backend in backends:
        backend.close()
""")


def _env(tmp_path: Path, *, tls: Optional[str], key: bool = False, same_host: bool = False) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("UCX_TLS", "KVXFER_SECRET_FILE", "KVXFER_ALLOW_UNAUTHENTICATED_METAS", "KVXFER_NIXL_SAME_HOST"):
        env.pop(name, None)
    if tls is not None:
        env["UCX_TLS"] = tls
    if key:
        secret = tmp_path / "cluster.key"
        secret.write_text("k" * 40)
        env["KVXFER_SECRET_FILE"] = str(secret)
    if same_host:
        env["KVXFER_NIXL_SAME_HOST"] = "1"
    return env


def _setup(env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", SETUP], capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.fixture(autouse=True)
def _no_rdma_here() -> None:
    if nixl_transport_info().rdma_devices:  # reads would be RDMA GETs: nothing to warn about
        pytest.skip("this machine has an RDMA device")


def test_nixl_over_tcp_warns_once_at_setup_naming_the_abort_and_the_ucx_backend(tmp_path: Path) -> None:
    result = _setup(_env(tmp_path, tls="tcp"))
    assert len(result["warnings"]) == 1, result  # two backends, one warning
    warning = result["warnings"][0]
    assert "every read over TCP" in warning and "abort" in warning and "backend 'ucx'" in warning
    assert "docs/nixl.md" in warning
    assert all(risk and "over TCP" in risk for risk in result["risks"]), result


def test_nixl_accepting_other_hosts_without_rdma_warns_for_their_reads(tmp_path: Path) -> None:
    result = _setup(_env(tmp_path, tls=None, key=True))
    assert len(result["warnings"]) == 1, result
    warning = result["warnings"][0]
    assert "reads from other hosts over TCP" in warning and "reads on this host use cma" in warning
    assert "backend 'ucx'" in warning and "KVXFER_NIXL_SAME_HOST=1" in warning


@pytest.mark.parametrize("case", ["no cluster key", "same-host mode"])
def test_nixl_reading_only_on_this_host_by_cma_does_not_warn(tmp_path: Path, case: str) -> None:
    env = _env(tmp_path, tls=None) if case == "no cluster key" else _env(tmp_path, tls=None, key=True, same_host=True)
    result = _setup(env)
    assert result == {"warnings": [], "risks": [None, None]}, result


def test_kvxfer_info_shows_that_nixl_reads_over_tcp(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "kvxfer", "info"], capture_output=True, text=True, timeout=180,
                          cwd=ROOT, env=_env(tmp_path, tls="tcp"))
    assert done.returncode == 0, done.stderr[-3000:]
    text = " ".join(done.stdout.split())
    assert "tcp_reads=RISK: UCX under NIXL serves every read over TCP" in text, done.stdout[-3000:]
    assert "nixl: RISK:" in text and "use backend 'ucx' for reads over TCP" in text
    quiet = subprocess.run([sys.executable, "-m", "kvxfer", "info"], capture_output=True, text=True, timeout=180,
                           cwd=ROOT, env=_env(tmp_path, tls=None))
    assert quiet.returncode == 0 and "RISK" not in quiet.stdout and "tcp_reads=no: reads on this host by cma" in \
        " ".join(quiet.stdout.split())
