"""What the engine layer's processes load (issue 22, item 1; docs/architecture.md).

Which part of ``engine_integration`` may import which (no circle, the plane packages never the engine, the
launcher or each other) is ``LAYERS`` in tests/project/test_library_layout.py, with the library's. Here: the
coordinator process and the etcd plane never load torch, whatever their imports, and inside the etcd package
the roles stand apart (membership below both roles, the plane above them).
"""

from __future__ import annotations

import subprocess
import sys

from import_graph import ROOT, imports


def test_the_coordinator_and_the_etcd_plane_never_load_torch():
    code = ("import sys; import engine_integration.control_plane.zmq.coordinator, "
            "engine_integration.control_plane.etcd.plane, engine_integration.control_plane.etcd.service; "
            "print('torch' in sys.modules, 'zmq' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "True"], out.stderr   # zmq: only for the coordinator module
    code = "import sys; import engine_integration.control_plane.etcd.plane; print('torch' in sys.modules, 'zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_the_etcd_roles_stand_apart():
    etcd = "engine_integration.control_plane.etcd"
    graph = imports("engine_integration")
    never = {"membership": {"prefill_role", "decode_role", "plane"}, "prefill_role": {"decode_role", "plane"},
             "decode_role": {"prefill_role", "plane"}}
    wrong = sorted(f"{module} -> {dep}" for module, forbidden in never.items()
                   for dep in graph[f"{etcd}.{module}"] if dep.rpartition(".")[2] in forbidden)
    assert wrong == [], wrong
    assert f"{etcd}.membership" in graph[f"{etcd}.prefill_role"]  # the check reads real imports
