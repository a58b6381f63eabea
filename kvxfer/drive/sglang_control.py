"""Start, drive and stop SGLang ranks (``kvxfer.drive.sglang_rank`` processes) from another process: the
controller side of ``kvxfer bench-sglang``, and of the SGLang tests (``tests/support/sglang_support.py``).

Each rank runs in the SGLang environment's Python (``sglang_python()``: ``$KVXFER_SGLANG_PYTHON``, else
``.venv-sglang/bin/python`` of the checkout once ``tools/bootstrap.sh`` stamped it) and speaks one JSON object a
line: a command on its stdin, a reply on its stdout; its stderr is kept (the last lines) for error reports.

A rank is forked from a fork server (``kvxfer.drive.forkserver``) that imported torch and SGLang's disaggregation
modules once (``PRELOAD``: ~10 s of CPU a rank would otherwise spend importing them), one server per Python and
startup settings per controller process, started at the first rank and ended at exit. ``KVXFER_SGLANG_FORKSERVER=0``
starts each rank as a fresh ``subprocess.Popen`` instead; a server that cannot start falls back to that too.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import threading
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from kvxfer.runtime.ports import free_port  # noqa: F401  (the SGLang tests and bench take it from here)
from kvxfer.drive.forkserver import ForkedProcess, ForkServer, popen_python, shared_fork_server

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]

#: The pool a rank builds unless told otherwise (SGLang's MHA layout, page_size > 1).
POOL = {"tokens": 256, "page_size": 4, "heads": 2, "head_dim": 16, "layers": 3, "aux_rows": 16, "hidden": 32}


class SglangRankError(RuntimeError):
    """A rank failed to start, died, answered with an error, or did not answer in time."""


def sglang_python() -> Optional[str]:
    """The SGLang environment's Python, or None when there is none."""
    explicit = os.environ.get("KVXFER_SGLANG_PYTHON")
    if explicit:
        return explicit if Path(explicit).exists() else None
    candidate = REPO / ".venv-sglang" / "bin" / "python"
    return str(candidate) if candidate.exists() and (REPO / ".venv-sglang" / ".kvxfer-installed").exists() else None


def rank_env(**extra: str) -> dict[str, str]:
    """A rank's environment: one OpenMP thread (the ranks share the machine's cores), Python warnings off."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    env.update(extra)
    return env


#: What a rank's fork server imports before it forks: torch and the SGLang modules a rank imports (their imports
#: cover ~99% of a rank's import time); never kvxfer's backends, UCX or NIXL, which must initialise in the rank.
PRELOAD = ("torch", "sglang.srt.disaggregation.common.conn", "sglang.srt.disaggregation.prefill",
           "sglang.srt.disaggregation.decode")


def _forking() -> bool:
    """Whether ranks fork from a fork server (``KVXFER_SGLANG_FORKSERVER=0``: fresh processes)."""
    return os.environ.get("KVXFER_SGLANG_FORKSERVER", "1") != "0"


def _fork_server(python: str, env: dict[str, str]) -> Optional[ForkServer]:
    """The fork server for ranks of ``python`` with ``env``'s startup settings (``forkserver.shared_fork_server``);
    None when disabled or it cannot start."""
    return shared_fork_server(python, PRELOAD, env, str(REPO)) if _forking() else None


def start_rank(argv: list[str], env: dict[str, str]) -> Union[ForkedProcess, subprocess.Popen]:
    """``argv`` (a Python, then ``-m MODULE ...`` or ``SCRIPT ...``) as a rank process with JSON line pipes:
    forked from the fork server when there is one, else a fresh process."""
    return popen_python(argv, env=env, cwd=str(REPO), preload=PRELOAD, fork=_forking())


class SglangRank:
    """One SGLang rank process and its JSON line channel. ``command``: how to start it (default
    ``python -m kvxfer.drive.sglang_rank`` in the SGLang environment); ``pool`` and the rest of the config
    are the rank's (``kvxfer.drive.sglang_build``)."""

    #: What a failed read raises (the tests' subclass raises ``AssertionError``).
    error: type = SglangRankError

    def __init__(self, role: str, backend: str, bootstrap_port: int, *, env: Optional[dict[str, str]] = None,
                 command: Optional[Sequence[str]] = None, **pool: Any) -> None:
        cfg = {"role": role, "backend": backend, "bootstrap_port": bootstrap_port, **POOL, **pool}
        self.role = role
        if command is None:
            python = sglang_python()
            if python is None:
                raise self.error("no SGLang environment (tools/bootstrap.sh builds .venv-sglang; or set "
                                 "KVXFER_SGLANG_PYTHON)")
            command = [python, "-m", "kvxfer.drive.sglang_rank"]
        self.proc = start_rank([*command, json.dumps(cfg)], env or rank_env())
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines), daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()
        self.info: dict[str, Any] = {}

    @staticmethod
    def _pump(stream: Any, out: "queue.Queue[Optional[str]]") -> None:
        for line in stream:
            out.put(line)
        out.put(None)

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            del self.stderr[:-400]

    def read(self, timeout_s: float = 120.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise self.error(f"{self.role}: no reply within {timeout_s}s; stderr:\n{self.log()}") from None
        if line is None:
            self.proc.wait(timeout=10)
            raise self.error(f"{self.role} exited ({self.proc.returncode}); stderr:\n{self.log()}")
        reply = json.loads(line)
        if "error" in reply:
            raise self.error(f"{self.role}: {reply['error']}\n{reply.get('traceback', '')}\n{self.log()}")
        return reply

    def ready(self, timeout_s: float = 150.0) -> "SglangRank":
        self.info = self.read(timeout_s)
        return self

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def ask(self, timeout_s: float = 120.0, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.read(timeout_s)

    def log(self) -> str:
        return "".join(self.stderr[-60:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="exit")
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - a rank that will not exit is killed
                logger.debug("%s rank did not exit when asked: killed", self.role)
                self.proc.kill()
                self.proc.wait(timeout=10)


def rooms_plan(first_room: int, count: int, *, pages_per_room: int = 7, chunks: Any = (3, 4),
               src_base: int = 1, dst_base: int = 40, scatter: bool = True) -> tuple[list[dict], list[dict]]:
    """Matching prefill (``serve``) and decode (``receive``) room lists: distinct pages per room,
    the destination pages in another order and place than the source's (page reuse across rooms is
    what SGLang's allocator does; a plan only needs them disjoint within one batch). ``chunks``: the
    pages of each chunk, one tuple for every room, or a list of tuples taken in turn room by room."""
    per_room = [tuple(chunks)] if isinstance(chunks[0], int) else [tuple(c) for c in chunks]
    serve, receive = [], []
    for i in range(count):
        src = [src_base + i * pages_per_room + k for k in range(pages_per_room)]
        dst = [dst_base + i * pages_per_room + k for k in range(pages_per_room)]
        if scatter:
            dst = dst[::2] + dst[1::2]
        serve.append({"room": first_room + i, "pages": src, "chunks": list(per_room[i % len(per_room)]),
                      "aux_index": i % 8})
        receive.append({"room": first_room + i, "pages": dst, "aux_index": 8 + i % 8})
    return serve, receive


SUCCESS = 4  # SGLang's KVPoll.Success


def byte_faults(serve: list[dict], served: dict, received: dict) -> list[str]:
    """What differs from a byte-exact hand-off with both sides ``Success`` (empty: none): every page of every
    buffer and the aux row, compared by digest between the prefill's room and the decode's."""
    faults = []
    for r in serve:
        key = str(r["room"])
        if served["rooms"][key]["status"] != SUCCESS or received["rooms"][key]["status"] != SUCCESS:
            faults.append(f"room {key}: prefill {served['rooms'][key]}, decode {received['rooms'][key]}")
            continue
        src, dst = served["digests"][key], received["digests"][key]
        faults += [f"room {key} buffer {i}: pages differ" for i, (a, b) in enumerate(zip(src["pages"], dst["pages"]))
                   if a != b]
        if not src["aux"] or src["aux"] != dst["aux"]:
            faults.append(f"room {key}: aux rows differ")
    return faults
