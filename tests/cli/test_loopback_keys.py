"""``kvxfer loopback`` keys its own two processes' metas (issue 26, row 11).

``make loopback`` is the first thing a new user runs. Its prefill and decode processes
used to exchange unsigned metas, and the decode warned that they were UNAUTHENTICATED.
Now each run writes a fresh 0600 key file, hands its path to both processes and removes
it afterwards (unless ``$KVXFER_SECRET_FILE`` names the cluster's own key). Real
processes: the ``kvxfer`` command, which spawns the prefill child; and the soak, which
runs the same two-process shape.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from kvxfer.harness.soak import SoakConfig, run_soak
from kvxfer.security.auth import SECRET_FILE_ENV

SMALL = ["--layers", "2", "--heads", "2", "--head-dim", "16", "--pool-blocks", "64", "--blocks", "16"]


def _key_dirs(directory: str) -> set[str]:
    return set(glob.glob(os.path.join(directory, "kvxfer-secret-*")))


@pytest.mark.parametrize("backend", ["ucx", "nixl"])
def test_loopback_processes_sign_their_metas_with_a_key_of_their_own(backend, tmp_path):
    # the run's temporary files go to a folder of this test's own: other tests (run in
    # parallel) write key folders of theirs to the shared temporary folder
    env = {k: v for k, v in os.environ.items() if k != SECRET_FILE_ENV}
    env["TMPDIR"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-m", "kvxfer", "loopback", "--backend", backend, "-v", *SMALL],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "UNAUTHENTICATED" not in run.stdout + run.stderr, run.stderr[-3000:]
    assert not _key_dirs(str(tmp_path))  # the run's key file went with it


def test_soak_processes_sign_their_metas_with_a_key_of_their_own(monkeypatch, caplog):
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    report = run_soak(SoakConfig(backend="ucx", handoffs=20))
    assert report.ok, report.failures
    assert "UNAUTHENTICATED" not in caplog.text
