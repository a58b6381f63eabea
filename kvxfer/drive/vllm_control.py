"""Start, drive and stop ``kvxfer.drive.vllm_engine`` processes (vLLM instances) from another process.

The controller runs anywhere (the main venv); each instance runs in the vLLM environment's
Python (``vllm_python()``: ``$KVXFER_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` of the
checkout). Every call has a timeout; an instance that dies is reported with the tail of its
output.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional, Sequence

from kvxfer.drive.vllm_engine import REPLY_MARK

REPO = Path(__file__).resolve().parents[2]


class VllmInstanceError(RuntimeError):
    """An instance failed to start, died, or did not answer in time."""


def vllm_python() -> Optional[str]:
    """The interpreter of the vLLM environment, or None when there is none."""
    explicit = os.environ.get("KVXFER_VLLM_PYTHON")
    if explicit:
        return explicit
    candidate = REPO / ".venv-vllm" / "bin" / "python"
    if candidate.exists():
        return str(candidate)
    try:
        import vllm  # noqa: F401
    except ImportError:
        return None
    return sys.executable


def instance_env(cpu: Optional[str], extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment vLLM's CPU platform needs here (docs/vllm.md, "Running on CPU")."""
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    })
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
    env.update(extra or {})
    return env


def temp_folder_env(folder: str) -> dict[str, str]:
    """The settings that put an instance's temporary files in ``folder``: vLLM makes its front end's and engine
    core's ZMQ IPC sockets and its process group's file store in the temporary folder, and a core killed at
    close leaves them there, so each instance gets a folder of its own, removed when it closes."""
    return {"TMPDIR": folder, "VLLM_RPC_BASE_PATH": folder}


class VllmInstance:
    """One running ``vllm_engine`` process."""

    def __init__(self, name: str, args: Sequence[str], *, cpu: Optional[str] = None,
                 env: Optional[dict[str, str]] = None, python: Optional[str] = None, nice: int = 5,
                 module: str = "kvxfer.drive.vllm_engine") -> None:
        python = python or vllm_python()
        if python is None:
            raise VllmInstanceError("no vLLM environment: run `bash tools/bootstrap.sh` (it builds .venv-vllm) "
                                    "or set KVXFER_VLLM_PYTHON")
        self.name = name
        self.tail: deque[str] = deque(maxlen=60)
        self.temp_dir = tempfile.mkdtemp(prefix="kvxfer-vllm-")  # removed at close (temp_folder_env)
        cmd = [python, "-m", module, *args]
        env = {**instance_env(cpu, env), **temp_folder_env(self.temp_dir)}
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         env=env, cwd=str(REPO), bufsize=0, start_new_session=True,
                                         preexec_fn=(lambda: os.nice(nice)) if nice else None)
        except BaseException:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            raise
        self._buffer = b""
        self.startup_s: Optional[float] = None

    def wait_ready(self, timeout_s: float = 240.0) -> "VllmInstance":
        reply = self._read_reply(timeout_s, "start")
        self.startup_s = reply.get("startup_s")
        return self

    def call(self, payload: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        if self.proc.poll() is not None:
            raise VllmInstanceError(f"{self.name} exited ({self.proc.returncode}):\n" + "\n".join(self.tail))
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(payload) + "\n").encode())
        reply = self._read_reply(timeout_s, payload.get("op", "?"))
        if not reply.get("ok"):
            raise VllmInstanceError(f"{self.name}: {reply.get('error')}\n{reply.get('traceback', '')}")
        return reply

    def generate(self, requests: list[dict[str, Any]], timeout_s: float = 120.0) -> dict[str, Any]:
        return self.call({"op": "generate", "requests": requests}, timeout_s)

    def stats(self, timeout_s: float = 60.0) -> dict[str, Any]:
        return self.call({"op": "stats"}, timeout_s)

    def _read_reply(self, timeout_s: float, what: str) -> dict[str, Any]:
        """The next reply line; other output is kept (its tail goes into errors). Reads the pipe's
        fd directly: a buffered reader would hide lines from ``select``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\n", 1)
                line = raw.decode(errors="replace")
                if line.startswith(REPLY_MARK):
                    return json.loads(line[len(REPLY_MARK):])
                self.tail.append(line.rstrip()[:400])
            left = deadline - time.monotonic()
            if left <= 0:
                raise VllmInstanceError(f"{self.name}: no answer to {what!r} within {timeout_s}s:\n" + "\n".join(self.tail))
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                raise VllmInstanceError(f"{self.name} exited ({self.proc.returncode}) during {what!r}:\n"
                                        + "\n".join(self.tail))
            self._buffer += chunk

    def kill(self) -> None:
        """SIGKILL the instance and everything it started (its engine core process)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=120)  # a SIGKILLed engine tearing down GiBs on a loaded host took over 30 s
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def close(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.call({"op": "exit"}, timeout_s=timeout_s)
                self.proc.wait(timeout=timeout_s)
            except (VllmInstanceError, subprocess.TimeoutExpired, BrokenPipeError, OSError):
                pass
        if self.proc.poll() is None:
            self.kill()
        else:  # the engine core child may outlive a clean exit for a moment
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            shutil.rmtree(self.temp_dir, ignore_errors=True)
