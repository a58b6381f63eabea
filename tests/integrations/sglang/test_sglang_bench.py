"""``kvxfer bench-sglang``, run small as a user runs it (``python -m kvxfer``): its JSON has every target's
figures and every room of every target was byte-exact; its usage mistakes are one line, exit 2, before any rank
starts (sglang 0.5.23, ``.venv-sglang``; the harness is the SGLang tests': ``kvxfer.drive.sglang_rank``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from sglang_support import sglang_python

TARGETS = ("kvxfer_ucx", "kvxfer_nixl", "nixl")


def _kvxfer(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvxfer", *args], capture_output=True, text=True, timeout=timeout)


def test_bench_sglang_small_run_reports_every_target_byte_exact(tmp_path):
    sglang_python()  # fails (never skips) without the SGLang environment
    out = tmp_path / "bench" / "sglang.json"
    run = _kvxfer("bench-sglang", "--rooms", "2", "--batches", "2", "--pages", "4", "--chunks", "2",
                  "--json", str(out))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    for column in ("rooms/s", "p50", "pub p50", "descr", "exact"):
        assert column in run.stdout, run.stdout
    report = json.loads(out.read_text())
    assert report["command"] == "kvxfer bench-sglang" and report["sglang"] == "0.5.23", report
    assert (report["rooms_per_batch"], report["batches"], report["pages_per_room"], report["chunks_per_room"]) == \
        (2, 2, 4, 2)
    assert report["chunk_pages"] == [2, 2] and report["machine"]["logical_cores"] >= 1
    assert [r["target"] for r in report["results"]] == list(TARGETS), report["results"]
    for r in report["results"]:
        assert "error" not in r and r["faults"] == [], r
        assert r["rooms"] == 4 and r["rooms_byte_exact"] == 4 and r["warmup_byte_exact"] is True, r
        assert r["rooms_per_s"] > 0 and 0 < r["handoff_p50_ms"] <= r["handoff_p99_ms"] < 60_000, r
        assert 0 < r["published_p50_ms"] <= r["handoff_p99_ms"], r  # the hand-off's first part
        # every page of every buffer is read or written once, plus the aux row: 4 pages x 6 KV buffers at least
        assert r["descriptors_per_room"] >= 4 * 6, r


@pytest.mark.parametrize("argv, mentions", [
    (["--targets", "kvxfer_ucx,mooncake2"], "--targets"),
    (["--targets", "nixl,nixl"], "--targets"),
    (["--rooms", "9"], "--rooms"),
    (["--pages", "8"], "--pages"),
    (["--chunks", "5", "--pages", "4"], "--chunks"),
    (["--batches", "0"], "--batches"),
    (["--json", "/proc/no/such/dir/x.json"], "cannot write"),
])
def test_bench_sglang_usage_mistake_is_one_line_exit_2_before_any_rank(argv, mentions):
    began = time.monotonic()
    run = _kvxfer("bench-sglang", *argv, timeout=60)
    assert run.returncode == 2, (run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvxfer: error:") and mentions in lines[0], run.stderr
    assert "bench-sglang:" not in run.stdout and time.monotonic() - began < 30, run.stdout
