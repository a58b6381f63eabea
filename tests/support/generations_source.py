"""A prefill-side process for the verified-pull tests: a pool, its generation counters, and
counter tables each wrong in one way, every meta exported (and sealed with the key in
``$KVXFER_SECRET_FILE``) by this process.

Started as ``python -m tests.support.generations_source BACKEND NUM_BLOCKS SEED``; prints one JSON line
(``{"kv": ..., "generations": ..., "wrong": {what: meta}}``) and holds its registrations
until its stdin closes. The pool is ``source_pool(NUM_BLOCKS, SEED)``, so the test can rebuild
every byte it should read.
"""

from __future__ import annotations

import json
import sys

import torch


def source_pool(num_blocks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((2, 2, num_blocks, 4, 2, 8), generator=gen).to(torch.bfloat16)


def main() -> None:
    from kvxfer.backends import construct_kv_transfer_backend_class
    from kvxfer.handoff.generations import BlockGenerations

    backend, num_blocks, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cls = construct_kv_transfer_backend_class(backend)
    kv = cls("gen-src", source_pool(num_blocks, seed), num_blocks)
    gens = BlockGenerations(kv)
    intruder = cls("gen-intruder", torch.zeros((2, 2, num_blocks, 4, 2, 8), dtype=torch.bfloat16), num_blocks)

    def table(dtype: torch.dtype, n: int):
        return kv.new_registered_buffer(memory_buffer=torch.zeros(n, dtype=dtype), expected_num_blocks=n)

    wrong = {
        "float64 counters": table(torch.float64, num_blocks),
        "the KV pool's own meta": kv,
        "a table too short for the blocks read": table(torch.int64, 4),
        "a table of another pool size": table(torch.int64, num_blocks + 8),
        "another agent's table": BlockGenerations(intruder).registration,
    }
    print(json.dumps({"kv": kv.export_meta(), "generations": gens.export_meta(),
                      "wrong": {what: reg.export_meta() for what, reg in wrong.items()}}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
