"""The engine layer's layout keeps showing its architecture (issue 22, item 1; docs/architecture.md).

Read from the source (every import, the lazy ones inside functions included): no import
circle in ``engine_integration``; the control-plane packages never import the engine, the
launcher or each other; the coordinator process and the etcd plane never load torch.
"""

from __future__ import annotations

import subprocess
import sys

from import_graph import ROOT, cycle, imports


def _imports() -> dict[str, set[str]]:
    return imports("engine_integration")


def test_no_import_circle_in_the_engine_layer():
    assert cycle(_imports()) == []
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]   # the check can fail


def test_control_plane_packages_stand_apart():
    graph = _imports()
    plane_mods = {m: deps for m, deps in graph.items() if m.startswith("engine_integration.control_plane")}
    for module, deps in plane_mods.items():
        outside = {d for d in deps if not d.startswith("engine_integration.control_plane")
                   and d not in ("engine_integration.descriptor", "engine_integration.procs")}
        assert not outside, f"{module} imports {outside}: a plane sees the engine only through base.PlaneEngine"
        for this, other in (("zmq", "etcd"), ("etcd", "zmq")):
            if module.startswith(f"engine_integration.control_plane.{this}"):
                crossing = {d for d in deps if d.startswith(f"engine_integration.control_plane.{other}")}
                assert not crossing, f"{module} imports {crossing}: one package per plane"
    assert "engine_integration.etcd_engine" not in graph and "engine_integration.etcd_launch" not in graph


def test_the_coordinator_and_the_etcd_plane_never_load_torch():
    code = ("import sys; import engine_integration.control_plane.zmq.coordinator, "
            "engine_integration.control_plane.etcd.plane, engine_integration.control_plane.etcd.service; "
            "print('torch' in sys.modules, 'zmq' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "True"], out.stderr   # zmq: only for the coordinator module
    code = "import sys; import engine_integration.control_plane.etcd.plane; print('torch' in sys.modules, 'zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr
