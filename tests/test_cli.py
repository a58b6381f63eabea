"""The two commands users run first: ``kvxfer info`` and ``kvxfer loopback``."""

import json
import subprocess
import sys

import pytest
import torch

from kvxfer.harness.loopback import LoopbackConfig, run_loopback

SMALL = ["--layers", "4", "--heads", "2", "--head-dim", "32", "--pool-blocks", "64", "--blocks", "24"]


def _kvxfer(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kvxfer.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_info_lists_backends():
    out = _kvxfer("info")
    assert out.returncode == 0, out.stderr
    assert "local" in out.stdout and "(default)" in out.stdout


@pytest.mark.parametrize("pattern", ["scattered", "contiguous"])
def test_loopback_local_verifies_and_prints_the_table(tmp_path, pattern):
    out = _kvxfer("loopback", "--backend", "local", "--pattern", pattern, *SMALL, "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    for row in ("bytes moved", "descriptors before coalescing", "GB/s", "exact"):
        assert row in out.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["ok"] and result["verified"] and result["bytes_moved"] == 24 * 2 * 4 * 16 * 2 * 32 * 2
    if pattern == "contiguous":
        assert result["descriptors"] < result["raw_descriptors"]


def test_loopback_reports_corruption(monkeypatch):
    """Flip a source byte after its digest is taken: verification must fail, loudly."""
    import kvxfer.harness.loopback as lb

    original = lb._Prefill.offer

    def corrupting_offer(self):
        offer = original(self)
        self.pool.view(torch.uint8).view(-1)[0] ^= 0xFF
        return offer

    monkeypatch.setattr(lb._Prefill, "offer", corrupting_offer)
    cfg = LoopbackConfig(num_layers=2, num_heads=1, head_dim=16, pool_blocks=8, request_blocks=8, pattern="contiguous")
    result = run_loopback(cfg)
    assert not result.verified and not result.ok


def test_loopback_exit_status_on_bad_arguments():
    out = _kvxfer("loopback", "--backend", "no-such-backend", *SMALL)
    assert out.returncode != 0 and "unknown backend" in out.stdout
