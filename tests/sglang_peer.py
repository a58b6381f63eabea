"""One SGLang disaggregation rank for the SGLang tests, run by the SGLang environment's Python.

Argument: a JSON object (role, backend, pool shape, bootstrap port). It builds what SGLang's
scheduler builds for a PD rank (``disaggregation/prefill.py`` / ``decode.py``): server args
published the way SGLang's tests do (``override_server_args``), plugins loaded (so
``--disaggregation-transfer-backend kvxfer_*`` resolves through kvxfer's entry point), SGLang's
real ``MHATokenToKVPool`` and ``MetadataBuffers``, ``KVArgs`` filled from them as
``_init_kv_manager`` does, and the classes ``get_kv_class`` returns. The prefill rank also runs
SGLang's bootstrap server. Then it answers JSON commands on stdin, one reply line each on stdout:
``serve`` (prefill: senders, chunked ``send``), ``receive`` (decode: receivers, ``send_metadata``),
``sizes``, ``exit``. Page and aux-row contents travel back as SHA-256 digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np
import torch

CFG = json.loads(sys.argv[1])
# replies go on a private copy of stdout; fd 1 itself (SGLang's prints, UCX's C-level logs) goes to stderr
OUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr


def reply(obj: dict) -> None:
    OUT.write(json.dumps(obj) + "\n")
    OUT.flush()


def setup():
    from sglang.srt.plugins import load_plugins

    load_plugins()  # the real path: kvxfer's entry point in this environment's metadata
    from sglang.srt.runtime_context import get_context

    get_context().override_server_args(
        device="cpu", host="127.0.0.1", model_path=CFG.get("model", "kvxfer-test-model"),
        page_size=CFG["page_size"], disaggregation_mode=CFG["role"],
        disaggregation_transfer_backend=CFG["backend"],
        disaggregation_bootstrap_port=CFG["bootstrap_port"]).install()
    from sglang.srt.runtime_context import get_parallel

    # one rank of a TP-1 instance, as a scheduler process states its place before building groups
    get_parallel().override_permanently(**{name: 0 for name in (
        "attn_tp_rank", "attn_cp_rank", "attn_dcp_rank", "attn_dp_rank", "dcp_rank", "dp_rank", "pp_rank", "tp_rank",
        "moe_dp_rank", "moe_ep_rank", "moe_tp_rank", "launch_world_rank")}, pp_group=None)
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode, KVClassType, MetadataBuffers, TransferBackend, get_kv_class)
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    backend = TransferBackend(CFG["backend"])
    server = None
    if CFG["role"] == "prefill":
        server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", CFG["bootstrap_port"])
    pool = MHATokenToKVPool(size=CFG["tokens"], page_size=CFG["page_size"], dtype=torch.bfloat16,
                            head_num=CFG["heads"], head_dim=CFG["head_dim"], layer_num=CFG["layers"], device="cpu",
                            enable_memory_saver=False, enable_alt_stream=False)
    meta = MetadataBuffers(size=CFG["aux_rows"], hidden_size=CFG["hidden"], hidden_states_dtype=torch.bfloat16,
                           max_sampling_mask_tokens=0)
    kv_args = get_kv_class(backend, KVClassType.KVARGS)()
    kv_args.engine_rank = 0
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    kv_args.rust_http_port = None
    kv_args.kv_cache_dtype_str = "bfloat16"
    kv_args.kv_layout = None
    kv_args.prefill_start_layer = 0
    kv_args.prefill_end_layer = CFG["layers"]
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = pool.get_contiguous_buf_infos()
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = list(range(CFG["layers"])) * 2
    kv_args.kv_head_num = pool.head_num
    kv_args.total_kv_head_num = pool.head_num
    kv_args.page_size = pool.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = meta.get_buf_infos()
    kv_args.ib_device = None
    kv_args.gpu_id = 0
    kv_args.state_types, kv_args.state_data_ptrs, kv_args.state_data_lens = [], [], []
    kv_args.state_item_lens, kv_args.state_layer_ids = [], []
    mode = DisaggregationMode.PREFILL if CFG["role"] == "prefill" else DisaggregationMode.DECODE
    from sglang.srt.runtime_context import get_server_args

    manager = get_kv_class(backend, KVClassType.MANAGER)(kv_args, mode, get_server_args(), False)
    return backend, server, pool, kv_args, manager


def fill(pool, kv_args, seed: int) -> None:
    from kvxfer.integrations.sglang.regions import raw_view

    gen = torch.Generator().manual_seed(seed)
    for buf in list(pool.k_buffer) + list(pool.v_buffer):
        buf.view(torch.int16).copy_(torch.randint(-2**15, 2**15, buf.shape, dtype=torch.int16, generator=gen))
    for ptr, n in zip(kv_args.aux_data_ptrs, kv_args.aux_data_lens):
        raw_view(ptr, n, "cpu").copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))


def page_digests(pool, pages: list[int]) -> list[list[str]]:
    size = pool.page_size
    out = []
    for buf in list(pool.k_buffer) + list(pool.v_buffer):
        raw = buf.view(torch.uint8) if buf.dtype != torch.uint8 else buf
        out.append([hashlib.sha256(raw[p * size:(p + 1) * size].contiguous().numpy().tobytes()).hexdigest()[:16]
                    for p in pages])
    return out


def aux_digests(kv_args, row: int) -> list[str]:
    from kvxfer.integrations.sglang.regions import raw_view

    return [hashlib.sha256(raw_view(ptr + row * item, item, "cpu").numpy().tobytes()).hexdigest()[:16]
            for ptr, item in zip(kv_args.aux_data_ptrs, kv_args.aux_item_lens)]


def final(obj, deadline: float):
    from sglang.srt.disaggregation.base.conn import KVPoll

    while time.monotonic() < deadline:
        status = obj.poll()
        if status in (KVPoll.Success, KVPoll.Failed):
            return status
        time.sleep(0.001)
    return obj.poll()


def serve(cmd, backend, manager, pool, kv_args) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, get_kv_class

    sender_cls = get_kv_class(backend, KVClassType.SENDER)
    addr = f"127.0.0.1:{CFG['bootstrap_port']}"
    started = time.monotonic()
    deadline = started + cmd.get("timeout", 60)
    senders = {}
    for r in cmd["rooms"]:
        s = sender_cls(mgr=manager, bootstrap_addr=addr, bootstrap_room=r["room"])
        s.init(len(r["pages"]), r.get("aux_index"))
        senders[r["room"]] = s
    pending = {r["room"]: r for r in cmd["rooms"]}
    chunks_sent = 0
    while pending and time.monotonic() < deadline:  # SGLang's bootstrap queue: wait for the decode's metadata
        for room, r in list(pending.items()):
            status = senders[room].poll()
            if status == KVPoll.Failed:
                pending.pop(room)
            elif status == KVPoll.WaitingForInput:
                pages = np.asarray(r["pages"], dtype=np.int64)
                bounds = np.cumsum([0] + r["chunks"])
                for a, b in zip(bounds[:-1], bounds[1:]):
                    senders[room].send(pages[a:b], None, num_kv_tokens=int(b - a) * CFG["page_size"])
                    chunks_sent += 1
                    if cmd.get("die_after_chunks") and chunks_sent >= cmd["die_after_chunks"]:
                        time.sleep(cmd.get("die_delay_s", 0.0))
                        os.kill(os.getpid(), signal.SIGKILL)
                pending.pop(room)
        time.sleep(0.001)
    result = {}
    for room, s in senders.items():
        status = final(s, deadline)
        reason = None
        if status == KVPoll.Failed:
            try:
                s.failure_exception()
            except Exception as exc:
                reason = str(exc)
        else:
            s.get_transfer_metric()
        s.clear()
        result[str(room)] = {"status": int(status), "reason": reason}
    digests = {str(r["room"]): {"pages": page_digests(pool, r["pages"]),
                                "aux": aux_digests(kv_args, r["aux_index"]) if r.get("aux_index") is not None else []}
               for r in cmd["rooms"]}
    return {"rooms": result, "digests": digests, "elapsed_s": time.monotonic() - started}


def receive(cmd, backend, manager, pool, kv_args) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, get_kv_class

    receiver_cls = get_kv_class(backend, KVClassType.RECEIVER)
    addr = cmd["bootstrap"]
    deadline = time.monotonic() + cmd.get("timeout", 60)
    try:
        while not manager.try_ensure_parallel_info(addr):  # SGLang's prealloc queue retries this
            if time.monotonic() > deadline:
                return {"error": "no parallel info"}
            time.sleep(0.05)
    except RuntimeError as exc:
        return {"refused": str(exc)}
    receivers = {}
    for r in cmd["rooms"]:
        rcv = receiver_cls(mgr=manager, bootstrap_addr=addr, bootstrap_room=r["room"])
        rcv.init(0)
        receivers[r["room"]] = rcv
    for r in cmd["rooms"]:
        receivers[r["room"]].send_metadata(np.asarray(r["pages"], dtype=np.int32), r.get("aux_index"), [],
                                           decode_prefix_len=0)
    started = time.monotonic()
    if cmd.get("abort_after_s") is not None:
        time.sleep(cmd["abort_after_s"])
        for rcv in receivers.values():
            rcv.abort()
    result = {}
    for room, rcv in receivers.items():
        status = final(rcv, deadline)
        reason = None
        if status == KVPoll.Failed:
            try:
                rcv.failure_exception()
            except Exception as exc:
                reason = str(exc)
        result[str(room)] = {"status": int(status), "reason": reason, "at_s": time.monotonic() - started}
        rcv.clear()
    digests = {str(r["room"]): {"pages": page_digests(pool, r["pages"]),
                                "aux": aux_digests(kv_args, r["aux_index"]) if r.get("aux_index") is not None else []}
               for r in cmd["rooms"]}
    return {"rooms": result, "digests": digests, "elapsed_s": time.monotonic() - started}


def main() -> None:
    try:
        backend, server, pool, kv_args, manager = setup()
        if CFG["role"] == "prefill":
            fill(pool, kv_args, CFG.get("seed", 1))
        reply({"ready": True, "pid": os.getpid(), "layout": manager.kvxfer_layout})
    except Exception as exc:
        reply({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "serve":
                reply(serve(cmd, backend, manager, pool, kv_args))
            elif cmd["op"] == "receive":
                reply(receive(cmd, backend, manager, pool, kv_args))
            elif cmd["op"] == "sizes":
                time.sleep(cmd.get("settle_s", 0.0))
                reply({"sizes": manager.kvxfer_sizes(), "counters": (manager.kvxfer_rooms or manager.kvxfer_puller).counters})
            elif cmd["op"] == "exit":
                reply({"bye": True})
                break
        except Exception as exc:
            reply({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    OUT.flush()
    os._exit(0)  # SGLang's non-daemon threads (bootstrap server) would keep the process


if __name__ == "__main__":
    main()
