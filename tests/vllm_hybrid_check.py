"""The hybrid attention+Mamba check of ``tests/test_vllm_hybrid_engine.py`` on the nixl backend.

Not part of the suite (its name does not start with ``test_``; ~45 s, most of it vLLM's start), since
the suite runs the same check on ucx: ``.venv/bin/python -m pytest -p no:cacheprovider -n 0
tests/vllm_hybrid_check.py``.
"""

from __future__ import annotations

import pytest

from tests.test_vllm_hybrid_engine import check_hybrid_handoff, hybrid_model  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.timeout(600)]


def test_hybrid_model_in_real_vllm_is_token_exact_through_the_connector_on_nixl(hybrid_model: str) -> None:
    check_hybrid_handoff(hybrid_model, "nixl")
