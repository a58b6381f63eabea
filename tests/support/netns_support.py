"""Network namespaces as stand-in hosts: the shared helpers of the two-host tests.

Both tests need root and ``ip netns`` (CI runs as root). Where namespaces cannot be
made the tests fail with the reason instead of skipping: they are the only tests of
traffic between two hosts, and silence would hide that they did not run.
"""

from __future__ import annotations

import os
import subprocess

import pytest


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def namespaces_problem() -> str:
    """Why network namespaces cannot be created here ("" when they can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    name = f"kvxprobe{os.getpid()}"
    try:
        ip("netns", "add", name)
        ip("netns", "del", name)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot create network namespaces here: {exc}"
    return ""


def require_namespaces() -> None:
    problem = namespaces_problem()
    if problem:
        pytest.fail(f"{problem} (the two-host tests run as root with `ip netns`)", pytrace=False)
