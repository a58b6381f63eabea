"""The fork server SGLang ranks start from (``kvxfer.drive.forkserver``): real servers and real forked processes.

A child gets the environment, directory, argv and stdio it was given, not the server's; its end comes back as
``subprocess.Popen`` reports it (an exit code, ``-9`` for SIGKILL), and the server outlives a child that
crashes. The server ends when its controller closes it or dies. A rank started through ``SglangRank`` is a
separate process forked by the server, and SGLang, though imported before the fork, reads the rank's own
environment. The generic checks run a server of this Python with torch preloaded; the SGLang ones share the
controller's server (``kvxfer.drive.sglang_control``), as the other SGLang tests do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvxfer.drive import sglang_control
from kvxfer.drive.forkserver import ForkedProcess, ForkServer, ForkServerError
from sglang_support import Peer, free_port, peer_env, sglang_python

PROBE = textwrap.dedent("""\
    import ctypes, json, os, sys
    import torch
    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    print(json.dumps({"environ": dict(os.environ), "c_getenv": (getenv(b"WHO") or b"").decode(), "cwd": os.getcwd(),
                      "argv": sys.argv, "name": __name__, "threads": torch.get_num_threads(),
                      "pid": os.getpid(), "ppid": os.getppid()}))
    sys.stderr.write("to stderr\\n")
    """)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def server():
    """A server of this Python with torch imported, started with OpenMP at two threads and ``WHO=server``."""
    fork_server = ForkServer(sys.executable, ["torch"], env={**os.environ, "WHO": "server", "OMP_NUM_THREADS": "2"})
    yield fork_server
    fork_server.close()


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_child_has_its_own_environment_directory_argv_and_threads(server, tmp_path):
    import json

    script = _script(tmp_path, PROBE)
    child = server.popen([sys.executable, script, "a", "b"], env={"WHO": "child", "OMP_NUM_THREADS": "1"},
                         cwd=str(tmp_path))
    out, err = child.stdout.read(), child.stderr.read()
    assert child.wait(30) == 0, err
    seen = json.loads(out)
    # the whole environment is the child's (a fresh interpreter adds only LC_CTYPE, from the locale coercion)
    assert {k: v for k, v in seen["environ"].items() if k != "LC_CTYPE"} == {"WHO": "child", "OMP_NUM_THREADS": "1"}
    assert seen["c_getenv"] == "child"  # what C code reads with getenv, too
    assert (seen["cwd"], seen["argv"], seen["name"]) == (str(tmp_path), [script, "a", "b"], "__main__")
    assert seen["threads"] == 1, "torch's thread count is the server's, not the child's OMP_NUM_THREADS"
    assert seen["pid"] == child.pid and seen["ppid"] == server.proc.pid != os.getpid()
    assert err == "to stderr\n"


def test_stdin_and_a_module_run_with_dash_m(server, tmp_path):
    child = server.popen([sys.executable, "-m", "json.tool", "--compact"], env={}, cwd=str(tmp_path))
    child.stdin.write('{"a": [1, 2]}\n')
    child.stdin.close()
    assert child.stdout.read() == '{"a":[1,2]}\n'
    assert child.wait(30) == 0


@pytest.mark.parametrize("body, code, stderr", [
    ("import sys; sys.exit(3)", 3, ""),
    ("import sys; sys.exit('bye')", 1, "bye\n"),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", -signal.SIGSEGV, ""),
    ("pass", 0, ""),
])
def test_exit_status_as_popen_reports_it(server, tmp_path, body, code, stderr):
    child = server.popen([sys.executable, _script(tmp_path, body)], env={}, cwd=str(tmp_path))
    err = child.stderr.read()
    assert child.wait(30) == code and child.returncode == code and child.poll() == code
    assert stderr in err


def test_kill_and_timeout_while_running(server, tmp_path):
    children = [server.popen([sys.executable, _script(tmp_path, "import sys; sys.stdin.read()")], env={},
                             cwd=str(tmp_path)) for _ in range(2)]
    for child in children:
        assert child.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.3)
    children[0].kill()
    children[1].terminate()
    assert (children[0].wait(30), children[1].wait(30)) == (-signal.SIGKILL, -signal.SIGTERM)
    children[0].kill()  # as Popen: signalling an ended child is a no-op


def test_server_survives_a_crashing_child(server, tmp_path):
    crash = server.popen([sys.executable, _script(tmp_path, "import os; os.abort()")], env={}, cwd=str(tmp_path))
    assert crash.wait(30) == -signal.SIGABRT
    assert server.proc.poll() is None
    child = server.popen([sys.executable, "-m", "json.tool"], env={}, cwd=str(tmp_path))
    child.stdin.write("7\n")
    child.stdin.close()
    assert child.stdout.read() == "7\n" and child.wait(30) == 0


def test_refused_request_is_an_error_and_the_server_goes_on(server, tmp_path):
    with pytest.raises(ForkServerError, match="refused"):
        server.popen([sys.executable, "-c", "pass"], env={}, cwd=str(tmp_path))
    with pytest.raises(ValueError):
        server.popen(["/usr/bin/python3-other", "x.py"], env={}, cwd=str(tmp_path))
    child = server.popen([sys.executable, _script(tmp_path, "pass")], env={}, cwd=str(tmp_path))
    assert child.wait(30) == 0


def test_server_ends_when_closed_and_its_children_live_on(tmp_path):
    fork_server = ForkServer(sys.executable)
    child = fork_server.popen([sys.executable, _script(tmp_path, "import sys; sys.stdin.read()")], env={},
                              cwd=str(tmp_path))
    fork_server.close()
    assert fork_server.proc.returncode == 0
    assert not os.path.exists(fork_server.path)
    assert child.poll() is None and _alive(child.pid)  # as a Popen child would: it ends on its own stdin's EOF
    child.stdin.close()
    assert child.wait(30) == 255  # ended, its status lost with the server that reaped it
    assert not _alive(child.pid)


def test_server_ends_when_its_controller_dies(tmp_path):
    controller = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""\
        import sys, time
        from kvxfer.drive.forkserver import ForkServer
        server = ForkServer(sys.executable)
        print(server.proc.pid, server.path, flush=True)
        time.sleep(300)
        """)], stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).resolve().parents[3]))
    pid, path = controller.stdout.readline().split()
    server_pid = int(pid)
    assert _alive(server_pid) and os.path.exists(path)
    controller.kill()
    controller.wait(30)
    deadline = time.monotonic() + 30
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server_pid), "the fork server outlived its controller"
    assert not os.path.exists(os.path.dirname(path)), "the server's private folder outlived them both"


def test_server_that_cannot_start_is_a_clear_error():
    with pytest.raises(ForkServerError, match="exited"):
        ForkServer(sys.executable, ["no_such_module_kvxfer"])
    with pytest.raises(ForkServerError, match="not ready within"):
        ForkServer(sys.executable, ["time"], timeout_s=0.001)


def test_rank_is_a_separate_process_forked_by_the_server(monkeypatch):
    """A real SGLang rank through ``SglangRank`` (the tests' ``Peer``): forked by the controller's server for
    the SGLang Python, its own pid, replying on its pipes; SIGKILL comes back as Popen's ``-9``."""
    monkeypatch.delenv("KVXFER_SGLANG_FORKSERVER", raising=False)
    rank = Peer("prefill", "kvxfer_ucx", free_port())
    try:
        assert isinstance(rank.proc, ForkedProcess)
        server = sglang_control._fork_server(sglang_python(), peer_env())
        assert server is not None
        info = rank.ready().info
        assert info["pid"] == rank.proc.pid not in (os.getpid(), server.proc.pid)
        with open(f"/proc/{rank.proc.pid}/stat") as fh:
            assert int(fh.read().rsplit(")", 1)[1].split()[1]) == server.proc.pid
        assert rank.ask(op="sizes")["sizes"] is not None
        rank.proc.kill()
        assert rank.proc.wait(30) == -signal.SIGKILL
    finally:
        rank.close()


def test_preloaded_sglang_reads_the_childs_environment(tmp_path, monkeypatch):
    """SGLang's disaggregation settings and torch's threads, read after the fork, are the rank's own."""
    import json

    monkeypatch.delenv("KVXFER_SGLANG_FORKSERVER", raising=False)
    env = peer_env(SGLANG_DISAGGREGATION_WAITING_TIMEOUT="123", SGLANG_DISAGG_STAGING_BUFFER="1",
                   OMP_NUM_THREADS="1", KVXFER_TRANSFER_TIMEOUT_S="7")
    server = sglang_control._fork_server(sglang_python(), env)
    assert server is not None
    script = _script(tmp_path, """\
        import json, os, sys, torch
        assert "sglang.srt.disaggregation.common.conn" in sys.modules  # preloaded: no import here
        from sglang.srt.environ import envs
        print(json.dumps([envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get(), envs.SGLANG_DISAGG_STAGING_BUFFER.get(),
                          torch.get_num_threads(), os.environ["KVXFER_TRANSFER_TIMEOUT_S"]]))
        """)
    child = server.popen([sglang_python(), script], env=env, cwd=str(tmp_path))
    out, err = child.stdout.read(), child.stderr.read()
    assert child.wait(60) == 0, err
    assert json.loads(out) == [123, True, 1, "7"]
