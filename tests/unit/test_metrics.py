"""kvxfer.runtime.metrics: the backends' counters, as a Prometheus scrape shows them."""

from __future__ import annotations

import torch
import pytest

from kvxfer.backends import construct_kv_transfer_backend_class
from tests.conftest import random_pool

import prometheus_client  # noqa: E402  (a test dependency: missing it is a failure, not a skip)

from kvxfer.runtime.metrics import KVXferCollector, register  # noqa: E402

SHAPE = (2, 2, 10, 4, 1, 16)  # [2, L, B, T, H, d]


def _pair():
    cls = construct_kv_transfer_backend_class("local")
    src = cls("metrics-src", random_pool(SHAPE, torch.float32, seed=1), 10)
    dst = cls("metrics-dst", random_pool(SHAPE, torch.float32, seed=2), 10)
    return src, dst


def test_counters_appear_in_the_registry_after_a_transfer():
    src, dst = _pair()
    registry = prometheus_client.CollectorRegistry()
    register([src, dst], registry=registry)
    before = registry.get_sample_value("kvxfer_transfers_completed_total", {"backend": "local", "agent": "metrics-dst"})
    assert before == 0
    dst.begin_pull_blocks(src.export_meta(), [1, 2, 5], [0, 3, 4], request_id=7).wait(5)
    assert src.drain_read_done() == [7]
    labels = {"backend": "local", "agent": "metrics-dst"}
    assert registry.get_sample_value("kvxfer_transfers_started_total", labels) == 1
    assert registry.get_sample_value("kvxfer_transfers_completed_total", labels) == 1
    slice_bytes = 4 * 1 * 16 * 4
    assert registry.get_sample_value("kvxfer_bytes_completed_total", labels) == 3 * 4 * slice_bytes
    assert registry.get_sample_value("kvxfer_transfers_in_flight", labels) == 0
    assert registry.get_sample_value("kvxfer_read_done_received_total", {"backend": "local", "agent": "metrics-src"}) == 1
    text = prometheus_client.generate_latest(registry).decode()
    assert 'kvxfer_descriptors_posted_total{agent="metrics-dst",backend="local"}' in text
    src.close()
    dst.close()
    assert "metrics-dst" not in prometheus_client.generate_latest(registry).decode()  # closed backends drop out


def test_collector_follows_added_and_removed_backends():
    src, dst = _pair()
    collector = KVXferCollector()
    registry = prometheus_client.CollectorRegistry()
    registry.register(collector)
    collector.add(dst)
    assert registry.get_sample_value("kvxfer_transfers_started_total", {"backend": "local", "agent": "metrics-dst"}) == 0
    collector.remove(dst)
    assert registry.get_sample_value("kvxfer_transfers_started_total", {"backend": "local", "agent": "metrics-dst"}) is None
    src.close()
    dst.close()


def test_missing_prometheus_client_says_how_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_prometheus(name, *args, **kwargs):
        if name.startswith("prometheus_client"):
            raise ImportError("No module named 'prometheus_client'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    with pytest.raises(ImportError, match=r"kvxfer\[prometheus\]"):
        KVXferCollector()
