"""A prefill-side process for the storage-safety tests: one pool, one backend, one process.

One process per source is the point: each can be SIGSTOPped, resumed or SIGKILLed on its
own (a stalled stage beside a dead one). Started as ``python -m tests.support.pull_source SPEC``
with a JSON ``SourceSpec``; it prints ``READY <export_meta() as JSON>`` and then answers
``drain`` lines on stdin with ``DRAIN <json>`` (the read-done and read-failed request ids
received since the last drain) until stdin closes.

Pools are cut from a seeded global tensor (``global_kv``), so the test rebuilds every
expected byte itself and nothing but metas crosses the pipe.

``python -m tests.support.pull_source --read SPEC`` is the other side: a reader (decode) process with
an empty pool, one that a test can SIGKILL mid-read (``ReaderProcess``). It answers ``pull``,
``post``, ``close`` and ``stat`` lines (JSON) with one ``OK <json>`` or ``ERR <message>`` line.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SourceSpec:
    backend: str
    name: str
    seed: int
    shape: tuple[int, ...]  # the global [2, L, B, T, H, d] tensor; a layout cuts this rank's shard
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    global_rank: int = 0
    ucx_tls: Optional[str] = None
    device: str = "cpu"  # where the source's pool lives ("cuda:0" for the VRAM tests)

    @property
    def num_blocks(self) -> int:
        return self.shape[2]

    def layout_kwargs(self) -> dict[str, Any]:
        """Constructor topology arguments (a pool with a layout) for this rank."""
        layers, heads = self.shape[1], self.shape[4]
        start, end = self.pp_rank * layers // self.pp_size, (self.pp_rank + 1) * layers // self.pp_size
        return dict(tp_size=self.tp_size, tp_rank=self.tp_rank, num_kv_heads_global=heads, global_rank=self.global_rank,
                    pp_size=self.pp_size, pp_rank=self.pp_rank, num_layers_global=layers, layer_start=start,
                    layer_end=end, head_dim=self.shape[5], tokens_per_block=self.shape[3])


def child_pythonpath() -> str:
    """This checkout first, then whatever the caller had (the GPU kit installs kvxfer's dependencies
    into a folder named only by ``PYTHONPATH``)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def global_kv(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bf16 *bytes* (every bit pattern), reproducible from the seed."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(shape, dtype=torch.bfloat16)
    out.view(torch.int16).copy_(torch.randint(-32768, 32768, shape, dtype=torch.int16, generator=gen))
    return out


def shard(spec: SourceSpec, global_tensor: torch.Tensor) -> torch.Tensor:
    """This rank's pool: its layer window and head range of the global tensor."""
    layers, heads = spec.shape[1], spec.shape[4]
    l0, l1 = spec.pp_rank * layers // spec.pp_size, (spec.pp_rank + 1) * layers // spec.pp_size
    h0, h1 = spec.tp_rank * heads // spec.tp_size, (spec.tp_rank + 1) * heads // spec.tp_size
    return global_tensor[:, l0:l1, :, :, h0:h1].contiguous()


def serve(spec: SourceSpec) -> None:
    from kvxfer.backends import construct_kv_transfer_backend_class

    cls = construct_kv_transfer_backend_class(spec.backend)
    pool = shard(spec, global_kv(spec.shape, spec.seed)).to(spec.device)
    backend = cls(spec.name, pool, spec.num_blocks, **spec.layout_kwargs())
    print("READY " + json.dumps(backend.export_meta()), flush=True)
    for line in sys.stdin:
        if line.strip() == "drain":
            deadline = time.monotonic() + 0.05
            done: list[Any] = []
            failed: list[Any] = []
            while time.monotonic() < deadline:  # let notices already on the wire arrive
                done += backend.drain_read_done()
                failed += [f.request_id for f in backend.drain_read_failed()]
                time.sleep(0.005)
            print("DRAIN " + json.dumps({"done": done, "failed": failed}), flush=True)
    backend.close()


def pool_digest(pool: torch.Tensor) -> str:
    """SHA-256 of a pool's bytes: how a reader process proves it read byte-exact."""
    return hashlib.sha256(pool.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def read(spec: SourceSpec) -> None:
    """The reader loop (see the module docstring): pulls into a zeroed pool of ``spec``'s shape."""
    from kvxfer.backends import construct_kv_transfer_backend_class

    cls = construct_kv_transfer_backend_class(spec.backend)
    pool = torch.zeros(shard(spec, global_kv(spec.shape, 0)).shape, dtype=torch.bfloat16)
    backend = cls(spec.name, pool, spec.num_blocks, timeout_s=30.0, **spec.layout_kwargs())
    handles: list[Any] = []
    print("READY", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] in ("pull", "post"):
                handle = backend.begin_pull_blocks(command["meta"], command["src"], command["dst"],
                                                   request_id=command.get("request_id"))
                handles.append(handle)
                if command["op"] == "pull":
                    handle.wait(command.get("timeout_s", 30.0))
                reply: Any = {"sha256": pool_digest(pool)}
            elif command["op"] == "close":
                backend.close()
                reply = {}
            elif command["op"] == "fds":
                reply = {"fds": len(os.listdir("/proc/self/fd"))}
            else:
                raise ValueError(f"unknown op {command['op']!r}")
        except Exception as exc:  # told to the test, which decides
            print(f"ERR {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
            continue
        print("OK " + json.dumps(reply), flush=True)


def _start(argv: list[str], env: dict[str, str], prefix: tuple[str, ...]) -> Any:
    """A helper with text pipes on stdin and stdout: forked from the test process's fork server
    (``tests/support/forked.py``), or a fresh process under ``prefix`` (``ip netns exec NS``: another namespace)."""
    if prefix:
        return subprocess.Popen([*prefix, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                cwd=ROOT)
    from tests.support.forked import start_helper

    return start_helper(argv, env, str(ROOT))


class ReaderProcess:
    """The test's handle on one reader process: ask it to pull or close, SIGKILL it."""

    def __init__(self, spec: SourceSpec, env: Optional[dict[str, str]] = None, prefix: tuple[str, ...] = ()) -> None:
        """``env``: more environment; ``prefix``: a command to run it under (``ip netns exec NS``)."""
        full = {**os.environ, "PYTHONPATH": child_pythonpath(), **(env or {})}
        full.pop("UCX_TLS", None)
        if spec.ucx_tls:
            full["UCX_TLS"] = spec.ucx_tls
        self.spec = spec
        self.proc = _start([sys.executable, "-m", "tests.support.pull_source", "--read", json.dumps(asdict(spec))],
                           full, prefix)
        self._line(("READY",))

    def _line(self, prefixes: tuple[str, ...]) -> str:
        """The next line that starts with one of ``prefixes`` (NIXL logs to stdout too)."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"reader {self.spec.name} exited ({self.proc.poll()})")
            if line.startswith(prefixes):
                return line

    def ask(self, op: str, **fields: Any) -> Any:
        """One command; its ``OK`` payload, or ``RuntimeError`` with the reader's error."""
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        line = self._line(("OK ", "ERR "))
        if line.startswith("OK "):
            return json.loads(line[3:])
        raise RuntimeError(f"reader {self.spec.name}: {line.strip()}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def fork_server() -> None:
    """``--fork-server``: one process with torch and kvxfer imported (no backend: UCX must not be
    initialised before a fork) forks a source per spec line on stdin. The child registers its pool,
    prints ``META <pid> <json>`` and sleeps until killed: sources that start in milliseconds,
    for tests that meet dozens of them. Children are reaped by the kernel (SIGCHLD ignored)."""
    import signal as _signal

    from kvxfer.backends import construct_kv_transfer_backend_class

    _signal.signal(_signal.SIGCHLD, _signal.SIG_IGN)
    print("READY", flush=True)
    for line in sys.stdin:
        raw = json.loads(line)
        spec = SourceSpec(**{**raw, "shape": tuple(raw["shape"])})
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            try:
                backend = construct_kv_transfer_backend_class(spec.backend)(
                    spec.name, shard(spec, global_kv(spec.shape, spec.seed)), spec.num_blocks, **spec.layout_kwargs())
                print(f"META {os.getpid()} " + json.dumps(backend.export_meta()), flush=True)
            finally:
                os.write(ready_w, b"x")
            while True:
                time.sleep(3600)
        os.close(ready_w)
        os.read(ready_r, 1)  # one child prints at a time
        os.close(ready_r)


class ForkedSources:
    """The test's handle on a ``--fork-server``: ``start(spec)`` -> (pid, meta)."""

    def __init__(self, ucx_tls: Optional[str] = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("UCX_TLS", None)
        if ucx_tls:
            env["UCX_TLS"] = ucx_tls
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.pull_source", "--fork-server", "{}"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.pids: list[int] = []
        self._next_line("READY")

    def _next_line(self, prefix: str) -> str:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the fork server exited ({self.proc.poll()})")
            if line.startswith(prefix):
                return line[len(prefix):]

    def start(self, spec: SourceSpec) -> tuple[int, dict[str, Any]]:
        self.proc.stdin.write(json.dumps(asdict(spec)) + "\n")
        self.proc.stdin.flush()
        pid, meta = self._next_line("META ").split(" ", 1)
        self.pids.append(int(pid))
        return int(pid), json.loads(meta)

    def close(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait(10)
        self.proc.stdin.close()
        self.proc.stdout.close()


class SourceProcess:
    """The test's handle on one source process: its meta, its notices, SIGSTOP/SIGCONT/SIGKILL."""

    def __init__(self, spec: SourceSpec, env: Optional[dict[str, str]] = None, prefix: tuple[str, ...] = ()) -> None:
        """``env``: more environment; ``prefix``: a command to run it under (``ip netns exec NS``)."""
        self.spec = spec
        env = {**os.environ, "PYTHONPATH": child_pythonpath(), **(env or {})}
        env.pop("UCX_TLS", None)
        if spec.ucx_tls:
            env["UCX_TLS"] = spec.ucx_tls
        self.proc = _start([sys.executable, "-m", "tests.support.pull_source", json.dumps(asdict(spec))], env, prefix)
        self._meta: Optional[dict[str, Any]] = None
        self.done: list[Any] = []
        self.failed: list[Any] = []

    @property
    def meta(self) -> dict[str, Any]:
        """The source's ``export_meta()``; waits for it to start (sources start in parallel)."""
        if self._meta is None:
            self._meta = json.loads(self._expect("READY ", timeout_s=90))
        return self._meta

    def _expect(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"source {self.spec.name} exited ({self.proc.poll()}) before {prefix.strip()}")
            if line.startswith(prefix):
                return line[len(prefix):]
        raise TimeoutError(f"source {self.spec.name} printed no {prefix.strip()} within {timeout_s}s")

    def expected_pool(self) -> torch.Tensor:
        return shard(self.spec, global_kv(self.spec.shape, self.spec.seed))

    def notices(self, until: Optional[int] = None, timeout_s: float = 10.0) -> tuple[list[Any], list[Any]]:
        """Every read-done and read-failed id received so far; waits for ``until`` notices in all."""
        _ = self.meta
        deadline = time.monotonic() + timeout_s
        while True:
            self.proc.stdin.write("drain\n")
            self.proc.stdin.flush()
            got = json.loads(self._expect("DRAIN ", timeout_s=30))
            self.done += got["done"]
            self.failed += got["failed"]
            if until is None or len(self.done) + len(self.failed) >= until or time.monotonic() > deadline:
                return self.done, self.failed
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGSTOP the source and return once all its threads are stopped (``proc_state.stop``)."""
        from proc_state import stop

        stop(self.proc.pid)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            try:
                self.proc.stdin.close()
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


@contextmanager
def closing_sources() -> Iterator[list[SourceProcess]]:
    """A list a test appends the sources it starts to; every one resumed and closed at the end."""
    started: list[SourceProcess] = []
    try:
        yield started
    finally:
        for source in started:
            source.close()


if __name__ == "__main__":
    if sys.argv[1] == "--fork-server":
        fork_server()
    else:
        raw = json.loads(sys.argv[-1])
        (read if sys.argv[1] == "--read" else serve)(SourceSpec(**{**raw, "shape": tuple(raw["shape"])}))
