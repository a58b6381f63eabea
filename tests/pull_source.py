"""A prefill-side process for the storage-safety tests: one pool, one backend, one process.

One process per source is the point: each can be SIGSTOPped, resumed or SIGKILLed on its
own (a stalled stage beside a dead one). Started as ``python -m tests.pull_source SPEC``
with a JSON ``SourceSpec``; it prints ``READY <export_meta() as JSON>`` and then answers
``drain`` lines on stdin with ``DRAIN <json>`` (the read-done and read-failed request ids
received since the last drain) until stdin closes.

Pools are cut from a seeded global tensor (``global_kv``), so the test rebuilds every
expected byte itself and nothing but metas crosses the pipe.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent


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
    backend = cls(spec.name, shard(spec, global_kv(spec.shape, spec.seed)), spec.num_blocks, **spec.layout_kwargs())
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


class SourceProcess:
    """The test's handle on one source process: its meta, its notices, SIGSTOP/SIGCONT/SIGKILL."""

    def __init__(self, spec: SourceSpec) -> None:
        self.spec = spec
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("UCX_TLS", None)
        if spec.ucx_tls:
            env["UCX_TLS"] = spec.ucx_tls
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.pull_source", json.dumps(asdict(spec))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
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
        os.kill(self.proc.pid, signal.SIGSTOP)

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


if __name__ == "__main__":
    raw = json.loads(sys.argv[1])
    serve(SourceSpec(**{**raw, "shape": tuple(raw["shape"])}))
