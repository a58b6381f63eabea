"""What the numbers were measured on: a figure without its machine is not a result.

Also records the load average at the start and end of the run: on a shared
machine that explains more variance than anything else.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, Optional


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def memory_bytes() -> Optional[int]:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def package_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def ucx_version() -> Optional[str]:
    """The UCX library version from the libucx wheel's ``ucx_info -v`` (falls back to the wheel's)."""
    try:
        import libucx
    except ImportError:
        return None
    root = Path(libucx.__file__).parent
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
        [str(root / "lib")] + [str(p) for p in root.parent.glob("libucx*.libs")] + [os.environ.get("LD_LIBRARY_PATH", "")]))
    try:
        out = subprocess.run([str(root / "bin" / "ucx_info"), "-v"], capture_output=True, text=True, timeout=20, env=env).stdout
        for line in out.splitlines():
            if "UCT version" in line or "Library version" in line:
                return line.strip("# ").strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return getattr(libucx, "__version__", None)


def llc_bytes() -> Optional[int]:
    """The last-level cache (the highest-level data/unified cache cpu0 sees), from sysfs; else ``lscpu``."""
    best: tuple[int, int] = (0, 0)
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        level, kind, size = (_read(str(index / f)).strip() for f in ("level", "type", "size"))
        if kind == "Instruction" or not level.isdigit() or not size:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            value = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except ValueError:
            continue
        best = max(best, (int(level), value))
    if best[1]:
        return best[1]
    try:
        out = subprocess.run(["lscpu", "-B"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("L3 cache:"):
                return int(line.split(":", 1)[1].split()[0])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        pass
    return None


def load_average() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def describe() -> dict[str, Any]:
    import numpy
    import torch

    return {
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": memory_bytes(),
        "llc_bytes": llc_bytes(),
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            "torch": torch.__version__,
            "numpy": numpy.__version__,
            "nixl": package_version("nixl"),
            "libucx-cu12": package_version("libucx-cu12"),
            "mooncake-transfer-engine-non-cuda": package_version("mooncake-transfer-engine-non-cuda"),
            "ucx": ucx_version(),
            "kvxfer": package_version("kvxfer") or _kvxfer_version(),
        },
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))},
        "transports": transport_probes(),
        "load_average_start": load_average(),
    }


def transport_probes() -> dict[str, Any]:
    """What ``kvxfer info`` shows per backend (e.g. NIXL's package and UCX transports); errors as text."""
    from kvxfer.backends import transport_probes as probes

    return probes()


def _kvxfer_version() -> str:
    import kvxfer

    return kvxfer.__version__
