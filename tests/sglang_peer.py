"""One SGLang disaggregation rank for the SGLang tests, run by the SGLang environment's Python.

Argument: a JSON object (role, backend, pool shape, bootstrap port). It builds what SGLang's
scheduler builds for a PD rank (``disaggregation/prefill.py`` / ``decode.py``): server args
published the way SGLang's tests do (``override_server_args``), plugins loaded (so
``--disaggregation-transfer-backend kvxfer_*`` resolves through kvxfer's entry point), SGLang's
real ``MHATokenToKVPool``, ``MetadataBuffers`` and ``ReqToMetadataIdxAllocator`` (and, with ``mamba``,
its ``HybridReqToTokenPool``, whose Mamba state becomes ``KVArgs``' state buffers), and then the
manager made by SGLang's own queue: ``PrefillBootstrapQueue(...)`` or ``DecodePreallocQueue(...)``, whose
``__init__`` calls ``_init_kv_manager``, so ``KVArgs`` holds exactly what SGLang puts there on that
role (``build``). Every ``KVArgs`` field read that SGLang left unset is recorded (``UNSET_READS``).
The prefill rank also runs SGLang's bootstrap server. Then it answers JSON commands on stdin, one
reply line each on stdout: ``serve`` (prefill: senders made by the queue's ``create_sender``, chunked
``send``), ``receive`` (decode: receivers made by the queue's ``_create_receiver_and_enqueue``,
``send_metadata``), ``serve_queued`` / ``receive_queued`` (SGLang's queues move the requests),
``sizes``, ``unset_reads``, ``exit``; ``"manager": NAME`` runs one on a further manager shaped by the
config's ``NAME`` fields (``mismatch``, ``tp2``; another attention-TP size and rank, a pipeline stage
(``pp_size``, ``pp_rank``: its layers as SGLang's ``get_pp_indices`` splits the model's), MLA, another
backend), made the same way; ``try_build`` reports how SGLang's queue fails to make one (a refused mode); ``together``
runs several commands at once, one thread each (several ranks of one instance in this process). Page,
head and aux-row contents travel back as SHA-256 digests.

The backend may also be one of SGLang's own (``nixl``, ``mooncake``): the control run
(``tests/test_sglang_control.py``). A further manager's config may name its own ``backend`` and
``bootstrap_port`` (the prefill then runs that backend's bootstrap server on it too), so one pair of
processes hands the same rooms over through SGLang's backend and kvxfer's. kvxfer's own checks
(``sizes``, ``bound``, the lease table, ``die_on_read``) are asked of kvxfer's managers only.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import traceback
from contextlib import ExitStack, contextmanager
from typing import Optional

import numpy as np
import torch

CFG = json.loads(sys.argv[1])
# replies go on a private copy of stdout; fd 1 itself (SGLang's prints, UCX's C-level logs) goes to stderr
OUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr


#: Scoped SGLang overrides held for the rank's life.
PLACEMENT = ExitStack()
#: What SGLang's scheduler would own for the rank's life (``KVArgs`` carries raw pointers into it):
#: each manager's ``MetadataBuffers``.
OWNED: dict = {}
#: Each manager's queue, as SGLang's ``__init__`` built it (``PrefillBootstrapQueue`` or ``DecodePreallocQueue``).
QUEUES: dict = {}
#: Every read of a ``KVArgs`` field that SGLang's code left unset on this rank: ``[field, reading module]``.
UNSET_READS: list = []


def reply(obj: dict) -> None:
    OUT.write(json.dumps(obj) + "\n")
    OUT.flush()


def record_unset_kvargs_reads() -> None:
    """Make the ``KVArgs`` class SGLang instantiates (``get_kv_class(..., KVClassType.KVARGS)``) a subclass
    whose ``__getattr__`` (reached only for a field nobody set: the class declares most fields without a
    value) records the field and the reading module, then raises ``AttributeError`` as ``KVArgs`` would,
    so ``getattr`` with a default still answers the default. Installed through SGLang's own
    ``HookRegistry`` (an ``AROUND`` hook, applied by ``load_plugins`` with kvxfer's)."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    class RecordingKVArgs(KVArgs):
        def __getattr__(self, name: str):
            if not name.startswith("__"):  # copy/pickle probes are no field reads
                UNSET_READS.append([name, sys._getframe(1).f_globals.get("__name__", "?")])
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def around(original, transfer_backend, class_type):
        found = original(transfer_backend, class_type)
        return RecordingKVArgs if found is KVArgs else found

    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", around, HookType.AROUND)


def host_kv_for_sglang_nixl() -> None:
    """The one change the control makes to SGLang's own ``nixl`` backend: its KV regions are declared host
    memory (``kv_data_mem_kinds = "DRAM"``), as they are here. SGLang 0.5.23 declares every device KV pool
    ``VRAM`` (the decode's ``_init_kv_manager`` sets ``VRAM`` unless HiSparse keeps the pool on the host, when it
    sets ``DRAM``; the prefill's manager defaults to ``VRAM``), and NIXL's UCX plugin refuses to register host
    memory as ``VRAM`` ("VRAM memory is detected as host by UCX", ``NIXL_ERR_BACKEND``): on a CPU pool SGLang's
    own ``nixl`` manager fails when it is made. So the ``NixlKVManager`` SGLang instantiates is, in the test
    ranks, a subclass (through SGLang's ``HookRegistry``, an ``AROUND`` hook on ``get_kv_class``) that sets
    that list to ``DRAM`` before SGLang's ``__init__`` runs; everything else is SGLang's. Its state buffers
    stay ``VRAM`` (SGLang registers them so unconditionally): the control runs without Mamba state."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def around(original, transfer_backend, class_type):
        found = original(transfer_backend, class_type)
        if transfer_backend != TransferBackend.NIXL or class_type != KVClassType.MANAGER:
            return found

        class HostKVNixlKVManager(found):
            def __init__(self, args, *rest, **kw):
                args.kv_data_mem_kinds = ["DRAM"] * len(args.kv_data_ptrs)
                super().__init__(args, *rest, **kw)

        return HostKVNixlKVManager

    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", around, HookType.AROUND)


def setup():
    from sglang.srt.plugins import load_plugins

    record_unset_kvargs_reads()
    host_kv_for_sglang_nixl()
    load_plugins()  # the real path: kvxfer's entry point in this environment's metadata
    # SGLang's scheduler imports its queues at start, as here: not inside a step a test times
    import sglang.srt.disaggregation.decode  # noqa: F401
    import sglang.srt.disaggregation.prefill  # noqa: F401
    from sglang.srt.runtime_context import get_context

    get_context().override_server_args(
        device="cpu", host="127.0.0.1", model_path=CFG.get("model", "kvxfer-test-model"),
        page_size=CFG["page_size"], disaggregation_mode=CFG["role"],
        disaggregation_transfer_backend=CFG["backend"],
        disaggregation_bootstrap_port=CFG["bootstrap_port"]).install()
    from sglang.srt.runtime_context import get_device, get_parallel

    # the device a launcher assigns each scheduler process (``SpawnRanks.gpu_id``: 0 for the first rank,
    # on a CPU server too); SGLang's own backends send it to their peer (its nixl parses it as an int)
    PLACEMENT.enter_context(get_device().override(gpu_id=0))
    # one rank of a TP-1 instance, as a scheduler process states its place before building groups
    get_parallel().override_permanently(**{name: 0 for name in (
        "attn_tp_rank", "attn_cp_rank", "attn_dcp_rank", "attn_dp_rank", "dcp_rank", "dp_rank", "pp_rank", "tp_rank",
        "moe_dp_rank", "moe_ep_rank", "moe_tp_rank", "launch_world_rank")}, pp_group=None)
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend(CFG["backend"])
    server = bootstrap_server(backend, CFG)
    return (backend, server, *build(backend, CFG))


@contextmanager
def backend_flags(backend, cfg: dict):
    """The flags a scheduler of this backend has while its manager is made: ``--disaggregation-transfer-backend``
    and ``--disaggregation-bootstrap-port`` (a manager reads its bootstrap port from them, not from its
    queue), stated with SGLang's scoped ``override`` for a further manager of another backend or port; and
    what SGLang's scheduler start does for the backend first (``distributed/bootstrap.py``):
    ``maybe_init_shared_mooncake_transfer_engine``, which makes the process's one Mooncake
    ``TransferEngine`` when the backend is ``mooncake`` (``MooncakeKVManager`` takes it)."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        maybe_init_shared_mooncake_transfer_engine)
    from sglang.srt.runtime_context import get_device, get_disagg

    with get_disagg().override(disaggregation_transfer_backend=backend.value,
                               disaggregation_bootstrap_port=cfg["bootstrap_port"]):
        maybe_init_shared_mooncake_transfer_engine(gpu_id=get_device().gpu_id)
        yield


#: The prefill's bootstrap servers, one per port (SGLang's scheduler runs one, for its one backend).
SERVERS: dict = {}


def bootstrap_server(backend, cfg: dict):
    """On a prefill rank, the backend's bootstrap server on ``cfg["bootstrap_port"]`` (once per port)."""
    from sglang.srt.disaggregation.utils import KVClassType, get_kv_class

    port = cfg["bootstrap_port"]
    if CFG["role"] == "prefill" and port not in SERVERS and int(cfg.get("attn_tp_rank", 0)) == 0:
        SERVERS[port] = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
    return SERVERS.get(port)


def await_bootstrap_server(cfg: dict, timeout_s: float = 120.0) -> None:
    """A prefill rank other than 0 registers with the bootstrap server rank 0 runs (in another process here, as on
    a multi-GPU node): wait until it answers, as a launcher starts rank 0's server before the other ranks register
    (SGLang's own registration retries too, for about 15 s)."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{cfg['bootstrap_port']}/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def is_kvxfer(manager) -> bool:
    """Whether ``manager`` is kvxfer's (else one of SGLang's own backends': the control)."""
    return type(manager).__module__.startswith("kvxfer.")


def kvxfer_only(manager, what: str) -> None:
    if not is_kvxfer(manager):
        raise RuntimeError(f"{what} asks kvxfer's tables: this manager is SGLang's own {type(manager).__name__}")


#: Each manager's Mamba request pool (``HybridReqToTokenPool``), when the rank's config has ``mamba``.
MAMBA: dict = {}


def mamba_pool(cfg: dict):
    """SGLang's real ``HybridReqToTokenPool`` (its ``MambaPool``: conv and temporal state per layer,
    one item per slot), as a hybrid Mamba model's scheduler builds it; ``cfg["mamba"]`` its request rows."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    layers = list(range(cfg["layers"]))
    shape = Mamba2StateShape.create(tp_world_size=cfg.get("attn_tp_size", 1), intermediate_size=32, n_groups=1,
                                    num_heads=4, head_dim=8, state_size=8, conv_kernel=4)
    return HybridReqToTokenPool(size=cfg["mamba"], mamba_size=cfg["mamba"], mamba_spec_state_size=0, max_context_len=64,
                                device="cpu", enable_memory_saver=False, cache_params=Mamba2CacheParams(
                                    shape=shape, layers=layers), mamba_layer_ids=layers,
                                enable_mamba_extra_buffer=False)


def state_indices_for(manager, kv_args, r: dict):
    """``state_indices`` as SGLang's prefill and decode build them (``_mamba_payload`` in
    ``disaggregation/prefill.py`` / ``decode.py``: one entry per state type, Mamba's a one-slot list),
    or None for a room without a Mamba slot. Stand-in: the room's row is pointed at the plan's slot
    directly (SGLang's ``mamba_allocator`` picks it), so source and destination slots can differ."""
    from sglang.srt.disaggregation.base.conn import StateType

    hybrid = MAMBA.get(id(manager))
    if hybrid is None or r.get("mamba_slot") is None:
        return None
    row = int(r["req_row"])
    hybrid.req_index_to_mamba_index_mapping[row] = int(r["mamba_slot"])
    payloads = {StateType.MAMBA: lambda: [
        hybrid.translate_mamba_indices(hybrid.req_index_to_mamba_index_mapping[row]).cpu().numpy()]}
    return [payloads[st]() if st in payloads else None for st in kv_args.state_types]


def state_digests(kv_args, slot: int) -> list[str]:
    """One digest per state tensor (each Mamba layer's conv, then temporal state) of one slot."""
    from kvxfer.integrations.sglang.regions import raw_view

    return [hashlib.sha256(raw_view(ptr + slot * item, item, "cpu").numpy().tobytes()).hexdigest()[:16]
            for comp_ptrs, comp_items in zip(kv_args.state_data_ptrs, kv_args.state_item_lens)
            for ptr, item in zip(comp_ptrs, comp_items)]


def state_written_slots(kv_args) -> list[int]:
    """The state slots with any non-zero byte in any state tensor (a fresh pool is all zeros)."""
    from kvxfer.integrations.sglang.regions import raw_view

    written = set()
    for comp_ptrs, comp_lens, comp_items in zip(kv_args.state_data_ptrs, kv_args.state_data_lens,
                                                kv_args.state_item_lens):
        for ptr, n, item in zip(comp_ptrs, comp_lens, comp_items):
            rows = raw_view(ptr, n, "cpu").view(n // item, item)
            written.update(torch.nonzero(rows.any(dim=1)).flatten().tolist())
    return sorted(written)


def rank_scheduler(cfg: dict, hybrid, tp: int):
    """The stand-in for SGLang's ``Scheduler`` while its queue makes the manager. A ``SimpleNamespace``
    holding only the attributes that ``PrefillBootstrapQueue.__init__`` / ``DecodePreallocQueue.__init__``,
    their ``_init_kv_manager`` and ``DecodeTransferQueue.__init__`` read in SGLang 0.5.23 (staging off, no
    HiSparse, no speculative decoding): any other read fails loudly instead of answering as a MagicMock
    would. Its model config is the other stand-in: the model's layers, and its total KV heads (this
    rank's heads x attention TP, which SGLang's prefill puts in ``KVArgs.total_kv_head_num``)."""
    from types import SimpleNamespace

    from sglang.srt.runtime_context import get_server_args

    model_config = SimpleNamespace(num_hidden_layers=cfg["layers"], get_total_num_kv_heads=lambda: cfg["heads"] * tp,
                                   hf_text_config=SimpleNamespace())  # read only for hybrid-linear pools
    runner = SimpleNamespace(kv_cache_dtype_str="bfloat16")
    if CFG["role"] == "prefill":
        runner.effective_logical_max_total_num_tokens = cfg["tokens"]
        return SimpleNamespace(server_args=get_server_args(), model_config=model_config, rust_server=None,
                               tp_worker=SimpleNamespace(model_runner=runner), kv_shard_widening=1,
                               token_to_kv_pool_allocator=SimpleNamespace(page_size=cfg["page_size"]),
                               req_to_token_pool=hybrid or request_pool(cfg))
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SimpleNamespace(server_args=get_server_args(), model_config=model_config, enable_hisparse=False,
                           tp_worker=SimpleNamespace(model_runner=runner, is_hybrid_swa=False), random_seed=0,
                           spec_algorithm=SpeculativeAlgorithm.NONE)


def request_pool(cfg: dict):
    """SGLang's request-to-token pool of the role (no Mamba): ``ReqToTokenPool`` on a prefill,
    ``DecodeReqToTokenPool`` on a decode."""
    if CFG["role"] == "prefill":
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        return ReqToTokenPool(size=cfg["aux_rows"], max_context_len=cfg["tokens"], device="cpu",
                              enable_memory_saver=False)
    from sglang.srt.disaggregation.decode import DecodeReqToTokenPool

    return DecodeReqToTokenPool(size=cfg["aux_rows"], max_context_len=cfg["tokens"], device="cpu",
                                enable_memory_saver=False, pre_alloc_size=0)


def stage_layers(cfg: dict) -> tuple[int, int]:
    """The layers ``[start, stop)`` of the model's ``cfg["layers"]`` this rank's pool holds: all at PP 1, else its
    pipeline stage's, as SGLang's model runner takes them (``get_pp_indices``, whose ``end_layer`` the runner
    hands the pool: one past the stage's last layer)."""
    from sglang.srt.distributed.utils import get_pp_indices

    pp = int(cfg.get("pp_size", 1))
    return (0, cfg["layers"]) if pp == 1 else get_pp_indices(cfg["layers"], int(cfg.get("pp_rank", 0)), pp)


def kv_pool(cfg: dict):
    """SGLang's real KV pool: ``MHATokenToKVPool`` (``cfg["heads"]`` heads on this rank), or with ``cfg["mla"]``
    its ``MLATokenToKVPool`` (one latent per token: ``kv_lora_rank`` + ``qk_rope_head_dim``, any TP); on a
    pipeline stage, its layers only (``stage_layers``), with the first and end layer the model runner states."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    start, stop = stage_layers(cfg)
    layers = {"layer_num": stop - start} if int(cfg.get("pp_size", 1)) == 1 else {
        "layer_num": stop - start, "start_layer": start, "end_layer": stop}
    if cfg.get("mla"):
        return MLATokenToKVPool(size=cfg["tokens"], page_size=cfg["page_size"], dtype=torch.bfloat16,
                                kv_lora_rank=cfg.get("kv_lora_rank", 32), qk_rope_head_dim=cfg.get("qk_rope", 8),
                                device="cpu", enable_memory_saver=False, **layers)
    return MHATokenToKVPool(size=cfg["tokens"], page_size=cfg["page_size"], dtype=torch.bfloat16,
                            head_num=cfg["heads"], head_dim=cfg["head_dim"], device="cpu",
                            enable_memory_saver=False, enable_alt_stream=False, **layers)


class StagePPGroup:
    """The stand-in for SGLang's pipeline group (a ``GroupCoordinator``) while a pipeline stage's manager is made,
    carrying only what SGLang 0.5.23 reads of it there: ``world_size`` (its parallel context checks it against
    ``pp_size``), ``rank_in_group``, and ``broadcast_object(obj, src=0)``, which ``CommonKVManager.__init__``'s
    ``PPConsensusStore`` calls once on every prefill stage (stage 0 binds its zmq socket and broadcasts the
    address; the others connect to it). The stages of one instance live in this process and are made in order,
    so stage 0's object is published for the others here; the store itself, its sockets and replication, are
    SGLang's."""

    published: dict = {}

    def __init__(self, instance: int, rank: int, size: int) -> None:
        self.instance, self.rank_in_group, self.world_size = instance, rank, size

    def broadcast_object(self, obj=None, src: int = 0):
        if self.rank_in_group == src:
            StagePPGroup.published[self.instance] = obj
            return obj
        if self.instance not in StagePPGroup.published:
            raise RuntimeError(f"pipeline stage {self.rank_in_group} made before stage {src} of its instance")
        return StagePPGroup.published[self.instance]


#: Host buffers the host-destination stand-in hands SGLang (raw pointers: kept for the rank's life).
HOST_BUFFERS: list = []


def host_receive_tree_cache(pool):
    """The stand-in for a decode's HiCache tree cache, as SGLang's ``DecodePreallocQueue._init_kv_manager``
    reads it with ``--disaggregation-decode-host-receive-threshold`` below 1, before it makes the manager:
    ``host_pool_group.get_pool`` (a host pool's ``logical_size``), ``host_pool_group.get_contiguous_buf_infos``
    (the device pool's buffers, which SGLang checks are its KV transfer layout, and host buffers of the same
    shape) and ``sidecar_pool_specs`` (none); nothing else."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos

    host = [torch.empty_like(buf) for buf in pool_buffers(pool)]
    HOST_BUFFERS.append(host)
    device = get_kv_transfer_buf_infos(pool)
    host_infos = ([t.data_ptr() for t in host], [t.nbytes for t in host], list(device[2]))
    group = SimpleNamespace(get_pool=lambda name: SimpleNamespace(logical_size=4 * pool.size),
                            get_contiguous_buf_infos=lambda names: (device, host_infos))
    return SimpleNamespace(host_pool_group=group, sidecar_pool_specs=[])


@contextmanager
def sglang_modes(cfg: dict):
    """SGLang's modes a manager's config asks for, in force while its queue is made: ``env`` (environment
    variables such as ``SGLANG_DISAGG_STAGING_BUFFER``, which SGLang's ``envs`` reads at each use) and
    ``host_receive_threshold`` (``--disaggregation-decode-host-receive-threshold``, through SGLang's scoped
    ``override``)."""
    from sglang.srt.runtime_context import get_disagg

    env = {k: str(v) for k, v in (cfg.get("env") or {}).items()}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with ExitStack() as stack:
            if cfg.get("host_receive_threshold") is not None:
                stack.enter_context(get_disagg().override(
                    disaggregation_decode_host_receive_threshold=float(cfg["host_receive_threshold"])))
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build(backend, cfg: dict):
    """One rank's pool, metadata buffers and manager, shaped by ``cfg``; the manager made by SGLang's own
    queue (``PrefillBootstrapQueue.__init__`` / ``DecodePreallocQueue.__init__``, each calling its
    ``_init_kv_manager``), around ``rank_scheduler``'s stand-in. A config with ``attn_tp_size`` > 1 builds
    this rank as attention-TP rank ``attn_tp_rank`` (0 unless given) of that size: SGLang reads the widths and
    ranks from ``get_parallel()``, so they are stated with its scoped ``override`` while the queue is made (the
    manager and queue keep them; no process group of that size is built: the other TP ranks are other
    processes, or not run at all, and a manager never contacts them), and the pool holds this rank's share of
    the heads. A pipeline stage (``pp_size`` > 1) is stated the same way, with ``StagePPGroup`` as its group, and
its pool holds its stage's layers. A prefill rank other than 0 first waits for rank 0's bootstrap server."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.runtime_context import get_parallel

    pool = kv_pool(cfg)
    meta = MetadataBuffers(size=cfg["aux_rows"], hidden_size=cfg["hidden"], hidden_states_dtype=torch.bfloat16,
                           max_sampling_mask_tokens=0)
    slots = ReqToMetadataIdxAllocator(cfg["aux_rows"])
    hybrid = mamba_pool(cfg) if cfg.get("mamba") else None
    tp, rank = int(cfg.get("attn_tp_size", 1)), int(cfg.get("attn_tp_rank", 0))
    scheduler = rank_scheduler(cfg, hybrid, tp)
    widths = {"tp_size": tp, "attn_tp_size": tp, "moe_tp_size": tp, "tp_rank": rank, "attn_tp_rank": rank,
              "moe_tp_rank": rank} if tp > 1 else {}
    pp = int(cfg.get("pp_size", 1))
    if pp > 1:  # a pipeline stage: SGLang reads its width and rank (and, on a prefill, its group) from get_parallel()
        widths.update(pp_size=pp, pp_rank=int(cfg.get("pp_rank", 0)),
                      pp_group=StagePPGroup(cfg["bootstrap_port"], int(cfg.get("pp_rank", 0)), pp))
    if CFG["role"] == "prefill" and rank > 0:
        await_bootstrap_server(cfg)
    shared = dict(req_to_metadata_buffer_idx_allocator=slots, metadata_buffers=meta, scheduler=scheduler, gpu_id=0,
                  bootstrap_port=cfg["bootstrap_port"], max_total_num_tokens=cfg["tokens"], transfer_backend=backend)
    if CFG["role"] == "prefill":
        with backend_flags(backend, cfg), get_parallel().override(**widths), sglang_modes(cfg):
            queue = PrefillBootstrapQueue(token_to_kv_pool=pool, draft_token_to_kv_pool=None,
                                          scheduler_stage_metrics=None, **shared)
    else:  # the queues keep the attention-TP group's gloo group: a real one-rank group here
        tree_cache = host_receive_tree_cache(pool) if cfg.get("host_receive_threshold") is not None else None
        with backend_flags(backend, cfg), sglang_modes(cfg), \
                get_parallel().override(attn_tp_group=SimpleNamespace(cpu_group=one_rank_group()), **widths):
            transfer = DecodeTransferQueue(slots, meta, scheduler, tree_cache=None)
            allocator = PagedTokenToKVPoolAllocator(size=cfg["tokens"], page_size=cfg["page_size"],
                                                    dtype=torch.bfloat16, device="cpu", kvcache=pool, need_sort=False)
            queue = DecodePreallocQueue(req_to_token_pool=hybrid or request_pool(cfg),
                                        token_to_kv_pool_allocator=allocator, draft_token_to_kv_pool=None,
                                        transfer_queue=transfer, tree_cache=tree_cache, num_reserved_decode_tokens=0,
                                        **shared)
    manager = queue.kv_manager
    OWNED[id(manager)] = meta  # KVArgs holds only its raw pointers: the rank owns the buffers for its life
    QUEUES[id(manager)] = queue
    if hybrid is not None:
        MAMBA[id(manager)] = hybrid
    return pool, manager.kv_args, manager


def pool_buffers(pool) -> list:
    """The pool's per-layer tensors in ``KVArgs`` order: K layers then V layers (MHA), or the latent (MLA)."""
    return list(pool.k_buffer) + list(pool.v_buffer) if hasattr(pool, "k_buffer") else list(pool.kv_buffer)


def fill(pool, kv_args, seed: int, rank: int = 0, stage: int = 0, aux_seed: Optional[int] = None) -> None:
    """Random KV bytes, other on each attention-TP rank and pipeline stage (each holds other heads or layers), and
    random aux and state rows, the same on every rank of an instance (SGLang's TP ranks compute the same first
    token and metadata) unless ``aux_seed`` says otherwise."""
    from kvxfer.integrations.sglang.regions import raw_view

    gen = torch.Generator().manual_seed(seed + 7919 * rank + 104729 * stage)
    for buf in pool_buffers(pool):
        buf.view(torch.int16).copy_(torch.randint(-2**15, 2**15, buf.shape, dtype=torch.int16, generator=gen))
    gen = torch.Generator().manual_seed(seed if aux_seed is None else aux_seed)
    state = [(p, n) for ptrs, lens in zip(kv_args.state_data_ptrs, kv_args.state_data_lens) for p, n in zip(ptrs, lens)]
    for ptr, n in list(zip(kv_args.aux_data_ptrs, kv_args.aux_data_lens)) + state:
        raw_view(ptr, n, "cpu").copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))


def _digest(tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()[:16]


def page_digests(pool, pages: list[int]) -> list[list[str]]:
    size = pool.page_size
    return [[_digest(buf.view(torch.uint8)[p * size:(p + 1) * size]) for p in pages] for buf in pool_buffers(pool)]


def head_digests(pool, pages: list[int]) -> list[list[list[str]]]:
    """Per buffer, per page, per head on this rank: the digest of that head's rows in the page (SGLang's MHA layout
    is ``[tokens, heads, head_dim]`` per layer, so a head's bytes are strided in a page)."""
    size = pool.page_size
    return [[[_digest(buf[p * size:(p + 1) * size, h].view(torch.uint8)) for h in range(buf.shape[1])]
             for p in pages] for buf in pool_buffers(pool)]


def aux_digests(kv_args, row: int) -> list[str]:
    from kvxfer.integrations.sglang.regions import raw_view

    return [hashlib.sha256(raw_view(ptr + row * item, item, "cpu").numpy().tobytes()).hexdigest()[:16]
            for ptr, item in zip(kv_args.aux_data_ptrs, kv_args.aux_item_lens)]


def finals(objs: dict, deadline: float, on_end=None) -> dict:
    """Poll every sender or receiver together (as SGLang's queues do) until each is ``Success`` or
    ``Failed``: ``{room: (status, monotonic time it was first seen, on_end(room) then)}``."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    out = {}
    while len(out) < len(objs) and time.monotonic() < deadline:
        for room, obj in objs.items():
            if room not in out:
                status = obj.poll()
                if status in (KVPoll.Success, KVPoll.Failed):
                    out[room] = (status, time.monotonic(), on_end(room) if on_end else None)
        time.sleep(0.001)
    for room, obj in objs.items():
        out.setdefault(room, (obj.poll(), time.monotonic(), None))
    return out


def reason_of(obj, status):
    from sglang.srt.disaggregation.base.conn import KVPoll

    if status != KVPoll.Failed:
        return None
    try:
        obj.failure_exception()
    except Exception as exc:
        return str(exc)
    return None


def serve(cmd, backend, manager, pool, kv_args) -> dict:
    """The prefill, driving its senders itself: each made by SGLang's ``PrefillBootstrapQueue.create_sender``
    (as its ``add`` does; the request is not queued), ``init`` at once with the room's pages and aux row; a room
    in ``abort_rooms`` is aborted (SGLang's ``abort``) instead of sent, once the decode's metadata came."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    queue = QUEUES[id(manager)]
    started = time.monotonic()
    deadline = started + cmd.get("timeout", 60)
    senders = {}
    for r in cmd["rooms"]:
        req = stand_in_req(r, CFG["page_size"])
        assert queue.create_sender(req, num_kv_heads=CFG["heads"]), f"room {r['room']} refused by create_sender"
        req.disagg_kv_sender.init(len(r["pages"]), r.get("aux_index"))
        senders[r["room"]] = req.disagg_kv_sender
    pending = {r["room"]: r for r in cmd["rooms"]}
    chunks_sent = 0
    offered = {}  # room -> when its first chunk was offered
    while pending and time.monotonic() < deadline:  # SGLang's bootstrap queue: wait for the decode's metadata
        for room, r in list(pending.items()):
            status = senders[room].poll()
            if status == KVPoll.Failed:
                pending.pop(room)
            elif status == KVPoll.WaitingForInput and room in cmd.get("abort_rooms", ()):
                senders[room].abort()  # SGLang's sender abort (an AbortReq), before any chunk of the room
                offered[room] = time.monotonic()
                pending.pop(room)
            elif status == KVPoll.WaitingForInput:
                pages = np.asarray(r["pages"], dtype=np.int64)
                bounds = np.cumsum([0] + r["chunks"])
                offered[room] = time.monotonic()
                state_indices = state_indices_for(manager, kv_args, r)
                for a, b in zip(bounds[:-1], bounds[1:]):  # state with the last chunk only, as prefill.py sends it
                    senders[room].send(pages[a:b], state_indices if b == bounds[-1] else None,
                                       num_kv_tokens=int(b - a) * CFG["page_size"])
                    chunks_sent += 1
                    if cmd.get("die_after_chunks") and chunks_sent >= cmd["die_after_chunks"]:
                        time.sleep(cmd.get("die_delay_s", 0.0))
                        os.kill(os.getpid(), signal.SIGKILL)
                pending.pop(room)
        time.sleep(0.001)
    # the lease slots held once every chunk is offered; each time SGLang sees a room end, at least as
    # many of them must already read -lease (revoked) as rooms have ended: revocation comes first
    # (kvxfer's leases: SGLang's own backends have none)
    table = manager.kvxfer_pool.table if is_kvxfer(manager) else None
    held = {} if table is None else {slot: int(table[slot]) for slot in torch.nonzero(table > 0).flatten().tolist()}
    ended_so_far = []

    def revoked_first(room):
        ended_so_far.append(room)
        return sum(int(table[slot]) == -lease for slot, lease in held.items()) >= len(ended_so_far)

    ended = finals(senders, deadline, revoked_first if table is not None else None)
    result = {}
    for room, s in senders.items():
        status, at, revoked = ended[room]
        reason = reason_of(s, status)
        if status != KVPoll.Failed:
            s.get_transfer_metric()
        s.clear()
        result[str(room)] = {"status": int(status), "reason": reason}
        if cmd.get("timing"):
            result[str(room)].update(at_s=at - offered.get(room, started), lease_revoked=revoked)
    digests = room_digests(cmd["rooms"], pool, kv_args, cmd.get("per_head", False))
    return {"rooms": result, "digests": digests, "elapsed_s": time.monotonic() - started,
            "leases_held": len(held) if table is not None else None}


def room_digests(rooms: list[dict], pool, kv_args, per_head: bool = False) -> dict:
    """Per room: each buffer's page digests, aux rows and state slots; with ``per_head``, each page's heads too."""
    return {str(r["room"]): {
        "pages": page_digests(pool, r["pages"]), **({"heads": head_digests(pool, r["pages"])} if per_head else {}),
        "aux": aux_digests(kv_args, r["aux_index"]) if r.get("aux_index") is not None else [],
        "state": state_digests(kv_args, r["mamba_slot"]) if r.get("mamba_slot") is not None else []} for r in rooms}


def die_on_first_read(manager) -> None:
    """SIGKILL this rank right after kvxfer posted its first read of a KV page: the process dies
    with that read in flight and the rest of the room unread."""
    backend = manager.kvxfer_pool.backend(manager.kvxfer_pool.kv_regions[0])
    original = backend.begin_pull_blocks

    def posted_then_die(*args, **kwargs):
        handle = original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
        return handle

    backend.begin_pull_blocks = posted_then_die


def receive(cmd, backend, manager, pool, kv_args) -> dict:
    """The decode, driving its receivers itself: each made by SGLang's
    ``DecodePreallocQueue._create_receiver_and_enqueue`` (then taken off the queue) and ``init`` for prefill
    DP rank 0 (as ``_init_receiver`` does), after SGLang's ``try_ensure_parallel_info``."""
    queue = QUEUES[id(manager)]
    addr = cmd["bootstrap"]
    host, _, port = addr.rpartition(":")
    deadline = time.monotonic() + cmd.get("timeout", 60)
    try:
        while not manager.try_ensure_parallel_info(addr):  # SGLang's prealloc queue retries this
            if time.monotonic() > deadline:
                return {"error": "no parallel info"}
            time.sleep(0.05)
    except RuntimeError as exc:
        return {"refused": str(exc)}
    if cmd.get("die_on_read"):
        kvxfer_only(manager, "die_on_read")
        die_on_first_read(manager)
    puller = getattr(manager, "kvxfer_puller", None)
    descriptors = puller.counters["descriptors"] if puller is not None else None
    receivers = {}
    for r in cmd["rooms"]:
        decode_req = queue._create_receiver_and_enqueue(stand_in_req(r, CFG["page_size"], host, int(port)))
        assert queue.queue.pop() is decode_req  # this op polls the receiver itself
        decode_req.kv_receiver.init(0)
        receivers[r["room"]] = decode_req.kv_receiver
    for r in cmd["rooms"]:  # SGLang passes [] without state, else one entry per state type
        receivers[r["room"]].send_metadata(np.asarray(r["pages"], dtype=np.int32), r.get("aux_index"),
                                           state_indices_for(manager, kv_args, r) or [], decode_prefix_len=0)
    started = time.monotonic()
    if cmd.get("abort_after_s") is not None:
        time.sleep(cmd["abort_after_s"])
        for rcv in receivers.values():
            rcv.abort()
    ended = finals(receivers, deadline)
    result = {}
    for room, rcv in receivers.items():
        status, at, _ = ended[room]
        result[str(room)] = {"status": int(status), "reason": reason_of(rcv, status), "at_s": at - started}
        rcv.clear()
    return {"rooms": result, "digests": room_digests(cmd["rooms"], pool, kv_args, cmd.get("per_head", False)),
            "elapsed_s": time.monotonic() - started, "state_written_slots": state_written_slots(kv_args),
            # kvxfer's: the descriptors its reads posted for these rooms, after merging (None for SGLang's own)
            "descriptors": None if puller is None else puller.counters["descriptors"] - descriptors}

# --- SGLang's own queues moving requests: the rank's ``PrefillBootstrapQueue`` or ``DecodePreallocQueue``
# (and its ``DecodeTransferQueue``) as ``build`` made them with their ``__init__``. The queue methods that
# move a request (``add``, ``pop_bootstrapped``, ``pop_preallocated``, ``pop_transferred``) and everything
# they call into (kvxfer's manager, senders and receivers, SGLang's ``MetadataBuffers``,
# ``ReqToMetadataIdxAllocator``, poll reductions over a real one-rank gloo group) are real. For the
# length of one command (``stood_in``), as SGLang's CPU unit tests do
# (``test/registered/unit/disaggregation/test_decode_queue_cleanup.py`` and others): the scheduler those
# methods call back into (a MagicMock there: they touch much of it), the requests, the decode's
# req-to-token table and allocator view, and the decode's admission-budget helpers (the real ones size
# a model's pools).

_ABSENT = object()


@contextmanager
def stood_in(obj, **attrs):
    """``obj``'s attributes set to ``attrs`` for a block, then put back (one the instance did not hold
    itself, a method say, is removed again)."""
    saved = {name: vars(obj).get(name, _ABSENT) for name in attrs}
    for name, value in attrs.items():
        setattr(obj, name, value)
    try:
        yield obj
    finally:
        for name, value in saved.items():
            if value is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def one_rank_group():
    """A real one-rank gloo group: SGLang's poll reductions run over it (and reduce nothing)."""
    import torch.distributed as dist

    if not dist.is_initialized():  # one rank: an in-process store, no TCP port to race another test for
        dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)
    return dist.group.WORLD


def stand_in_req(r: dict, page_size: int, host: str = "127.0.0.1", port: Optional[int] = None):
    """A request as SGLang's queue tests make one: only the fields the queues read."""
    from types import SimpleNamespace
    from unittest.mock import MagicMock

    return SimpleNamespace(
        rid=f"req-{r['room']}", bootstrap_host=host, bootstrap_port=port or CFG["bootstrap_port"],
        bootstrap_room=r["room"], disagg_prefill_dp_rank=None, data_parallel_rank=None,
        origin_input_ids=list(range(len(r["pages"]) * page_size)), output_ids=[], finished_reason=None,
        to_finish=None, return_logprob=False, return_sampling_mask=False, is_retracted=False, metadata_buffer_index=-1,
        prefill_attempt_count=0, sampling_params=SimpleNamespace(max_new_tokens=8), time_stats=MagicMock(),
        lora_id=None, priority=None, pd_rebootstrap_forced_output_id=None, swa_branching_seqlen=None,
        kv=SimpleNamespace(req_pool_idx=None, holds_kv=False, holds_mamba=False, retraction_backup=None,
                           cache_protected_len=0))


def stand_in_scheduler(group, page_size: int):
    from unittest.mock import MagicMock

    scheduler = MagicMock()  # flags read as branches are set explicitly (a MagicMock attribute is truthy)
    scheduler.attn_cp_cpu_group = scheduler.attn_tp_cpu_group = group
    scheduler.token_to_kv_pool_allocator.page_size = page_size
    scheduler.processed_tokens_counter = 0
    scheduler.running_batch.reqs = []
    scheduler.waiting_queue = []
    for flag in ("enable_priority_scheduling", "enable_hisparse", "enable_lora", "enable_decode_hicache",
                 "enable_hicache_storage"):
        setattr(scheduler, flag, False)
    scheduler.metrics_reporter.enable_metrics = False
    scheduler.kv_checksum_computer = None
    return scheduler


def serve_queued(cmd, backend, manager, pool, kv_args) -> dict:
    """The prefill: SGLang's ``PrefillBootstrapQueue`` bootstraps the requests; each popped request's
    pages go out in chunks through its sender (as ``send_kv_chunk`` does), and its sender is polled
    (as the inflight queue does) until ``Success``, then its metadata slot is freed."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce_attn_cp_tp_group

    group, meta, page_size = one_rank_group(), OWNED[id(manager)], CFG["page_size"]
    queue = QUEUES[id(manager)]
    plan = {r["room"]: r for r in cmd["rooms"]}
    reqs = [stand_in_req(r, page_size) for r in cmd["rooms"]]
    deadline = time.monotonic() + cmd.get("timeout", 60)
    inflight, done, slots, reasons = [], {}, {}, {}
    with stood_in(queue, scheduler=stand_in_scheduler(group, page_size)):
        for req in reqs:
            queue.add(req, num_kv_heads=CFG["heads"])
        while (queue.queue or inflight) and time.monotonic() < deadline:
            for req in queue.pop_bootstrapped():
                assert not req.pending_bootstrap, f"{req.rid} popped before its bootstrap (optimistic prefill)"
                idx = req.metadata_buffer_index
                slots[req.bootstrap_room] = idx
                meta.output_ids[idx].zero_()  # the prefill's forward writes these; the room is what decode checks
                meta.output_ids[idx, 0] = 1000 + req.bootstrap_room
                meta.cached_tokens[idx].zero_()
                meta.bootstrap_room[idx, 0] = req.bootstrap_room
                pages = np.asarray(plan[req.bootstrap_room]["pages"], dtype=np.int64)
                bounds = np.cumsum([0] + plan[req.bootstrap_room]["chunks"])
                for a, b in zip(bounds[:-1], bounds[1:]):
                    req.disagg_kv_sender.send(pages[a:b], None, num_kv_tokens=int(b - a) * page_size)
                inflight.append(req)
            if inflight:
                polls = poll_and_all_reduce_attn_cp_tp_group([r.disagg_kv_sender for r in inflight], group, group)
                for req, poll in zip(list(inflight), polls):
                    if poll in (KVPoll.Success, KVPoll.Failed):
                        if poll == KVPoll.Success:
                            req.disagg_kv_sender.get_transfer_metric()
                        reasons[req.bootstrap_room] = reason_of(req.disagg_kv_sender, poll)
                        req.disagg_kv_sender.clear()
                        queue.req_to_metadata_buffer_idx_allocator.free(req.metadata_buffer_index)
                        done[req.bootstrap_room] = int(poll)
                        inflight.remove(req)
            time.sleep(0.001)
    left = {"bootstrap": len(queue.queue), "inflight": len(inflight),
            "metadata_slots": CFG["aux_rows"] - queue.req_to_metadata_buffer_idx_allocator.available_size()}
    queue.queue.clear()  # a timed-out command leaves the next one an empty queue
    return {"rooms": {str(r): {"status": done.get(r), "reason": reasons.get(r)} for r in plan},
            "digests": {str(r): {"pages": page_digests(pool, plan[r]["pages"]),
                                 "aux": aux_digests(kv_args, slots[r]) if r in slots else []} for r in plan},
            "left": left}


def receive_queued(cmd, backend, manager, pool, kv_args) -> dict:
    """The decode: SGLang's ``DecodePreallocQueue`` makes the receivers (``add``), handshakes and
    publishes each request's destination pages (``pop_preallocated``: ``send_metadata``), and its
    ``DecodeTransferQueue`` polls them to ``Success`` and commits the metadata row to the request
    (checking the row's bootstrap room, SGLang's own corruption check)."""
    from types import SimpleNamespace
    from unittest.mock import MagicMock

    group, meta, page_size = one_rank_group(), OWNED[id(manager)], CFG["page_size"]
    prealloc = QUEUES[id(manager)]
    transfer = prealloc.transfer_queue
    metadata_slots = prealloc.req_to_metadata_buffer_idx_allocator
    addr = cmd["bootstrap"]
    deadline = time.monotonic() + cmd.get("timeout", 60)
    plan = {r["room"]: r for r in cmd["rooms"]}
    scheduler = stand_in_scheduler(group, page_size)
    width = max(len(r["pages"]) for r in cmd["rooms"]) * page_size
    req_to_token = torch.zeros((len(plan), width), dtype=torch.int64)  # stand-in ReqToTokenPool rows
    req_rows = SimpleNamespace(available_size=lambda: len(plan), req_to_token=req_to_token)
    hybrid = MAMBA.get(id(manager))
    if hybrid is not None:  # what _mamba_payload reads (every row on slot 0: the prefill sends no state here)
        req_rows.translate_mamba_indices = hybrid.translate_mamba_indices
        req_rows.req_index_to_mamba_index_mapping = hybrid.req_index_to_mamba_index_mapping
    allocator = SimpleNamespace(  # a plain MHA allocator's answers
        page_size=page_size, translate_kv_indices_for_transfer=lambda x: x,
        prealloc_ceiling_fits=lambda *_: None, prealloc_fits=lambda *_args, **_kw: True)
    rows = {}

    def pre_alloc(req, *_args):  # the allocator "gives" each request the destination pages the plan names
        row = rows.setdefault(req.bootstrap_room, len(rows))
        pages = plan[req.bootstrap_room]["pages"]
        tokens = torch.tensor([p * page_size + k for p in pages for k in range(page_size)], dtype=torch.int64)
        req_to_token[row, :len(tokens)] = tokens
        req.kv.req_pool_idx, req.kv.holds_kv = row, True
        return tokens

    aux_seen = {}
    clear_slot = meta.clear_slot

    def digest_then_clear(idx):  # observe the row SGLang consumed before it resets the slot
        aux_seen[int(idx)] = aux_digests(kv_args, int(idx))
        clear_slot(idx)

    scheduler.disagg_decode_prealloc_queue = prealloc
    # admission budgets and allocation stand in for the pools' (SGLang's tests stub the same helpers)
    with stood_in(transfer, scheduler=scheduler, tree_cache=MagicMock()), \
            stood_in(prealloc, scheduler=scheduler, tree_cache=MagicMock(), req_to_token_pool=req_rows,
                     token_to_kv_pool_allocator=allocator, _pre_alloc=pre_alloc,
                     _allocatable_token_budgets=lambda **_: 1 << 20, _hicache_pending_restore_tokens=lambda: 0,
                     _uses_swa_reservation=lambda: False, _uses_swa_tail_prealloc=lambda: False), \
            stood_in(meta, clear_slot=digest_then_clear):
        while not manager.try_ensure_parallel_info(addr):  # what _ensure_prefill_info retries
            if time.monotonic() > deadline:
                return {"error": "no parallel info"}
            time.sleep(0.05)
        host, _, port = addr.rpartition(":")
        reqs = {r: stand_in_req(plan[r], page_size, host, int(port)) for r in plan}
        for req in reqs.values():
            prealloc.add(req)
        committed, failed, dst_slots = {}, [], {}
        while (prealloc.queue or transfer.queue) and time.monotonic() < deadline:
            ready, dropped = prealloc.pop_preallocated()
            failed += dropped
            dst_slots.update({d.req.bootstrap_room: d.metadata_buffer_index for d in ready})
            transfer.extend(ready)
            for req in transfer.pop_transferred():
                committed[req.bootstrap_room] = req
            time.sleep(0.001)
    left = {"prealloc": len(prealloc.queue), "pending": len(prealloc.pending_reqs), "transfer": len(transfer.queue),
            "metadata_slots": CFG["aux_rows"] - metadata_slots.available_size()}
    for queue in (prealloc.queue, prealloc.pending_reqs, transfer.queue):
        queue.clear()  # a timed-out command leaves the next one empty queues
    return {"rooms": {str(r): {"status": 4 if r in committed else 0,
                               "output_ids": committed[r].output_ids if r in committed else None,
                               "reason": None if r in committed else str(reqs[r].finished_reason)} for r in plan},
            "digests": {str(r): {"pages": page_digests(pool, plan[r]["pages"]),
                                 "aux": aux_seen.get(dst_slots.get(r), [])} for r in plan},
            "failed": [d.req.rid for d in failed], "left": left}

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


def model_prefill(cmd, manager, pool) -> dict:
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


def model_decode(cmd, manager, pool) -> dict:
    """Continue from what kvxfer delivered: the first token from the aux row, the prompt's KV in
    ``pages`` (more pages after them for the new tokens)."""
    first = int(OWNED[id(manager)].output_ids[cmd["aux_index"], 0])
    return {"tokens": generate(model_for_pool(), pool, cmd["pages"], cmd["prompt_len"], first, cmd["new_tokens"])}


def try_build(cfg: dict) -> dict:
    """Make a manager as ``build`` does and report how SGLang's queue failed to: the error and the call path
    (functions and modules of the traceback), or that it was made."""
    from sglang.srt.disaggregation.utils import TransferBackend

    backend = TransferBackend(cfg["backend"])
    try:
        bootstrap_server(backend, cfg)
        build(backend, cfg)
    except Exception as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        return {"refused": f"{type(exc).__name__}: {exc}",
                "path": [f"{os.path.basename(os.path.dirname(f.filename))}/{os.path.basename(f.filename)}:{f.name}"
                         for f in frames]}
    return {"refused": None}


def manager_for(which: str, ranks: dict):
    """The rank's manager ``which`` ("main", or a further one of ``CFG[which]``), made on first use (its config may
    name its own backend and bootstrap port)."""
    if which not in ranks:
        from sglang.srt.disaggregation.utils import TransferBackend

        cfg = {**CFG, **CFG[which]}
        other = TransferBackend(cfg["backend"])
        bootstrap_server(other, cfg)
        ranks[which] = build(other, cfg)
        if CFG["role"] == "prefill":
            fill(ranks[which][0], ranks[which][1], cfg.get("seed", 1), int(cfg.get("attn_tp_rank", 0)),
                 int(cfg.get("pp_rank", 0)), cfg.get("aux_seed"))
    return ranks[which]


def answer(cmd: dict, ranks: dict, backend) -> dict:
    """One command's reply (an ``error`` reply if it raised)."""
    try:
        which = cmd.get("manager", "main")
        if cmd["op"] == "try_build":  # a manager whose making must fail: where, and why (SGLang's own path)
            return try_build({**CFG, **CFG[which]})
        pool, kv_args, manager = manager_for(which, ranks)
        op = cmd["op"]
        if op == "build":  # made above, if it was not yet
            return {"built": which, "manager": type(manager).__name__, "layout": getattr(manager, "kvxfer_layout", None),
                    "layers": list(stage_layers({**CFG, **CFG.get(which, {})} if which != "main" else CFG))}
        if op in ("serve", "receive", "serve_queued", "receive_queued"):
            return OPS[op](cmd, backend, manager, pool, kv_args)
        if op == "model_prefill":
            return model_prefill(cmd, manager, pool)
        if op == "model_decode":
            return model_decode(cmd, manager, pool)
        if op == "bound":  # the prefill's bound on an offered chunk's read-done (2 x its timeout)
            kvxfer_only(manager, "bound")
            manager.kvxfer_rooms.timeout_s = float(cmd["seconds"])
            return {"bound": manager.kvxfer_rooms.timeout_s}
        if op == "sizes":
            kvxfer_only(manager, "sizes")
            time.sleep(cmd.get("settle_s", 0.0))
            return {"sizes": manager.kvxfer_sizes(), "counters": (manager.kvxfer_rooms or manager.kvxfer_puller).counters,
                    "prefill_info_table": len(getattr(manager, "prefill_info_table", None) or {}),
                    "attn_tp_size": manager.attn_tp_size, "junk": manager.kvxfer_junk,
                    "known_prefills": manager.kvxfer_puller.known_prefills if manager.kvxfer_puller else None}
        if op == "unset_reads":  # KVArgs fields read that SGLang left unset, and by whom
            return {"unset_reads": UNSET_READS}
        return {"error": f"unknown op {op!r}"}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def together(cmds: list, ranks: dict, backend) -> dict:
    """Several commands at once, one thread each, as several ranks of one instance run at once (a room read by two
    decode ranks bootstraps only once both published their pages): the managers are made first, in order."""
    import threading

    for cmd in cmds:
        if cmd["op"] != "try_build":
            manager_for(cmd.get("manager", "main"), ranks)
    replies = [None] * len(cmds)

    def run(i: int) -> None:
        replies[i] = answer(cmds[i], ranks, backend)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cmds))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"replies": replies}


OPS = {"serve": serve, "receive": receive, "serve_queued": serve_queued, "receive_queued": receive_queued}


def main() -> None:
    try:
        backend, server, pool, kv_args, manager = setup()
        if CFG["role"] == "prefill":
            fill(pool, kv_args, CFG.get("seed", 1), int(CFG.get("attn_tp_rank", 0)), int(CFG.get("pp_rank", 0)),
                 CFG.get("aux_seed"))
        reply({"ready": True, "pid": os.getpid(), "layout": getattr(manager, "kvxfer_layout", None),
               "manager": type(manager).__name__, "endpoint": f"tcp://{manager.local_ip}:{manager.rank_port}"})
    except Exception as exc:
        reply({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return
    # a rank may also hold further managers (``CFG[name]``: a mismatched pool, another TP size or rank, another
    # backend), built on first use: more ranks without another process's imports
    ranks = {"main": (pool, kv_args, manager)}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            reply({"bye": True})
            break
        if cmd["op"] == "together":  # several commands at once, one thread each (ranks of one instance here)
            try:
                reply(together(cmd["ops"], ranks, backend))
            except Exception as exc:  # a manager that could not be made
                reply({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        else:
            reply(answer(cmd, ranks, backend))
    OUT.flush()
    os._exit(0)  # SGLang's non-daemon threads (bootstrap server) would keep the process


if __name__ == "__main__":
    main()
