"""Every number kvxfer reads from its command line, a control-plane URL, the environment or a config is finite
and bounded, and a bad one is refused with one line naming the setting and its range (issue 49, item 5).

The command-line options are found in the parser itself, not listed here: an option whose type carries its
range (``bounds``, set by ``kvxfer.cli.args.whole_number`` / ``seconds``) is tried with ``inf``, ``nan``,
``-1``, ``1e308`` and ``10**30`` through ``kvxfer.cli.main`` (the command's own entry: exit status 2, one
line, nothing run) and at both edges of its range; any other option must be named below as carrying no
number, or as a structured one with its own probes. So an option added with ``type=int`` or ``type=float``,
or with a numeric type of its own that has no range, fails ``test_every_option_is_bounded_or_not_a_number``.
"""

from __future__ import annotations

import argparse
import math

import pytest

import kvxfer.cli
from kvxfer.cli import build_parser, main
from kvxfer.defaults import MAX_TIMEOUT_S, SettingError, bounded_float, bounded_int

BAD_NUMBERS = ("inf", "-inf", "nan", "-1", "1e308", "1e999", str(10**30), "9" * 5000)

#: Options that take a value but no number (paths, names, lists of names, free text), and why.
NOT_NUMBERS = {
    ("info", "--control-plane"): "a URL: its numbers are probed by URL_PROBES",
    ("loopback", "--backend"): "a backend name",
    ("loopback", "--json"): "a path",
    ("soak", "--backend"): "a backend name",
    ("soak", "--json"): "a path",
    ("generate", "--prompts"): "a path",
    ("generate", "--backend"): "a backend name",
    ("generate", "--control-plane"): "a URL: its numbers are probed by URL_PROBES",
    ("bench", "--backends"): "backend names",
    ("bench", "--baselines"): "baseline names",
    ("bench", "--device"): "cpu or cuda[:N]",
    ("bench", "--patterns"): "pattern names",
    ("bench", "--mooncake-python"): "a path",
    ("bench", "--note"): "free text",
    ("bench", "--json"): "a path",
    ("bench", "--plot"): "a path",
    ("bench", "--markdown"): "a path",
    ("bench-vllm", "--targets"): "target names",
    ("bench-vllm", "--model"): "a path",
    ("bench-vllm", "--json"): "a path",
    ("bench-sglang", "--targets"): "target names",
    ("bench-sglang", "--json"): "a path",
    ("bench-prefix-routing", "--planes"): "plane names",
    ("bench-prefix-routing", "--backend"): "a backend name",
    ("bench-prefix-routing", "--json"): "a path",
    ("bench-fleet-scale", "--sizes"): "PxD fleets: probed by test_fleet_sizes_are_bounded",
    ("bench-fleet-scale", "--planes"): "plane names",
    ("bench-fleet-scale", "--out"): "a path",
}


def _options() -> list[tuple[str, argparse.Action]]:
    """(command, action) for every option of every subcommand that takes a value."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    return [(name, action) for name, sub in commands.items() for action in sub._actions
            if action.option_strings and action.nargs != 0 and action.option_strings[-1] not in ("--help",)]


OPTIONS = _options()
#: Every option that takes a value which is not one of fixed choices nor named in NOT_NUMBERS: a number.
NUMERIC = [(command, action) for command, action in OPTIONS
           if not action.choices and (command, action.option_strings[-1]) not in NOT_NUMBERS]


def _figure(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else repr(number)


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch):
    """``main`` parses with the real parser, but a command line it accepts runs nothing: it returns 0 (a
    value let through is then a plain failure here, not a bench or a fleet started by the test)."""
    def parser_that_runs_nothing() -> argparse.ArgumentParser:
        parser = build_parser()
        for sub in next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices.values():
            sub.set_defaults(func=lambda args: 0)
        return parser

    monkeypatch.setattr(kvxfer.cli, "build_parser", parser_that_runs_nothing)


def _refused(argv: list[str], capsys) -> str:
    """Run the command line; it must exit 2 with one ``kvxfer: error:`` line and print nothing else."""
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 2, (argv, status, out, err)
    assert out == "", (argv, out)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvxfer: error: "), (argv, err)
    assert "Traceback" not in err
    return lines[0]


def test_every_option_is_bounded_or_not_a_number():
    unbounded = [f"{command} {action.option_strings[-1]} (type {getattr(action.type, '__name__', action.type)})"
                 for command, action in OPTIONS
                 if not hasattr(action.type, "bounds") and not action.choices
                 and (command, action.option_strings[-1]) not in NOT_NUMBERS]
    assert unbounded == [], ("options with no range: give them kvxfer.cli.args.whole_number(low, high) or "
                             f"seconds(low, high), or list them in NOT_NUMBERS if they carry no number: {unbounded}")
    assert not any(action.type in (int, float) for _, action in OPTIONS)
    assert len(NUMERIC) >= 40 and len(NOT_NUMBERS) >= 25, NUMERIC  # the parser was really walked


@pytest.mark.parametrize("command,action", NUMERIC, ids=[f"{c} {a.option_strings[-1]}" for c, a in NUMERIC])
def test_a_numeric_option_refuses_what_is_not_a_finite_number_in_range(command, action, capsys):
    option, parse = action.option_strings[-1], action.type
    lines = [_refused([command, f"{option}={bad}"], capsys)  # --opt=VALUE: argparse takes "-inf" for an option
             for bad in BAD_NUMBERS]
    assert all(f"argument {option}:" in line for line in lines), lines
    assert hasattr(parse, "bounds"), f"{command} {option}: its type states no range (whole_number / seconds)"
    low, high = parse.bounds
    assert all(f"from {_figure(low)} to {_figure(high)}" in line for line in lines), lines
    for edge in (low, high):
        parse(str(edge))  # the range is what the option takes, not only what the message says
    below = low - 1 if isinstance(low, int) else low / 2
    above = high + 1 if isinstance(high, int) else high * 2
    for outside in (below, above):
        line = _refused([command, f"{option}={outside}"], capsys)
        assert f"argument {option}:" in line and f"from {_figure(low)} to {_figure(high)}" in line, line


URL_PROBES = [
    ("ttl=inf", "ttl="), ("ttl=1e308", "ttl="), ("ttl=1", "ttl="), ("ttl=100000000000", "ttl="),
    ("poll=inf", "poll="), ("poll=nan", "poll="), ("poll=0", "poll="), ("poll=1e308", "poll="),
    ("handoff_timeout=inf", "handoff_timeout="), ("handoff_timeout=1e308", "handoff_timeout="),
    ("handoff_timeout=0", "handoff_timeout="), ("handoff_timeout=-1", "handoff_timeout="),
]


@pytest.mark.parametrize("query,names", URL_PROBES, ids=[q for q, _ in URL_PROBES])
@pytest.mark.parametrize("command", ["info", "generate"])
def test_a_control_plane_url_number_is_finite_and_in_range(command, query, names, capsys):
    line = _refused([command, "--control-plane", f"etcd://127.0.0.1:1/fleet?{query}"], capsys)
    assert names in line and "--control-plane" in line and " to " in line, line


def test_a_control_plane_url_in_range_is_taken():
    from kvxfer.cli.args import control_plane_url

    for url in ("etcd://127.0.0.1:1/fleet?ttl=2&poll=0.001&handoff_timeout=0.001",
                "etcd://127.0.0.1:1/fleet?ttl=3600&poll=60&handoff_timeout=86400"):
        assert control_plane_url(url) == url


@pytest.mark.parametrize("sizes", ["1000x1", "1x257", "1x10000000000000000000000", "1e308x1", "infx1", "-1x2"])
def test_fleet_sizes_are_bounded(sizes, capsys):
    line = _refused(["bench-fleet-scale", f"--sizes={sizes}"], capsys)
    assert "argument --sizes:" in line, line


# ---------------------------------------------------------------- the environment

@pytest.mark.parametrize("raw", [*BAD_NUMBERS, "1000001", "2.5", "lots"])
def test_nixl_progress_delay_from_the_environment_is_bounded(raw, monkeypatch):
    from kvxfer.backends.nixl.environment import PROGRESS_DELAY_ENV, progress_delay_us
    from kvxfer.errors import BackendUnavailableError

    monkeypatch.setenv(PROGRESS_DELAY_ENV, raw)
    with pytest.raises(BackendUnavailableError) as refused:
        progress_delay_us()
    assert PROGRESS_DELAY_ENV in str(refused.value) and "from 0 to 1000000" in str(refused.value)


def test_nixl_progress_delay_edges_and_default(monkeypatch):
    from kvxfer.backends.nixl.environment import (DEFAULT_PROGRESS_DELAY_US, PROGRESS_DELAY_ENV,
                                                  nixl_transport_probe, progress_delay_us)

    for raw, want in (("0", 0), ("1000000", 1_000_000), (" 5000 ", 5000), ("", DEFAULT_PROGRESS_DELAY_US)):
        monkeypatch.setenv(PROGRESS_DELAY_ENV, raw)
        assert progress_delay_us() == want
    monkeypatch.setenv(PROGRESS_DELAY_ENV, "inf")  # kvxfer info shows the refusal rather than failing
    assert nixl_transport_probe()["progress_delay_us"].startswith(f"REFUSED: {PROGRESS_DELAY_ENV}='inf'")


# ---------------------------------------------------------------- configs built in code

def _configs():
    from engine_integration.control_plane.zmq.coordinator import CoordinatorConfig
    from engine_integration.launch import ClusterConfig
    from kvxfer.bench.config import BenchConfig
    from kvxfer.harness.loopback_config import LoopbackConfig
    from kvxfer.harness.soak import SoakConfig

    return [(CoordinatorConfig, name) for name in ("heartbeat_timeout_s", "request_timeout_s", "tick_s",
                                                   "handshake_timeout_s", "session_grace_s", "pin_grace_s",
                                                   "stuck_reader_grace_s", "port", "max_frame_bytes",
                                                   "max_connections", "max_sessions")] + [
        (ClusterConfig, "transfer_timeout_s"), (ClusterConfig, "prefill_blocks"), (ClusterConfig, "decode_blocks"),
        (LoopbackConfig, "timeout_s"), (SoakConfig, "timeout_s"), (BenchConfig, "timeout_s")]


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1, 1e308, 10**30])
def test_a_config_refuses_a_number_that_is_not_finite_or_in_range(bad):
    for cls, name in _configs():
        with pytest.raises(ValueError, match=name):
            cls(**{name: bad})
    from engine_integration.control_plane.zmq.plane import CoordinatorPlane

    for name in ("heartbeat_interval_s", "coordinator_timeout_s"):  # an engine's side of the coordinator
        with pytest.raises(ValueError, match=name):
            CoordinatorPlane("tcp://127.0.0.1:1", insecure=True, **{name: bad})


# ---------------------------------------------------------------- the rule itself

@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999", math.inf, math.nan, True, None, "", "1e308", 10**400])
def test_bounded_float_refuses_and_names_the_setting(value):
    with pytest.raises(SettingError, match=r"^KVXFER_X=.* \(give a number of seconds from 0\.001 to 86400\)$"):
        bounded_float("KVXFER_X", value, 0.001, MAX_TIMEOUT_S, unit="a number of seconds")


@pytest.mark.parametrize("value", ["inf", "nan", "1e3", "2.5", 2.5, math.inf, True, "9" * 5000, 10**30, -1, "0x10"])
def test_bounded_int_refuses_and_names_the_setting(value):
    with pytest.raises(SettingError, match=r"^--count=.* \(give a whole number from 0 to 4096\)$") as refused:
        bounded_int("--count", value, 0, 4096)
    assert len(str(refused.value)) < 120  # a 5,000-digit value is not echoed whole


def test_bounded_numbers_in_range_are_taken():
    assert bounded_float("x", " 0.5 ", 0.001, 1.0) == 0.5 and bounded_float("x", 1, 0.001, 1.0) == 1.0
    assert bounded_int("x", "4096", 0, 4096) == 4096 and bounded_int("x", 7.0, 0, 8) == 7
    assert isinstance(bounded_int("x", 7.0, 0, 8), int)


@pytest.mark.parametrize("raw", BAD_NUMBERS + ("0",))
def test_the_transfer_timeout_from_the_environment_is_bounded(raw, monkeypatch):
    """``KVXFER_TRANSFER_TIMEOUT_S`` (how Megatron's users bound ``wait()``): ``1e308`` once passed."""
    from kvxfer.backends.base import TIMEOUT_ENV, transfer_timeout_from_env
    from kvxfer.errors import BackendUnavailableError

    monkeypatch.setenv(TIMEOUT_ENV, raw)
    with pytest.raises(BackendUnavailableError) as refused:
        transfer_timeout_from_env()
    assert TIMEOUT_ENV in str(refused.value) and "from 0.001 to 86400" in str(refused.value)
    monkeypatch.setenv(TIMEOUT_ENV, "86400")
    assert transfer_timeout_from_env() == 86400.0


@pytest.mark.parametrize("raw", ["65GiB", "99999999999GiB", "9" * 5000, "-1", "inf"])
def test_the_staging_size_from_the_environment_is_bounded(raw):
    from kvxfer.backends.staging import STAGING_ENV, staging_bytes_from_env
    from kvxfer.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match=STAGING_ENV):
        staging_bytes_from_env({STAGING_ENV: raw})
    assert staging_bytes_from_env({STAGING_ENV: "64GiB"}) == 64 << 30
    assert staging_bytes_from_env({STAGING_ENV: "0"}) == 0


def test_the_transfer_timeout_has_one_default():
    """The command line, the harness and the benches read ``kvxfer.defaults.TRANSFER_TIMEOUT_S`` (issue 52 item
    7: four of them said 60 s beside the backends' 30)."""
    from kvxfer.bench.config import BenchConfig
    from kvxfer.defaults import TRANSFER_TIMEOUT_S
    from kvxfer.harness.loopback_config import LoopbackConfig
    from kvxfer.harness.soak import SoakConfig

    defaults = {f"{command} --timeout": action.default for command, action in OPTIONS
                if "--timeout" in action.option_strings and command in ("loopback", "bench", "soak")}
    assert len(defaults) == 3, defaults
    assert set(defaults.values()) == {TRANSFER_TIMEOUT_S}, defaults
    assert LoopbackConfig().timeout_s == BenchConfig().timeout_s == SoakConfig().timeout_s == TRANSFER_TIMEOUT_S


@pytest.mark.parametrize("query", ["ttl=inf", "ttl=1", "ttl=100000000000", "poll=nan", "poll=1e308",
                                   "handoff_timeout=inf", "handoff_timeout=1e308", "handoff_timeout=-1"])
def test_an_etcd_url_opened_from_code_is_bounded_too(query):
    """``EtcdPlane.open`` (an engine opening its plane from a URL in code, not through the command line)."""
    from engine_integration.control_plane.etcd.plane import EtcdPlane

    name = query.split("=")[0]
    with pytest.raises(ValueError, match=f"etcd URL: {name}="):
        EtcdPlane.open(f"etcd://127.0.0.1:1/fleet?{query}", insecure=True)


def test_the_sglang_managers_numbers_from_the_environment_are_bounded():
    """``KVXFER_SGLANG_MAX_ROOMS`` (a bare ``int()``: negative or 10**30 taken) and ``KVXFER_SGLANG_HEARTBEAT_S``
    (a bare ``float()``: inf and nan taken) are read with the shared rule, in the manager's constructor: the
    source is checked here, where SGLang is not installed."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[2] / "kvxfer/integrations/sglang/conn.py").read_text())
    reads = {ast.unparse(node.args[0]): ast.unparse(node.func) for node in ast.walk(tree)
             if isinstance(node, ast.Call) and node.args and ast.unparse(node.args[0]) in ("MAX_ROOMS_ENV", "HEARTBEAT_ENV")
             and not ast.unparse(node.func).endswith("get")}
    assert reads == {"MAX_ROOMS_ENV": "bounded_int", "HEARTBEAT_ENV": "bounded_float"}, reads
