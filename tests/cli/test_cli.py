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


def test_loopback_nccl_pushes_over_gloo_and_verifies(tmp_path):
    """The push backend: two processes in one Gloo group, decode posts receives, prefill pushes."""
    out = _kvxfer("loopback", "--backend", "nccl", *SMALL, "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    for row in ("push", "receives posted", "exact", "OK"):
        assert row in out.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["ok"] and result["verified"] and result["untouched_ok"] and result["read_done_ok"]
    assert result["direction"] == "push" and result["freed_blocks"] == 24
    assert result["bytes_moved"] == 24 * 2 * 4 * 16 * 2 * 32 * 2


def test_soak_still_refuses_a_push_backend_and_generate_takes_it():
    out = _kvxfer("soak", "--backend", "nccl")
    assert out.returncode == 2 and "push backend" in out.stderr and out.stdout == "", out.stderr
    assert "'kvxfer generate' run 'nccl'" in out.stderr
    # generate drives pushes (tests/engine/test_engine_push.py runs it): its argument check passes, the prompts file fails
    out = _kvxfer("generate", "--prompts", "README.md", "--disagg", "--backend", "nccl")
    assert "push backend" not in out.stderr and out.returncode != 0 and out.stdout == "", out.stderr


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
    assert out.returncode == 2 and "unknown backend" in out.stderr and out.stdout == ""


def test_version_and_python_dash_m():
    import kvxfer

    for argv in (["-m", "kvxfer", "--version"], ["-m", "kvxfer.cli", "--version"]):
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == f"kvxfer {kvxfer.__version__}", out.stderr


def test_every_option_has_help_and_says_its_default():
    import argparse

    from kvxfer.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        text = command.format_help()
        for action in command._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            assert action.help, f"kvxfer {name} {action.option_strings[0]} has no help text"
            if action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0:
                assert "default" in command._get_formatter()._get_help_string(action), (name, action.option_strings)
        assert "(default:" in text or name == "info"


def test_info_is_truthful_about_cuda():
    out = _kvxfer("info")
    assert out.returncode == 0, out.stderr
    if not torch.cuda.is_available():
        assert "cuda not available" in out.stdout and "VRAM=ok" not in out.stdout


def test_a_quiet_successful_run_writes_nothing_to_stderr():
    out = _kvxfer("loopback", "--backend", "local", *SMALL)  # stderr is a pipe: no progress drawn
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_verbose_logs_the_phases_to_stderr():
    out = _kvxfer("-v", "loopback", "--backend", "local", *SMALL)
    assert out.returncode == 0 and "kvxfer: INFO: kvxfer.harness.loopback:" in out.stderr

