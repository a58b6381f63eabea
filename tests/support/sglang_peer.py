"""One SGLang disaggregation rank for the SGLang tests, run by the SGLang environment's Python.

The rank is kvxfer's own (``kvxfer.drive.sglang_rank``, which ``kvxfer bench-sglang`` runs too; built by
``kvxfer.drive.sglang_build``: every manager made by SGLang's own queues, the stand-ins saying what they carry).
This file adds the tests' token-exact generation: ``model_prefill`` / ``model_decode``, a tiny decoder whose KV
lives in SGLang's ``MHATokenToKVPool``; and for Mamba state across attention TP sizes ``state_slot`` (one slot's
bytes of every state tensor, with what SGLang states of it) and ``slice_oracle`` (SGLang's own byte blocks for a
pair of ranks, ``compute_mamba_state_slice_byte_blocks``: what its nixl writes, the test's reference).
"""

from __future__ import annotations

import torch

from kvxfer.drive.sglang_build import CFG, OWNED
from kvxfer.drive.sglang_rank import main

# --- token-exact generation: a tiny decoder made here from a seed (no download), its KV kept in
# SGLang's MHATokenToKVPool through SGLang's own set_kv_buffer / get_key_buffer / get_value_buffer

class TinyLM:
    """A pre-norm decoder with the pool's geometry (layers, KV heads, head size), learned absolute
    positions and float32 weights drawn from ``seed``: the same model in every process."""

    def __init__(self, layers: int, heads: int, head_dim: int, vocab: int = 97, max_pos: int = 256, seed: int = 29):
        gen = torch.Generator().manual_seed(seed)
        width = heads * head_dim
        self.heads, self.head_dim, self.width = heads, head_dim, width

        def weight(rows, cols, scale=1.0):
            return torch.randn(rows, cols, generator=gen) * scale / cols ** 0.5

        self.embed = torch.randn(vocab, width, generator=gen)
        self.positions = torch.randn(max_pos, width, generator=gen) * 0.5
        self.blocks = [{name: weight(*shape) for name, shape in (
            ("q", (width, width)), ("k", (width, width)), ("v", (width, width)), ("o", (width, width)),
            ("up", (4 * width, width)), ("down", (width, 4 * width)))} for _ in range(layers)]
        self.unembed = weight(vocab, width, 4.0)

    def forward(self, tokens: list[int], start: int, past) -> tuple:
        """Logits after the last of ``tokens`` (at positions ``start...``), given each layer's past
        ``(K, V)`` (``[start, heads, head_dim]``, or None), and the new tokens' ``(K, V)`` per layer."""
        norm = torch.nn.functional.layer_norm
        n = len(tokens)
        x = self.embed[torch.tensor(tokens)] + self.positions[start:start + n]
        new = []
        for i, w in enumerate(self.blocks):
            h = norm(x, (self.width,))
            q, k, v = ((h @ w[name].T).view(n, self.heads, self.head_dim) for name in ("q", "k", "v"))
            new.append((k, v))
            keys, values = (k, v) if past is None else (torch.cat([past[i][0], k]), torch.cat([past[i][1], v]))
            scores = torch.einsum("nhd,mhd->hnm", q, keys) / self.head_dim ** 0.5
            visible = torch.arange(keys.shape[0])[None, :] <= (start + torch.arange(n))[:, None]
            attn = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            x = x + torch.einsum("hnm,mhd->nhd", attn, values).reshape(n, self.width) @ w["o"].T
            x = x + torch.nn.functional.gelu(norm(x, (self.width,)) @ w["up"].T) @ w["down"].T
        return norm(x[-1], (self.width,)) @ self.unembed.T, new


def token_locs(pages: list[int], count: int) -> torch.Tensor:
    size = CFG["page_size"]
    return torch.tensor([pages[t // size] * size + t % size for t in range(count)], dtype=torch.int64)


def store_kv(pool, locs: torch.Tensor, kv) -> None:
    for layer, (k, v) in enumerate(kv):
        pool.set_kv_buffer(None, locs, k, v, layer_id_override=layer)


def generate(model: TinyLM, pool, pages: list[int], prompt_len: int, first: int, count: int) -> list[int]:
    """Greedy decoding from ``first`` (the token after the prompt): every step reads the past KV from
    the pool's pages and writes its own there, as a decode rank does."""
    tokens = [first]
    for step in range(count - 1):
        pos = prompt_len + step
        locs = token_locs(pages, pos + 1)
        past = [(pool.get_key_buffer(i)[locs[:pos]].float(), pool.get_value_buffer(i)[locs[:pos]].float())
                for i in range(len(model.blocks))]
        logits, new = model.forward([tokens[-1]], pos, past)
        store_kv(pool, locs[pos:], new)
        tokens.append(int(logits.argmax()))
    return tokens


def model_for_pool() -> TinyLM:
    return TinyLM(CFG["layers"], CFG["heads"], CFG["head_dim"])


def model_prefill(cmd, backend, manager, pool, kv_args) -> dict:
    """Prefill the prompt: its KV into ``pages`` (to be sent) and, for the co-located reference, into
    ``ref_pages``, where decoding then continues; the first token into the aux row (``output_ids``)."""
    model, prompt, meta = model_for_pool(), cmd["prompt"], OWNED[id(manager)]
    logits, kv = model.forward(prompt, 0, None)
    first = int(logits.argmax())
    store_kv(pool, token_locs(cmd["pages"], len(prompt)), kv)
    store_kv(pool, token_locs(cmd["ref_pages"], len(prompt)), kv)
    meta.output_ids[cmd["aux_index"]].zero_()
    meta.output_ids[cmd["aux_index"], 0] = first
    return {"tokens": generate(model, pool, cmd["ref_pages"], len(prompt), first, cmd["new_tokens"])}


def model_decode(cmd, backend, manager, pool, kv_args) -> dict:
    """Continue from what kvxfer delivered: the first token from the aux row, the prompt's KV in
    ``pages`` (more pages after them for the new tokens)."""
    first = int(OWNED[id(manager)].output_ids[cmd["aux_index"], 0])
    return {"tokens": generate(model_for_pool(), pool, cmd["pages"], cmd["prompt_len"], first, cmd["new_tokens"])}


def state_slot(cmd, backend, manager, pool, kv_args) -> dict:
    """Slot ``cmd["slot"]`` of every state tensor, per component: its bytes (hex), item length, TP-sharded axis,
    rows before that axis and conv sub-blocks, as SGLang's ``setup_state_kv_args`` stated them in ``KVArgs``."""
    from kvxfer.integrations.sglang.regions import raw_view

    slot, out = int(cmd["slot"]), []
    for c, (ptrs, items) in enumerate(zip(kv_args.state_data_ptrs, kv_args.state_item_lens)):
        dims, outer = kv_args.state_dim_per_tensor[c], kv_args.state_slice_outer_counts[c]
        groups = kv_args.state_conv_shard_groups[c]
        out.append([{"hex": raw_view(ptr + slot * item, item, "cpu").numpy().tobytes().hex(), "item_len": item,
                     "dim": dims[j], "outer": outer[j] if outer else 1, "groups": groups[j] if groups else None}
                    for j, (ptr, item) in enumerate(zip(ptrs, items))])
    return {"state": out}


def slice_oracle(cmd, backend, manager, pool, kv_args) -> dict:
    """SGLang's byte blocks ``(src_offset, dst_offset, bytes)`` of one state slot for one (prefill rank, decode
    rank) pair: ``compute_mamba_state_slice_byte_blocks``, which its nixl backend writes by."""
    from sglang.srt.disaggregation.utils import compute_mamba_state_slice_byte_blocks

    return {"blocks": [list(b) for b in compute_mamba_state_slice_byte_blocks(**cmd["args"])]}


# --- a replayed chunk's timing (issue 49): the chunks a prefill sends, as a tap on the wire sees them, and its
# read-dones held back, as a prefill whose service loop runs late (a busy core) takes them late

HOLD: dict = {"on": False, "held": []}


def hold_read_done(cmd, backend, manager, pool, kv_args) -> dict:
    """From now on every CHUNK this prefill hands to zmq is appended (a JSON line: its frames in hex) to
    ``cmd["tap"]``, and kvxfer's read-dones are held back (the service loop sees none) until ``release_read_done``:
    each is still the transport's own, handed to the service loop later, as a late loop would take it."""
    import json

    from kvxfer.integrations.sglang import wire

    rooms, table = manager.kvxfer_rooms, manager.kvxfer_pool.table_backend
    send, drain = rooms._send, table.drain_read_done
    HOLD["on"] = True

    def tapped(endpoint, frames):
        if frames[0] == wire.CHUNK:
            with open(cmd["tap"], "a") as out:
                out.write(json.dumps({"endpoint": endpoint, "frames": [bytes(f).hex() for f in frames]}) + "\n")
        return send(endpoint, frames)

    def late():
        HOLD["held"].extend(drain())
        if HOLD["on"]:
            return []
        out, HOLD["held"] = HOLD["held"], []
        return out

    rooms._send, table.drain_read_done = tapped, late
    return {"holding": True}


def release_read_done(cmd, backend, manager, pool, kv_args) -> dict:
    """Once the file ``cmd["when"]`` exists (at most ``timeout`` s), hand the held read-dones to the service loop
    (run in ``together`` with a ``serve``: a rank's commands otherwise run one at a time)."""
    import os
    import time

    deadline = time.monotonic() + cmd.get("timeout", 60)
    while not os.path.exists(cmd["when"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    HOLD["on"] = False
    return {"released": len(HOLD["held"])}


if __name__ == "__main__":
    main(extra_ops={"model_prefill": model_prefill, "model_decode": model_decode, "state_slot": state_slot,
                    "slice_oracle": slice_oracle, "hold_read_done": hold_read_done,
                    "release_read_done": release_read_done})
