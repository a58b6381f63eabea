"""``kvxfer generate --disagg --control-plane etcd://...`` and ``kvxfer info``'s control-plane line (issue 16)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvxfer.cli.args import control_plane_url
from kvxfer.cli.commands import control_plane_line


needs_etcd = pytest.mark.usefixtures("etcd_required")


@pytest.mark.parametrize("url", ["etcd://127.0.0.1:2379", "etcd://", "etcd:///prod?ttl=5&poll=0.25",
                                 "etcd://kvxfer@10.0.0.5:2379,10.0.0.6:2379/prod"])
def test_control_plane_url_accepts(url):
    assert control_plane_url(url) == url


@pytest.mark.parametrize("url, says", [
    ("tcp://127.0.0.1:2379", "is not an etcd:// URL"),
    ("etcd://kvxfer:hunter2@127.0.0.1:2379", "not in the URL"),
    ("etcd://127.0.0.1", "is not host:port"),
    ("etcd://127.0.0.1:99999", "is not host:port"),
    ("etcd://127.0.0.1:2379?ttl=1", "from 2 to 3600"),
    ("etcd://127.0.0.1:2379/bad cluster", "cluster must be"),
])
def test_control_plane_url_refuses_with_the_reason(url, says):
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        control_plane_url(url)



def test_malformed_control_plane_is_one_line_and_exit_2(capsys):
    from kvxfer.cli import main

    status = main(["generate", "--prompts", "docs/prompts.jsonl", "--disagg", "--control-plane", "etcd://nope"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("kvxfer: error:") and "etcd://nope" in err[0]


def test_info_line_without_a_control_plane_names_the_embedded_coordinator():
    assert "embedded ZeroMQ coordinator" in control_plane_line(None)
    assert "demo mode" in control_plane_line("etcd://")


@needs_etcd
def test_info_line_reports_etcd_health():
    from engine_integration.control_plane.etcd.server import EtcdServer, free_port

    with EtcdServer() as server:
        line = control_plane_line(f"etcd://{server.endpoint}/prod?ttl=5")
        assert f"etcd {server.endpoint} cluster 'prod': healthy, etcd 3." in line, line
    dead = control_plane_line(f"etcd://127.0.0.1:{free_port('127.0.0.1')}?ttl=2")
    assert "UNHEALTHY" in dead or "cannot connect" in dead, dead


@needs_etcd
def test_generate_on_etcd_prints_the_colocated_tokens(tmp_path, capsys):
    from engine_integration.launch import generate_colocated, run_generate_command

    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(30, 47))]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    status = run_generate_command(str(path), 6, disagg=True, backend="local", control_plane="etcd:///cli?ttl=2&poll=0.1")
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert status == 0
    assert lines == [list(r.tokens) for r in generate_colocated(prompts, 6)]


# --- push backends on etcd: refused at start, with the reason (issue 22, item 5) ---------------
# A free port where nothing answers: had anything been opened or started (a private etcd in demo
# mode, a connection, a transport), the refusal would not be the first thing to happen.
def _nothing_there() -> str:
    from engine_integration.control_plane.etcd.server import free_port

    return f"etcd://127.0.0.1:{free_port()}/push?ttl=2"


def _listening(url: str) -> bool:
    import socket

    port = int(url.split("127.0.0.1:", 1)[1].split("/", 1)[0])
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_generate_with_a_push_backend_on_etcd_is_one_line_and_exit_2(capsys):
    from kvxfer.cli import main

    url = _nothing_there()
    status = main(["generate", "--prompts", "docs/prompts.jsonl", "--disagg", "--backend", "nccl",
                   "--control-plane", url])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert status == 2 and len(err) == 1, captured.err
    assert err[0].startswith("kvxfer: error: the push backend 'nccl' cannot run on the etcd control plane")
    assert "receives posted before the prefill sends" in err[0] and "--backend ucx" in err[0]
    assert "Traceback" not in captured.err and captured.out == ""
    assert not _listening(url), "a private etcd was started before the refusal"


def test_the_library_refuses_a_push_backend_on_etcd_before_anything_starts():
    from engine_integration.control_plane import push_refusal
    from engine_integration.control_plane.etcd.plane import EtcdPlane
    from engine_integration.engine import DisaggDynamicInferenceEngine, RegistrationRefused
    from engine_integration.launch import ClusterConfig, DisaggCluster
    from engine_integration.reference import ModelConfig, build_reference_engine
    from kvxfer.errors import BackendUnavailableError

    url = _nothing_there()
    assert push_refusal(url, "ucx") is None and push_refusal(None, "nccl") is None
    assert push_refusal("tcp://127.0.0.1:1", "nccl") is None   # the coordinator carries the push order
    assert "etcd carries no such message" in push_refusal(url, "NCCL")
    assert not EtcdPlane.supports_push and EtcdPlane.push_refused_because

    with pytest.raises(BackendUnavailableError, match="push backend 'nccl' cannot run on the etcd control plane"):
        DisaggCluster(ClusterConfig(backend="nccl", control_plane=url))
    engine = build_reference_engine(ModelConfig(), 32, engine_cls=DisaggDynamicInferenceEngine)
    with pytest.raises(RegistrationRefused, match="push backend 'nccl' cannot run on the etcd control plane"):
        engine.connect(url, role="decode", name="d-push", backend="nccl")
    assert engine.plane is None   # nothing opened, nothing registered
    assert not _listening(url)
