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
    ("etcd://127.0.0.1:2379?ttl=1", "ttl must be >= 2"),
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
