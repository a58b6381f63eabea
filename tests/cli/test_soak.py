"""A shortened soak in CI (the full 2,000-handoff run is `kvxfer soak`, see the README)."""

import pytest

from kvxfer.backends import available_backends
from kvxfer.harness.soak import SoakConfig, run_soak

CROSS_PROCESS = [i.name for i in available_backends() if i.available and not i.is_push and i.name != "local"]


@pytest.mark.parametrize("backend", ["local", *CROSS_PROCESS])
def test_short_soak_verifies_every_byte_and_leaks_nothing(backend):
    report = run_soak(SoakConfig(backend=backend, handoffs=120, in_flight=8))
    assert report.failures == [] and report.mismatches == 0 and report.bytes_lost == 0
    assert report.handoffs_done == 120 and report.bytes_verified > 0
    assert report.prefill_pinned_at_end == 0
    assert report.decode_open_handles_at_end == 0 and report.decode_reserved_at_end == 0
    assert all(growth < 256 for growth in report.rss_growth_mib.values())
    assert report.ok


# ---- the two-process harness (kvxfer.harness.child) every soak, loopback and bench run goes through


def _raising_body(pipe, message):  # runs in the spawned child
    pipe.send("hello", None)
    raise ValueError(message)


def _exiting_body(pipe, code):
    import os

    os._exit(code)


def _silent_body(pipe):
    pipe.recv()  # waits for the parent, says nothing


def test_a_child_exception_reaches_the_parent_as_the_childs_own_error():
    from kvxfer.harness.child import Child, ChildError

    with Child("prefill", _raising_body, "the pool is on fire") as child:
        assert child.recv(30, expected="hello") == ("hello", None)
        with pytest.raises(ChildError) as err:
            child.recv(30)
    assert str(err.value) == "prefill: ValueError: the pool is on fire"
    assert "_raising_body" in err.value.child_traceback


def test_a_child_that_dies_silently_is_reported_with_its_exit_code():
    from kvxfer.harness.child import Child, ChildExited

    with Child("prefill", _exiting_body, 3) as child:
        with pytest.raises(ChildExited) as err:
            child.recv(30)
    assert err.value.exitcode == 3 and "exited with code 3" in str(err.value)


def test_a_silent_child_times_out_and_is_killed():
    from kvxfer.harness.child import Child, ChildTimeout

    child = Child("source", _silent_body, join_timeout_s=0.5)
    with pytest.raises(ChildTimeout, match="no 'ready' from the source process"):
        child.recv(0.5, expected="ready")
    child.close()
    assert not child.is_alive()


def test_soak_reports_the_prefill_childs_error_not_an_eoferror():
    report = run_soak(SoakConfig(backend="no-such-backend", handoffs=4))
    assert not report.ok
    assert report.failures == [report.failures[0]] and report.failures[0].startswith("prefill: BackendUnavailableError")
    assert "EOFError" not in report.failures[0]


def test_soak_reports_progress():
    seen = []
    report = run_soak(SoakConfig(backend="local", handoffs=20, in_flight=4), on_progress=lambda d, t: seen.append((d, t)))
    assert report.ok and seen[-1] == (20, 20) and all(t == 20 for _, t in seen)
