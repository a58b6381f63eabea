"""A shortened soak in CI (the full 2,000-handoff run is `kvxfer soak`, see the README)."""

import pytest

from kvxfer.backends import available_backends
from kvxfer.harness.soak import SoakConfig, run_soak

CROSS_PROCESS = [i.name for i in available_backends() if i.available and i.name != "local"]


@pytest.mark.parametrize("backend", ["local", *CROSS_PROCESS])
def test_short_soak_verifies_every_byte_and_leaks_nothing(backend):
    report = run_soak(SoakConfig(backend=backend, handoffs=120, in_flight=8))
    assert report.failures == [] and report.mismatches == 0 and report.bytes_lost == 0
    assert report.handoffs_done == 120 and report.bytes_verified > 0
    assert report.prefill_pinned_at_end == 0
    assert report.decode_open_handles_at_end == 0 and report.decode_reserved_at_end == 0
    assert all(growth < 256 for growth in report.rss_growth_mib.values())
    assert report.ok
