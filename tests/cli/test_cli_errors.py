"""Every user mistake ends in one line on stderr, the right exit status, and no traceback.

Each case runs the real command in a subprocess, as a user would: ``python -m kvxfer``.
Usage errors exit 2 before anything runs (nothing on stdout); a run that fails exits 1.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SMALL = ["--layers", "4", "--heads", "2", "--head-dim", "32", "--pool-blocks", "64", "--blocks", "24"]
UNWRITABLE = "/proc/no/such/dir/x.json"


def _kvxfer(*args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvxfer", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


def _files(tmp_path):
    (tmp_path / "not-json.jsonl").write_text("[1, 2, 3]\nthis is not json\n")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "dict.jsonl").write_text('{"tokens": [1, 2]}\n')
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00\x81")
    (tmp_path / "good.jsonl").write_text("[1, 2, 3]\n")
    (tmp_path / "a-file").write_text("")


# (name, argv with {tmp} for the test's folder, what stderr must mention)
USAGE_MISTAKES = [
    ("no command", [], "required"),
    ("unknown command", ["frobnicate"], "invalid choice"),
    ("unknown option", ["loopback", "--frobnicate"], "unrecognized arguments"),
    ("loopback unknown backend", ["loopback", "--backend", "nope", *SMALL], "unknown backend 'nope'"),
    ("loopback zero blocks", ["loopback", "--blocks", "0"], "--blocks"),
    ("loopback negative blocks", ["loopback", "--blocks", "-3"], "--blocks"),
    ("loopback blocks over pool", ["loopback", "--blocks", "100", "--pool-blocks", "10"], "--pool-blocks"),
    ("loopback zero heads", ["loopback", "--heads", "0"], "--heads"),
    ("loopback not a number", ["loopback", "--layers", "many"], "--layers"),
    ("loopback negative timeout", ["loopback", "--timeout", "-1"], "--timeout"),
    ("loopback nan timeout", ["loopback", "--timeout", "nan"], "--timeout"),
    ("loopback negative seed", ["loopback", "--seed", "-1"], "--seed"),
    ("loopback unknown dtype", ["loopback", "--dtype", "int8"], "--dtype"),
    ("loopback unknown pattern", ["loopback", "--pattern", "diagonal"], "--pattern"),
    ("loopback pool size clashes", ["loopback", "--pool-blocks", "32", "--blocks", "4"], "--layers"),
    ("loopback pools do not fit", ["loopback", "--layers", "4096", "--pool-blocks", "100000", "--blocks", "1"],
     "GiB"),
    ("loopback json is a folder", ["loopback", *SMALL, "--json", "{tmp}"], "is a directory"),
    ("loopback json under a file", ["loopback", *SMALL, "--json", "{tmp}/a-file/out.json"], "not a directory"),
    ("soak unknown backend", ["soak", "--backend", "foo"], "unknown backend 'foo'"),
    ("soak zero in flight", ["soak", "--in-flight", "0"], "--in-flight"),
    ("soak too many in flight", ["soak", "--in-flight", "100"], "--in-flight"),
    ("soak zero handoffs", ["soak", "--handoffs", "0"], "--handoffs"),
    ("soak zero timeout", ["soak", "--timeout", "0"], "--timeout"),
    # No number is taken that is not finite and in range (issue 49): tests/unit/test_settings_bounds.py tries every
    # option in-process; these few go through the real command, as a user (or an attacker) would.
    ("loopback infinite timeout", ["loopback", "--timeout", "inf"], "from 0.001 to 86400"),
    ("soak 1e308 timeout", ["soak", "--timeout", "1e308"], "from 0.001 to 86400"),
    ("loopback huge layers", ["loopback", "--layers", str(10**30)], "from 1 to 4096"),
    ("fleet infinite poll", ["bench-fleet-scale", "--poll", "inf"], "--poll"),
    ("fleet huge hosts", ["bench-fleet-scale", "--hosts", "99999999999"], "--hosts"),
    ("generate url infinite poll", ["generate", "--prompts", "{tmp}/good.jsonl", "--disagg", "--control-plane",
                                    "etcd://?poll=inf"], "poll='inf'"),
    ("generate url 1e308 handoff timeout", ["generate", "--prompts", "{tmp}/good.jsonl", "--disagg",
                                            "--control-plane", "etcd://?handoff_timeout=1e308"], "handoff_timeout"),
    ("generate missing prompts option", ["generate"], "--prompts"),
    ("generate prompts missing", ["generate", "--prompts", "/nonexistent.jsonl"], "does not exist"),
    ("generate prompts a folder", ["generate", "--prompts", "{tmp}"], "not a file"),
    ("generate prompts not json", ["generate", "--prompts", "{tmp}/not-json.jsonl"], "not-json.jsonl:2"),
    ("generate prompts empty", ["generate", "--prompts", "{tmp}/empty.jsonl"], "no prompts"),
    ("generate prompts not lists", ["generate", "--prompts", "{tmp}/dict.jsonl"], "list of token ids"),
    ("generate prompts binary", ["generate", "--prompts", "{tmp}/binary.jsonl"], "not a text file"),
    ("generate zero new tokens", ["generate", "--prompts", "{tmp}/good.jsonl", "--max-new-tokens", "0"],
     "--max-new-tokens"),
    ("generate backend without disagg", ["generate", "--prompts", "{tmp}/good.jsonl", "--backend", "local"],
     "--disagg"),
    ("generate unknown backend", ["generate", "--prompts", "{tmp}/good.jsonl", "--disagg", "--backend", "nope"],
     "unknown backend 'nope'"),
    ("bench unknown backend", ["bench", "--tiny", "--backends", "nope", "--baselines", "none"], "unknown backend 'nope'"),
    ("bench size not a multiple", ["bench", "--sizes", "100"], "multiple of 256"),
    ("bench size not a size", ["bench", "--sizes", "lots"], "not a size"),
    ("bench zero repeats", ["bench", "--repeats", "0"], "--repeats"),
    ("bench unknown baseline", ["bench", "--baselines", "magic"], "unknown baseline"),
    ("bench unknown pattern", ["bench", "--patterns", "diagonal"], "unknown pattern"),
    ("bench empty block list", ["bench", "--blocks", ","], "empty list"),
    ("bench missing interpreter", ["bench", "--mooncake-python", "/nonexistent/python"], "does not exist"),
    ("bench json is a folder", ["bench", "--json", "{tmp}"], "is a directory"),
    # An output path that cannot be written is found before the run, not after it (issue 41): every
    # command's every output path. /proc takes no new folder, even from root (whom access() tells yes).
    ("loopback json unwritable", ["loopback", *SMALL, "--json", UNWRITABLE], "cannot write"),
    ("soak json unwritable", ["soak", "--json", UNWRITABLE], "cannot write"),
    ("bench json unwritable", ["bench", "--json", UNWRITABLE], "cannot write"),
    ("bench plot unwritable", ["bench", "--plot", UNWRITABLE], "cannot write"),
    ("bench markdown unwritable", ["bench", "--markdown", UNWRITABLE], "cannot write"),
    ("bench-vllm json unwritable", ["bench-vllm", "--json", UNWRITABLE], "cannot write"),
    ("bench-prefix-routing json unwritable", ["bench-prefix-routing", "--json", UNWRITABLE], "cannot write"),
    ("bench-fleet-scale out unwritable", ["bench-fleet-scale", "--out", UNWRITABLE], "cannot write"),
]


def _assert_one_line_error(out: subprocess.CompletedProcess, status: int, mentions: str) -> str:
    assert out.returncode == status, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    line = lines[0]
    assert line.startswith("kvxfer: error: ") and line.endswith(")"), line
    assert mentions in line, line
    return line


@pytest.fixture(scope="module")
def usage_runs(tmp_path_factory):
    """Every mistake's command, run as its own process, several at once: each spends its ~2 s
    starting Python and importing, so one after another they cost the suite a minute and a half."""
    from concurrent.futures import ThreadPoolExecutor

    folders = {name: tmp_path_factory.mktemp("usage") for name, _, _ in USAGE_MISTAKES}  # made here: not thread-safe

    def run(case):
        name, argv, _ = case
        folder = folders[name]
        _files(folder)
        return name, (_kvxfer(*[a.replace("{tmp}", str(folder)) for a in argv], cwd=folder), folder)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(run, USAGE_MISTAKES))


@pytest.mark.parametrize("name,argv,mentions", USAGE_MISTAKES, ids=[c[0] for c in USAGE_MISTAKES])
def test_a_usage_mistake_is_one_line_exit_2_and_nothing_runs(usage_runs, name, argv, mentions):
    out, tmp_path = usage_runs[name]
    _assert_one_line_error(out, 2, mentions)
    assert out.stdout == "", "nothing may run (or print) before a usage error"
    assert not (tmp_path / "bench-results").exists()


def test_debug_shows_the_traceback():
    out = _kvxfer("loopback", "--blocks", "100", "--pool-blocks", "10", "--debug")
    assert out.returncode == 2 and "Traceback" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("kvxfer: error: --blocks 100")


def test_a_failed_run_exits_1_with_one_error_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[1, 2, 3]\n[1, 2, 999]\n")  # the second prompt has a token outside the vocabulary
    out = _kvxfer("generate", "--prompts", str(prompts), "--max-new-tokens", "2")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("kvxfer: error: some requests failed (")
    assert len(out.stdout.splitlines()) == 2  # one line per prompt: tokens, then the error


def test_a_usage_error_answers_before_torch_is_imported():
    """The parser and its checks import no backend (each imports torch, ~2 s): a mistyped command is
    answered at once. Several of the mistakes above need a backend or a pool to be judged; these do not."""
    code = ("import sys\nfrom kvxfer.cli import main\n"
            "status = main(['frobnicate'])\n" "print(status, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2", "False"], (out.stdout, out.stderr)


def test_checking_an_output_path_leaves_nothing_behind(tmp_path):
    """The check writes to find out (folders made, the file created), then removes what it made; a file
    already there keeps its bytes."""
    from kvxfer.cli.args import writable_file

    assert writable_file(str(tmp_path / "a" / "b" / "out.json")) == str(tmp_path / "a" / "b" / "out.json")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept.json").write_text("old")
    writable_file(str(tmp_path / "kept.json"))
    assert (tmp_path / "kept.json").read_text() == "old"
