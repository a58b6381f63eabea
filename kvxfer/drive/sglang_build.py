"""Build one SGLang disaggregation rank with SGLang's own code: what ``kvxfer.drive.sglang_rank`` (the rank
process, run by the SGLang environment's Python) holds, for ``kvxfer bench-sglang`` and the SGLang tests.

It builds what SGLang's scheduler builds for a PD rank (``disaggregation/prefill.py`` / ``decode.py``): server
args published the way SGLang's tests do (``override_server_args``), plugins loaded (so
``--disaggregation-transfer-backend kvxfer_*`` resolves through kvxfer's entry point), SGLang's real
``MHATokenToKVPool`` (or ``MLATokenToKVPool``), ``MetadataBuffers`` and ``ReqToMetadataIdxAllocator`` (and, with
``mamba``, its ``HybridReqToTokenPool``, whose Mamba state becomes ``KVArgs``' state buffers), and then the manager
made by SGLang's own queue: ``PrefillBootstrapQueue(...)`` or ``DecodePreallocQueue(...)``, whose ``__init__``
calls ``_init_kv_manager``, so ``KVArgs`` holds exactly what SGLang puts there on that role (``build``). Every
``KVArgs`` field read that SGLang left unset is recorded (``UNSET_READS``). A prefill rank also runs SGLang's
bootstrap server. The stand-ins (SGLang's scheduler and model config while a queue is made, a pipeline group,
a HiCache tree cache) carry only the attributes SGLang's code reads there, and say so.

The backend may also be one of SGLang's own (``nixl``, ``mooncake``): the control. A further manager's config
may name its own ``backend`` and ``bootstrap_port`` (the prefill then runs that backend's bootstrap server on it
too), so one pair of processes hands the same rooms over through SGLang's backend and kvxfer's.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from contextlib import ExitStack, contextmanager
from typing import Optional

import torch

#: The rank's configuration (role, backend, pool shape, bootstrap port; further managers by name), set once by
#: the rank's ``main`` from its command line.
CFG: dict = {}

#: Scoped SGLang overrides held for the rank's life.
PLACEMENT = ExitStack()
#: What SGLang's scheduler would own for the rank's life (``KVArgs`` carries raw pointers into it):
#: each manager's ``MetadataBuffers``.
OWNED: dict = {}
#: Each manager's queue, as SGLang's ``__init__`` built it (``PrefillBootstrapQueue`` or ``DecodePreallocQueue``).
QUEUES: dict = {}
#: Every read of a ``KVArgs`` field that SGLang's code left unset on this rank: ``[field, reading module]``.
UNSET_READS: list = []


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
    from sglang.srt.disaggregation.utils import TransferBackend

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
    return type(manager).__module__.startswith("kvxfer.integrations.")


def kvxfer_only(manager, what: str) -> None:
    if not is_kvxfer(manager):
        raise RuntimeError(f"{what} asks kvxfer's tables: this manager is SGLang's own {type(manager).__name__}")


#: Each manager's Mamba request pool (``HybridReqToTokenPool``), when the rank's config has ``mamba``.
MAMBA: dict = {}


def mamba_pool(cfg: dict):
    """SGLang's real ``HybridReqToTokenPool`` (its ``MambaPool``: conv and temporal state per layer,
    one item per slot), as a hybrid Mamba model's scheduler builds it; ``cfg["mamba"]`` its request rows,
    ``cfg["mamba_groups"]`` its Mamba2 groups (1 unless given; a multiple of the attention TP size shards them
    evenly, as a model meant for that TP does), the state sharded for the rank's attention-TP size."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    layers = list(range(cfg["layers"]))
    shape = Mamba2StateShape.create(tp_world_size=cfg.get("attn_tp_size", 1), intermediate_size=32,
                                    n_groups=cfg.get("mamba_groups", 1),
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


def one_rank_group():
    """A real one-rank gloo group: SGLang's poll reductions run over it (and reduce nothing)."""
    import torch.distributed as dist

    if not dist.is_initialized():  # one rank: an in-process store, no TCP port to race another test for
        dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)
    return dist.group.WORLD


def pool_buffers(pool) -> list:
    """The pool's per-layer tensors in ``KVArgs`` order: K layers then V layers (MHA), or the latent (MLA)."""
    return list(pool.k_buffer) + list(pool.v_buffer) if hasattr(pool, "k_buffer") else list(pool.kv_buffer)


def fill(pool, kv_args, seed: int, rank: int = 0, stage: int = 0, aux_seed: Optional[int] = None) -> None:
    """Random KV and state bytes, other on each attention-TP rank and pipeline stage (each holds other heads,
    state shards or layers), and random aux rows, the same on every rank of an instance (SGLang's TP ranks compute
    the same first token and metadata) unless ``aux_seed`` says otherwise."""
    from kvxfer.integrations.sglang.regions import raw_view

    gen = torch.Generator().manual_seed(seed + 7919 * rank + 104729 * stage)
    for buf in pool_buffers(pool):
        buf.view(torch.int16).copy_(torch.randint(-2**15, 2**15, buf.shape, dtype=torch.int16, generator=gen))
    gen = torch.Generator().manual_seed(seed if aux_seed is None else aux_seed)
    for ptr, n in zip(kv_args.aux_data_ptrs, kv_args.aux_data_lens):
        raw_view(ptr, n, "cpu").copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))
    gen = torch.Generator().manual_seed(seed + 7919 * rank + 104729 * stage + 13)  # each rank its shard of the state
    for ptrs, lens in zip(kv_args.state_data_ptrs, kv_args.state_data_lens):
        for ptr, n in zip(ptrs, lens):
            raw_view(ptr, n, "cpu").copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))

