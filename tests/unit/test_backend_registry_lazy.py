"""The layered backend contract (issue 28, item 2).

- The registry names the built-in backends by ``"module:Class"`` and imports one only when it is
  looked up or listed; no backend module imports the registry.
- The pool's arguments (the reference's 17-argument signature) are written once, in ``PoolSpec``;
  the two entrances, ``compute_buffer_geometry`` (the seed's) and a backend's constructor
  (Megatron's), show the reference's signature and turn their arguments into a ``PoolSpec`` at once.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kvxfer.backends as registry
from kvxfer.backends import (
    BUILTIN_BACKENDS,
    available_backends,
    construct_kv_transfer_backend_class,
    normalize_name,
    register_backend,
)
from kvxfer.backends.base import KVTransportBackend
from kvxfer.backends.local.backend import LocalBackend
from kvxfer.errors import BackendUnavailableError
from kvxfer.plan.geometry import PoolSpec, compute_buffer_geometry, pool_geometry

ROOT = Path(__file__).resolve().parents[2]
BACKEND_PACKAGES = ("local", "nccl", "nixl", "ucx")


def _loaded_after(code: str, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; return the kvxfer modules it loaded (in load order) and its env."""
    script = textwrap.dedent(code) + textwrap.dedent("""
        import json, os, sys
        print(json.dumps({"modules": [m for m in sys.modules if m.startswith("kvxfer")],
                          "UCX_MODULES": os.environ.get("UCX_MODULES")}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _backend_modules(modules: list[str]) -> set[str]:
    return {m.split(".")[2] for m in modules if m.count(".") >= 2 and m.split(".")[2] in BACKEND_PACKAGES}


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_BROKEN_PLUGINS", {})
    monkeypatch.setattr(registry, "_BROKEN_BUILTINS", {})
    monkeypatch.setattr(registry, "_plugins_loaded", False)


# --- the registry, resolved lazily ---------------------------------------------------------------
def test_importing_the_registry_imports_no_backend():
    loaded = _loaded_after("import kvxfer.backends")
    assert _backend_modules(loaded["modules"]) == set()


@pytest.mark.parametrize("key", BACKEND_PACKAGES)
def test_a_lookup_imports_only_the_backend_it_names(key):
    loaded = _loaded_after(f"""
        from kvxfer.backends import construct_kv_transfer_backend_class
        construct_kv_transfer_backend_class({key!r})
    """)
    assert _backend_modules(loaded["modules"]) == {key}


def _imported_by(package: str) -> list[tuple[str, str]]:
    """(file:line, module) for every absolute import in one backend package."""
    found = []
    for path in sorted((ROOT / "kvxfer" / "backends" / package).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found += [(where, f"{node.module}.{a.name}") for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(where, a.name) for a in node.names]
    return found


@pytest.mark.parametrize("package", BACKEND_PACKAGES)
def test_a_backend_package_imports_neither_the_registry_nor_another_backend(package):
    registry_names = {"kvxfer.backends", *(f"kvxfer.backends.{name}" for name in registry.__all__)}
    others = tuple(f"kvxfer.backends.{p}." for p in BACKEND_PACKAGES if p != package)
    wrong = [(where, module) for where, module in _imported_by(package)
             if module in registry_names or (module + ".").startswith(others)]
    assert wrong == []


@pytest.mark.parametrize("key", sorted(BUILTIN_BACKENDS))
def test_each_builtin_path_names_its_class_under_its_own_name(key):
    cls = construct_kv_transfer_backend_class(key)
    assert issubclass(cls, KVTransportBackend)
    assert BUILTIN_BACKENDS[key] == f"{cls.__module__}:{cls.__qualname__}"
    assert normalize_name(cls.name) == key


def test_listing_resolves_nixl_before_ucx_and_leaves_the_environment_alone():
    """Listing imports the built-ins in sorted order, as the eager imports did (nixl's module before
    ucx's binding loads), and touches no UCX setting: the nixl backend sets ``UCX_MODULES`` only when
    it creates its agent, before UCX loads there (tests/backends/test_nixl_exit.py)."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    loaded = _loaded_after("""
        from kvxfer.backends import available_backends, transport_probes
        available_backends(); transport_probes()
    """, env=env)
    modules = loaded["modules"]
    assert _backend_modules(modules) == set(BACKEND_PACKAGES)
    if "kvxfer.backends.ucx._ucp_cffi" in modules:  # the binding is built here
        assert modules.index("kvxfer.backends.nixl.backend") < modules.index("kvxfer.backends.ucx._ucp_cffi")
    assert loaded["UCX_MODULES"] is None


def test_a_builtin_name_cannot_be_taken_by_another_class(clean_registry):
    class Impostor(LocalBackend):
        name = "NIXL"

    with pytest.raises(ValueError, match=r"'NIXL' is already registered by kvxfer\.backends\.nixl\.backend\."):
        register_backend(Impostor)
    assert construct_kv_transfer_backend_class("nixl").__name__ == "NixlBackend"


def test_a_builtin_registered_again_is_accepted(clean_registry):
    assert register_backend(LocalBackend) is LocalBackend


def test_a_builtin_that_cannot_import_stays_listed_with_the_reason(clean_registry, monkeypatch):
    monkeypatch.setattr(registry, "BUILTIN_BACKENDS", {**BUILTIN_BACKENDS, "ghost": "kvxfer_no_such_module:Ghost"})
    info = {i.name: i for i in available_backends()}
    assert not info["ghost"].available and "kvxfer_no_such_module" in info["ghost"].reason
    assert info["local"].available
    with pytest.raises(BackendUnavailableError, match="kvxfer_no_such_module"):
        construct_kv_transfer_backend_class("Ghost")


def test_unknown_name_lists_builtins_not_yet_imported(clean_registry, monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", {})
    with pytest.raises(BackendUnavailableError, match=r"known backends: local, nccl, nixl, ucx"):
        construct_kv_transfer_backend_class("rdma9")


# --- one pool spec, the 17 arguments at the entrance only -----------------------------------------
#: The reference's arguments after the buffer and its block count (seed: transfer_backends.base).
TOPOLOGY = ("tp_size", "tp_rank", "num_kv_heads_global", "heads_per_partition", "head_dim", "tokens_per_block",
            "global_rank", "pp_size", "pp_rank", "num_layers_global", "layer_start", "layer_end", "ssm_layout",
            "ssm_state_kind")


def test_compute_buffer_geometry_shows_the_seeds_signature():
    params = list(inspect.signature(compute_buffer_geometry).parameters.values())
    assert [p.name for p in params] == ["memory_buffer", "expected_num_blocks", "backend_name", *TOPOLOGY]
    assert [p.kind for p in params[:2]] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 2
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[2:])
    assert all(p.default is None for p in params[3:])


def test_a_backends_constructor_shows_megatrons_signature():
    params = list(inspect.signature(LocalBackend).parameters.values())
    pool = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in pool] == ["agent_name", "memory_buffer", "expected_num_blocks", *TOPOLOGY]
    assert all(p.default is None for p in pool[3:])
    assert {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY} >= {"timeout_s", "staging_bytes"}
    assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def test_the_pool_arguments_are_written_once():
    """Only ``PoolSpec`` spells the arguments out; the entrances and the geometry read it."""
    written = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "kvxfer").rglob("*.py"))
               if "num_kv_heads_global: Optional[int]" in path.read_text()]
    assert written == ["kvxfer/plan/geometry.py"]
    assert [f.name for f in dataclasses.fields(PoolSpec)] == ["memory_buffer", "expected_num_blocks", *TOPOLOGY]


def _pool() -> torch.Tensor:
    return torch.zeros(2, 2, 6, 4, 2, 8)  # [2, L, B, T, H, d]


def test_a_backend_keeps_the_spec_it_was_given():
    topology = dict(tp_size=2, tp_rank=1, num_kv_heads_global=4, num_layers_global=2, head_dim=8)
    backend = LocalBackend("spec-a", _pool(), 6, **topology)
    try:
        spec = backend.pool_spec
        assert isinstance(spec, PoolSpec) and spec.tp_rank == 1 and spec.memory_buffer is backend.memory_buffer
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.tp_rank = 0  # type: ignore[misc]
        assert backend.geometry == pool_geometry(spec, "local")
        assert backend.geometry == compute_buffer_geometry(spec.memory_buffer, 6, backend_name="t", **topology)
        assert backend.geometry.layout is not None and backend.geometry.layout.tp_rank == 1
    finally:
        backend.close()


def test_the_entrances_take_what_they_took_and_refuse_the_rest():
    pool = _pool()
    positional = LocalBackend("spec-b", pool, 6, 2, 0, 4, None, 8, 4, None, 1, 0, 2)
    assert positional.pool_spec.num_layers_global == 2 and positional.geometry.layout is not None
    positional.close()
    with pytest.raises(TypeError):
        LocalBackend("spec-c", pool, 6, *([None] * 14), "one too many")
    with pytest.raises(TypeError, match="tp_sise"):
        LocalBackend("spec-d", pool, 6, tp_sise=2)
    with pytest.raises(TypeError):
        compute_buffer_geometry(pool, 6, 2, backend_name="t")  # the topology is keyword-only here
