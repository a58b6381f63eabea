"""Fixtures the vLLM connector's tests share."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Iterator

import pytest


@pytest.fixture
def keyless(monkeypatch: pytest.MonkeyPatch) -> Iterator[ExitStack]:
    """No cluster key (the default deployment, where strangers can talk to us), and an exit stack for the
    processes the test starts."""
    monkeypatch.delenv("KVXFER_SECRET_FILE", raising=False)
    monkeypatch.delenv("KVXFER_ALLOW_UNAUTHENTICATED_METAS", raising=False)
    with ExitStack() as stack:
        yield stack
