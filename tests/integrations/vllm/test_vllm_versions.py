"""``tools/vllm_version_check.py``: the check that kvxfer's connector fits a vLLM release (docs/vllm.md, "vLLM versions").

The run against vLLM 0.33.0 fetches a ~340 MB wheel, so it is a documented command, not part of the suite; here
the same checks run against the vLLM environment's own vLLM (0.32), and their parts are shown to catch what
they are for.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from kvxfer.drive.vllm_control import REPO
from tests.support.vllm_support import require_vllm_python

pytestmark = pytest.mark.timeout(300)

spec = importlib.util.spec_from_file_location("vllm_version_check", REPO / "tools" / "vllm_version_check.py")
check = importlib.util.module_from_spec(spec)
assert spec.loader is not None
spec.loader.exec_module(check)


def test_every_vllm_import_of_the_library_is_found_function_local_and_type_checking_ones_too():
    found = {(rel, module, name) for rel, _, module, name in check.vllm_imports()}
    assert ("kvxfer/integrations/vllm/connector.py", "vllm.distributed.kv_transfer.kv_connector.v1.base",
            "SupportsHMA") in found
    assert ("kvxfer/integrations/vllm/connector.py", "vllm.v1.request", "Request") in found  # TYPE_CHECKING
    assert ("kvxfer/integrations/vllm/worker.py", "vllm.distributed.parallel_state",
            "get_tensor_model_parallel_rank") in found  # inside a function
    assert ("kvxfer/integrations/vllm/stats.py", "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
            "KVConnectorPromMetrics") in found
    assert all(module == "vllm" or module.startswith("vllm.") for _, module, _ in found)


def test_a_name_or_module_that_is_gone_and_a_signature_that_drifted_are_reported():
    assert check.resolve("json", "dumps") is None and check.resolve("os", "path") is None
    assert "has no 'dumpz'" in check.resolve("json", "dumpz")
    assert "ModuleNotFoundError" in check.resolve("json.nothing_here", "x")

    class Base:
        def hook(self, request, block_ids, *, extra=None): ...

    def same(self, request, block_ids, *, extra=None): ...

    def lacks(self, request, block_ids): ...

    def requires(self, request, block_ids, more, *, extra=None): ...

    def catch_all(self, request, *args, **kwargs): ...

    assert check.accepts(same, Base.hook) is None and check.accepts(catch_all, Base.hook) is None
    assert "lacks ['extra']" in check.accepts(lacks, Base.hook)
    assert "requires ['more']" in check.accepts(requires, Base.hook)


def test_the_check_passes_against_the_installed_vllm():
    require_vllm_python()
    run = subprocess.run([sys.executable, str(REPO / "tools" / "vllm_version_check.py"), "--installed"],
                         capture_output=True, text=True, timeout=240, cwd=str(REPO))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "all checks passed" in run.stdout and "vLLM imports in kvxfer/" in run.stdout


def test_a_wheel_that_cannot_be_fetched_is_said_plainly_and_nothing_passes(tmp_path):
    """No index reachable (a closed local port stands for an offline machine): exit 2, pip's words, no check."""
    require_vllm_python()
    env = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2",
           "PIP_NO_CACHE_DIR": "1", "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": ""}
    run = subprocess.run([sys.executable, str(REPO / "tools" / "vllm_version_check.py"), "--wheel-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=240, cwd=str(REPO),
                         env={**os.environ, **env})
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert "COULD NOT FETCH the vllm==0.33.0 wheel" in run.stdout and "nothing was checked" in run.stdout
    assert "all checks passed" not in run.stdout
