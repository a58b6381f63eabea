"""``tools/gpu_check.sh`` (the one run a lent GPU machine gets) stays in step with the suite."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tools" / "gpu_check.sh"


def test_driver_parses():
    subprocess.run(["bash", "-n", str(DRIVER)], check=True)


def test_driver_runs_every_test_file_that_has_gpu_tests():
    marked = {p.name for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"pytest\.mark\.gpu|marks=pytest\.mark\.gpu|^gpu = pytest\.mark\.gpu", p.read_text(), re.M)}
    named = set(re.findall(r"tests/(?:\w+/)*(test_\w+\.py)", DRIVER.read_text()))
    assert marked, "no GPU tests found: the marker's spelling changed?"
    assert marked <= named, f"GPU tests the driver would not run: {sorted(marked - named)}"
