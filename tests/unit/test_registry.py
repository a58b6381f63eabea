import sys
import textwrap

import pytest
import torch

import kvxfer.backends as registry
from kvxfer.backends import (
    available_backends,
    construct_kv_transfer_backend_class,
    default_backend_name,
    register_backend,
)
from kvxfer.backends.local.backend import LocalBackend
from kvxfer.errors import BackendUnavailableError


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_BROKEN_PLUGINS", {})
    monkeypatch.setattr(registry, "_plugins_loaded", False)


@pytest.mark.parametrize("name", ["local", "LOCAL", " Local "])
def test_lookup_is_case_insensitive(name):
    assert construct_kv_transfer_backend_class(name) is LocalBackend


def test_dash_and_underscore_are_the_same(clean_registry):
    @register_backend
    class MyBackend(LocalBackend):
        name = "my_transport"

    assert construct_kv_transfer_backend_class("My-Transport") is MyBackend


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(BackendUnavailableError, match=r"unknown backend 'rdma9'; known backends: .*local"):
        construct_kv_transfer_backend_class("rdma9")


def test_unavailable_backend_is_listed_and_refuses_construction_with_the_fix(clean_registry):
    @register_backend
    class NeedsDriver(LocalBackend):
        name = "needs-driver"

        @classmethod
        def availability(cls):
            return False, "libfoo is missing; fix: pip install foo==1.0"

    info = {i.name: i for i in available_backends()}["needs-driver"]
    assert not info.available and "pip install foo==1.0" in info.reason
    cls = construct_kv_transfer_backend_class("needs-driver")
    with pytest.raises(BackendUnavailableError, match="pip install foo==1.0"):
        cls("a", torch.zeros(2, 4, 3), 4)


def test_default_is_the_best_available():
    runnable = [i.name for i in available_backends() if i.available]
    assert default_backend_name() == next(n for n in registry.PREFERENCE if n in runnable)


def _install_plugin(tmp_path, module_source, entry):
    """Create a real installed distribution with a ``kvxfer.backends`` entry point."""
    (tmp_path / "kvx_demo_plugin.py").write_text(textwrap.dedent(module_source))
    dist = tmp_path / "kvx_demo_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvx-demo-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[kvxfer.backends]\n{entry}\n")


def test_third_party_backend_registers_through_the_entry_point(clean_registry, tmp_path, monkeypatch):
    _install_plugin(tmp_path, """
        from kvxfer.backends.local.backend import LocalBackend
        class DemoBackend(LocalBackend):
            name = "demo"
    """, "demo = kvx_demo_plugin:DemoBackend")
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = construct_kv_transfer_backend_class("demo")
    assert cls.__name__ == "DemoBackend"
    assert "demo" in {i.name for i in available_backends()}
    sys.modules.pop("kvx_demo_plugin", None)


def test_broken_plugin_is_reported_not_fatal(clean_registry, tmp_path, monkeypatch):
    _install_plugin(tmp_path, "import does_not_exist_anywhere\n", "broken = kvx_demo_plugin:Nope")
    monkeypatch.syspath_prepend(str(tmp_path))
    info = {i.name: i for i in available_backends()}
    assert not info["broken"].available and "does_not_exist_anywhere" in info["broken"].reason
    assert info["local"].available
    with pytest.raises(BackendUnavailableError, match="failed to load"):
        construct_kv_transfer_backend_class("broken")
    sys.modules.pop("kvx_demo_plugin", None)

