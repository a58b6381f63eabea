"""A driver that calls a kvxfer backend the way Megatron's disaggregation engine does.

Written from reading ``inference_state_handoff.py`` and ``utils.py`` of NVIDIA/Megatron-LM
at the commit named in ``docs/megatron.md``; no code of theirs is used. What it imitates:

* setup: one backend per rank, built with the keyword arguments of Megatron's
  ``setup_kv_transfer`` (``agent_name=f"{role}-rank{rank}"``, explicit layer window);
  SSM pools through ``new_registered_buffer(agent_name=f"{role}-ssm-{kind}-rank{rank}",
  heads_per_partition=width, head_dim=state_dim, tokens_per_block=1, ssm_layout=...,
  ssm_state_kind=kind)`` with a layout of Megatron's shape (our stand-in classes below,
  deliberately not kvxfer's);
* prefill: static metas gathered per TP group and PP stage once; per request TP=1 ->
  ``dict(meta)``, TP>1 -> ``{"tp_metas": [...]}``, PP>1 -> ``{"pp_metas": [{"tp_metas": ...,
  "block_ids": ids}]}``; plus ``resume_tokens`` and, for hybrid models, ``ssm`` with one
  meta (or list, or pp_metas) per state kind carrying ``block_ids=[slot]``;
* decode: ``drop_transfer_prefix_blocks`` for a cached prefix, then
  ``begin_pull_blocks(transfer_meta, transfer_src_blocks, imported_blocks)`` and per
  SSM kind ``begin_pull_blocks(ssm_meta[kind], [], [live_slot])``; handles polled with
  ``all(h.poll() for h in handles)``;
* the wire: static metas pickled once by ``all_gather_object`` at setup, then the request's
  ``kv_meta`` through Megatron's four msgpack hops (prefill engine -> coordinator -> client ->
  coordinator -> decode engine) with Megatron's ``packb``/``unpackb`` options;
* the decode's failure path (``MegatronImport``): the start error kept, not raised,
  ``transfer_destinations_safe`` read off it, ``_wait_for_transfer_handles`` over the KV and
  SSM handles before the storage is released, quarantine otherwise, retried at reset.

Run as a script it is the prefill process: ``python tests/support/megatron_driver.py BACKEND CASES_JSON``
prints ``METAS {json}`` (each case's transfer meta and source ids as JSON, and the same request
as a pickle and as the msgpack frame Megatron's coordinator sends the decode engine, base64)
and serves until stdin closes.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import pickle
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.plan.layout import KVShardLayout
from kvxfer.meta.records import drop_transfer_prefix_blocks
from kvxfer.plan.ssm_layout import SSMShardLayout


# --- stand-ins for Megatron's layout classes (same fields, not kvxfer's types) ------------------
@dataclass(frozen=True)
class MegatronSSMStateDims:
    nheads: int
    headdim: int
    d_state: int
    ngroups: int
    d_conv: int


@dataclass(frozen=True)
class MegatronSSMShardLayout:
    global_rank: int
    tp_size: int
    tp_rank: int
    layer_start: int
    num_layers: int  # this rank's SSM layers
    dims: MegatronSSMStateDims


# --- a case: model, both sides' parallelism, one request ---------------------------------------
@dataclass(frozen=True)
class Side:
    tp: int
    pp: int = 1
    windows: Optional[tuple[tuple[int, int], ...]] = None  # (layer_start, layer_end) per stage
    rank_base: int = 0


@dataclass(frozen=True)
class Case:
    name: str
    prefill: Side
    decode: Side
    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 5
    tokens_per_block: int = 3
    pool_blocks: int = 37
    dtype: str = "bfloat16"
    ssm_dims: Optional[tuple[int, int, int, int, int]] = None  # nheads, headdim, d_state, ngroups, d_conv
    ssm_layers: int = 2
    ssm_slots: int = 6
    request_blocks: int = 9
    cached_prefix: int = 0
    seed: int = 1  # the request's block ids, and the pools' values unless data_seed says otherwise
    data_seed: Optional[int] = None  # another request's bytes into the same blocks

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> "Case":
        raw = json.loads(text)
        for side in ("prefill", "decode"):
            windows = raw[side]["windows"]
            raw[side] = Side(**{**raw[side], "windows": tuple(map(tuple, windows)) if windows else None})
        if raw["ssm_dims"] is not None:
            raw["ssm_dims"] = tuple(raw["ssm_dims"])
        return Case(**raw)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class RankSpec:
    global_rank: int
    tp_rank: int
    pp_rank: int
    layer_start: int
    layer_end: int


def rank_specs(side: Side, num_layers: int) -> list[RankSpec]:
    windows = side.windows or tuple((p * num_layers // side.pp, (p + 1) * num_layers // side.pp) for p in range(side.pp))
    return [RankSpec(side.rank_base + p * side.tp + t, t, p, start, end)
            for p, (start, end) in enumerate(windows) for t in range(side.tp)]


def ssm_window(case: Case, side: Side, pp_rank: int) -> tuple[int, int]:
    per = case.ssm_layers // side.pp
    return pp_rank * per, per


# --- the global truth every shard is cut from ------------------------------------------------------
def global_tensors(case: Case) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(case.seed if case.data_seed is None else case.data_seed)
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(case.torch_dtype)
    out = {"kv": rand(2, case.num_layers, case.pool_blocks, case.tokens_per_block, case.num_heads, case.head_dim)}
    if case.ssm_dims:
        nh, hd, ds, ng, dc = case.ssm_dims
        out["conv"] = rand(case.ssm_layers, case.ssm_slots, nh * hd + 2 * ng * ds, dc)
        out["recurrent"] = rand(case.ssm_layers, case.ssm_slots, nh, hd, ds)
    return out


def kv_layout(case: Case, side: Side, spec: RankSpec) -> KVShardLayout:
    return KVShardLayout(case.num_layers, case.num_heads, tp_size=side.tp, tp_rank=spec.tp_rank, pp_size=side.pp,
                         pp_rank=spec.pp_rank, global_rank=spec.global_rank, layer_start=spec.layer_start,
                         num_local_layers=spec.layer_end - spec.layer_start)


def megatron_ssm_layout(case: Case, side: Side, spec: RankSpec) -> MegatronSSMShardLayout:
    start, count = ssm_window(case, side, spec.pp_rank)
    return MegatronSSMShardLayout(spec.global_rank, side.tp, spec.tp_rank, start, count,
                                  MegatronSSMStateDims(*case.ssm_dims))


def kv_shard(case: Case, g: torch.Tensor, side: Side, spec: RankSpec) -> torch.Tensor:
    layout = kv_layout(case, side, spec)
    h0, h1 = layout.local_head_range()
    return g[:, spec.layer_start:spec.layer_end, :, :, h0:h1].contiguous()


def ssm_shard(kind: str, g: torch.Tensor, layout: Any) -> torch.Tensor:
    ours = SSMShardLayout.coerce(layout)
    d, (l0, l1) = ours.dims, ours.local_layer_range()
    h0, h1 = ours.local_head_range()
    if kind == "recurrent":
        return g[l0:l1, :, h0:h1].contiguous()
    g0, g1 = ours.local_group_range()
    xg, bg = d.nheads * d.headdim, d.ngroups * d.d_state
    bands = [g[:, :, h0 * d.headdim:h1 * d.headdim], g[:, :, xg + g0 * d.d_state:xg + g1 * d.d_state],
             g[:, :, xg + bg + g0 * d.d_state:xg + bg + g1 * d.d_state]]
    return torch.cat(bands, dim=2)[l0:l1].contiguous()


# --- setup, as Megatron's setup_kv_transfer -------------------------------------------------------
@dataclass
class Rank:
    spec: RankSpec
    kv: Any
    ssm: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        for backend in (*self.ssm.values(), self.kv):
            backend.close()


def setup_rank(backend: str, role: str, case: Case, side: Side, spec: RankSpec, truth: Optional[dict[str, torch.Tensor]],
               **extra: Any) -> Rank:
    """Pools cut from ``truth`` (prefill) or zeroed (decode, ``truth=None``)."""
    cls = construct_kv_transfer_backend_class(backend)
    shape_source = truth or global_tensors(case)
    kv_pool = kv_shard(case, shape_source["kv"], side, spec)
    if truth is None:
        kv_pool = torch.zeros_like(kv_pool)
    layout = kv_layout(case, side, spec)
    kv = cls(agent_name=f"{role}-rank{spec.global_rank}", memory_buffer=kv_pool, expected_num_blocks=case.pool_blocks,
             tp_size=side.tp, tp_rank=spec.tp_rank, num_kv_heads_global=case.num_heads,
             heads_per_partition=layout.local_num_heads(), head_dim=case.head_dim,
             tokens_per_block=case.tokens_per_block, global_rank=spec.global_rank, pp_size=side.pp,
             pp_rank=spec.pp_rank, num_layers_global=case.num_layers, layer_start=spec.layer_start,
             layer_end=spec.layer_end, **extra)
    rank = Rank(spec, kv)
    if case.ssm_dims:
        ssm_layout = megatron_ssm_layout(case, side, spec)
        for kind in ("conv", "recurrent"):
            pool = ssm_shard(kind, shape_source[kind], ssm_layout)
            if truth is None:
                pool = torch.zeros_like(pool)
            width, state_dim = pool.shape[2], int(np.prod(pool.shape[3:]))
            rank.ssm[kind] = kv.new_registered_buffer(
                agent_name=f"{role}-ssm-{kind}-rank{spec.global_rank}", memory_buffer=pool,
                expected_num_blocks=case.ssm_slots, heads_per_partition=width, head_dim=state_dim,
                tokens_per_block=1, ssm_layout=ssm_layout, ssm_state_kind=kind)
    return rank


# --- the request -----------------------------------------------------------------------------------
def request_ids(case: Case) -> tuple[list[int], list[int], int, int]:
    """(prefill block ids, decode block ids, prefill SSM slot, decode live slot)."""
    rng = np.random.default_rng(case.seed)
    src = rng.choice(case.pool_blocks, case.request_blocks, replace=False).tolist()
    dst = rng.choice(case.pool_blocks, case.request_blocks, replace=False).tolist()
    return src, dst, 1, case.ssm_slots - 2


def prefill_kv_meta(case: Case, ranks: list[Rank]) -> tuple[dict[str, Any], list[int]]:
    """The request's ``kv_meta`` and ``block_ids`` as Megatron's prefill side builds them."""
    side = case.prefill
    block_ids, _, slot, _ = request_ids(case)
    stages: list[Any] = []
    ssm_stages: list[dict[str, Any]] = []
    for p in range(side.pp):
        stage = gathered([{"kv": r.kv.export_meta(), "ssm": {k: b.export_meta() for k, b in r.ssm.items()}}
                          for r in ranks if r.spec.pp_rank == p])
        kv_static = [entry["kv"] for entry in stage]
        stages.append(kv_static if side.tp > 1 else kv_static[0])
        if case.ssm_dims:
            with_slot = {kind: [{**entry["ssm"][kind], "block_ids": [slot]} for entry in stage]
                         for kind in ("conv", "recurrent")}
            ssm_stages.append({k: (v if side.tp > 1 else v[0]) for k, v in with_slot.items()})
    if side.pp > 1:
        kv_meta: dict[str, Any] = {"pp_metas": [{"tp_metas": s, "block_ids": block_ids} for s in stages]}
    elif side.tp > 1:
        kv_meta = {"tp_metas": stages[0]}
    else:
        kv_meta = dict(stages[0])
    kv_meta["resume_tokens"] = [7]
    if case.ssm_dims:
        kv_meta["ssm"] = {kind: ({"pp_metas": [{"tp_metas": s[kind]} for s in ssm_stages]} if side.pp > 1
                                 else ssm_stages[0][kind]) for kind in ("conv", "recurrent")}
    return kv_meta, block_ids


def gathered(obj: Any) -> Any:
    """What ``torch.distributed.all_gather_object`` hands every rank: ``obj`` pickled and unpickled
    (Megatron's ``setup_kv_transfer`` gathers the static metas over TP, then PP, this way)."""
    return pickle.loads(pickle.dumps(obj))


# --- Megatron's wire: how one request's kv_meta reaches the decode engine ---------------------------
#: Header values of ``megatron/core/inference/headers.py`` (class ``Request``).
ENGINE_REPLY, SUBMIT_REQUEST_WITH_KV = 21, 24


def _packb(obj: Any) -> bytes:
    import msgpack  # the ``test`` extra; Megatron imports it the same way, on first use

    return msgpack.packb(obj, use_bin_type=True)  # Megatron's options, everywhere


def _unpackb(frame: bytes) -> Any:
    import msgpack

    return msgpack.unpackb(frame, raw=False)


def msgpack_handoff_frame(engine_request_id: int, kv_meta: dict[str, Any], block_ids: list[int]) -> bytes:
    """The frame Megatron's coordinator sends the decode engine for one handoff.

    Each hop is a real ``packb``/``unpackb`` of the message Megatron sends there:
    1. prefill engine -> coordinator: ``[ENGINE_REPLY, [record]]``, the finished request's
       record carrying ``disaggregated_params = {request_id, block_ids, kv_meta}``
       (``_send_request_records_to_coordinator``);
    2. coordinator -> client: ``[ENGINE_REPLY, client_request_id, record]`` (``handle_engine_reply``);
    3. client -> coordinator: ``[SUBMIT_REQUEST_WITH_KV, client_request_id, prompt, sampling_params,
       kv_meta, block_ids]`` (``InferenceClient.add_request_with_kv_handoff``);
    4. coordinator -> decode engine: the same with the coordinator's request id
       (``handle_submit_request_with_kv``): returned, for the decode process to unpack.
    """
    record = {"request_id": engine_request_id, "status": "COMPLETED",
              "disaggregated_params": {"request_id": engine_request_id, "block_ids": block_ids, "kv_meta": kv_meta}}
    _, (at_coordinator,) = _unpackb(_packb([ENGINE_REPLY, [record]]))
    _, client_request_id, reply = _unpackb(_packb([ENGINE_REPLY, 7, at_coordinator]))
    params = reply["disaggregated_params"]
    submitted = _unpackb(_packb([SUBMIT_REQUEST_WITH_KV, client_request_id, [1, 2, 3], {"num_tokens_to_generate": 4},
                                 params["kv_meta"], list(params["block_ids"])]))
    return _packb([SUBMIT_REQUEST_WITH_KV, 1000 + engine_request_id, *submitted[2:]])


def decode_handoff_frame(frame: bytes) -> tuple[dict[str, Any], list[int]]:
    """The decode engine's reading of that frame (its ``_drain_zmq_socket`` loop): ``kv_meta, src_block_ids``."""
    data = _unpackb(frame)
    if data[0] != SUBMIT_REQUEST_WITH_KV:
        raise ValueError(f"not a SUBMIT_REQUEST_WITH_KV frame: header {data[0]!r}")
    _request_id, _prompt, _sampling_params, kv_meta, src_block_ids = data[1:]
    return kv_meta, src_block_ids


#: How a request crosses from the prefill process to the decode process in the tests.
WIRES = ("json", "pickle", "msgpack")


def encode_request(kv_meta: dict[str, Any], block_ids: list[int], engine_request_id: int) -> dict[str, Any]:
    """One request for the METAS line: JSON as is, the pickle and the msgpack frame in base64."""
    b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    return {"kv_meta": kv_meta, "block_ids": block_ids, "pickle": b64(pickle.dumps((kv_meta, block_ids))),
            "msgpack": b64(msgpack_handoff_frame(engine_request_id, kv_meta, block_ids))}


def decode_request(wire: str, entry: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """``kv_meta, src_block_ids`` as the decode process reads them off ``wire``."""
    if wire == "json":
        return entry["kv_meta"], entry["block_ids"]
    if wire == "pickle":
        return pickle.loads(base64.b64decode(entry["pickle"]))
    if wire == "msgpack":
        return decode_handoff_frame(base64.b64decode(entry["msgpack"]))
    raise ValueError(f"unknown wire {wire!r}; one of {WIRES}")


# --- the decode side ---------------------------------------------------------------------------------
@dataclass
class MegatronImport:
    """What Megatron's decode keeps for one import (its ``PendingKvImport``), and its verdicts."""

    kv_handle: Any
    ssm_handles: list[Any]
    start_error: Optional[Exception]  # Megatron's ``local_error``
    destinations_safe: bool  # read once, off the start error
    terminal_state_reported: bool = False

    @property
    def handles(self) -> list[Any]:
        """``_pending_transfer_handles``: the KV handle, then the SSM handles, None dropped."""
        return [h for h in (self.kv_handle, *self.ssm_handles) if h is not None]

    def report(self) -> Optional[bool]:
        """``_report_completed_kv_imports``: None while in flight, else whether the import failed.
        A start error is reported as a failure at once, without polling the posted handles."""
        failed = self.start_error is not None
        if not failed:
            try:
                if not all(h.poll() for h in self.handles):
                    return None
            except Exception as exc:  # noqa: BLE001 - Megatron keeps any exception as the local error
                self.start_error = exc
                failed = True
        self.terminal_state_reported = True
        return failed

    def may_release_after_failure(self) -> bool:
        """The ``except`` path of ``_admit_pending_kv_imports``: True frees the blocks and live
        slot (``_release_pending_kv_import``), False quarantines them."""
        safe = self.destinations_safe and self.terminal_state_reported
        return safe and wait_for_transfer_handles(*self.handles)

    def may_release_at_reset(self) -> bool:
        """``_reset_pending_kv_imports`` for a quarantined import (False: reset raises RuntimeError)."""
        return self.destinations_safe and wait_for_transfer_handles(*self.handles)


def start_import(rank: Rank, case: Case, kv_meta: dict[str, Any], src_block_ids: list[int]) -> MegatronImport:
    """``_try_start_kv_handoff_import``: trim the cached prefix, post the KV pull, then one pull per
    SSM kind (``_start_ssm_handoff_import``, conv before recurrent); the first exception stops the
    posting and is kept, with ``getattr(error, "transfer_destinations_safe", True)``."""
    _, dst, _, live_slot = request_ids(case)
    kv_handle, ssm_handles, start_error = None, [], None
    try:
        transfer_meta, transfer_src = drop_transfer_prefix_blocks(kv_meta, src_block_ids, case.cached_prefix)
        kv_handle = rank.kv.begin_pull_blocks(transfer_meta, transfer_src, dst[case.cached_prefix:])
        for kind in rank.ssm:
            ssm_handles.append(rank.ssm[kind].begin_pull_blocks(kv_meta["ssm"][kind], [], [live_slot]))
    except Exception as exc:  # noqa: BLE001 - Megatron's start path catches everything
        start_error = exc
    safe = start_error is None or getattr(start_error, "transfer_destinations_safe", True)
    return MegatronImport(kv_handle, ssm_handles, start_error, bool(safe))


def decode_import(rank: Rank, case: Case, kv_meta: dict[str, Any], src_block_ids: list[int]) -> list[Any]:
    """Megatron's decode side, for a request that must start: its handles (a start error raised)."""
    started = start_import(rank, case, kv_meta, src_block_ids)
    if started.start_error is not None:
        raise started.start_error
    return started.handles


def wait_for_transfer_handles(*handles: Any) -> bool:
    """Megatron's ``_wait_for_transfer_handles``, behaviour for behaviour: ``wait()`` on each
    handle; a ``TimeoutError`` means one may still be active (False: the destination stays
    quarantined); any other exception means finished, and Megatron then frees the storage."""
    safe_to_release = True
    for handle in handles:
        if handle is None:
            continue
        try:
            handle.wait()
        except TimeoutError:
            safe_to_release = False
        except Exception:
            pass
    return safe_to_release


def poll_all(handles: list[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(h.poll() for h in handles):
        if time.monotonic() > deadline:
            raise TimeoutError(f"handles not done within {timeout_s}s")
        time.sleep(0.001)


def expected_decode(case: Case, truth: dict[str, torch.Tensor], rank: Rank) -> dict[str, torch.Tensor]:
    """What the decode rank's pools must hold afterwards: imported blocks/slot set, the rest zero."""
    src, dst, slot, live = request_ids(case)
    p = case.cached_prefix
    out = {}
    want = torch.zeros_like(rank.kv.memory_buffer)
    full = kv_shard(case, truth["kv"], case.decode, rank.spec)
    want[:, :, torch.tensor(dst[p:], dtype=torch.long)] = full[:, :, torch.tensor(src[p:], dtype=torch.long)]
    out["kv"] = want
    for kind, backend in rank.ssm.items():
        want = torch.zeros_like(backend.memory_buffer)
        want[:, live] = ssm_shard(kind, truth[kind], backend.ssm_layout)[:, slot]
        out[kind] = want
    return out


def pools(rank: Rank) -> dict[str, torch.Tensor]:
    return {"kv": rank.kv.memory_buffer, **{k: b.memory_buffer for k, b in rank.ssm.items()}}


def serve_prefill(backend: str, cases: list[Case], **extra: Any) -> tuple[dict[str, Any], list[Rank]]:
    """Every case's prefill ranks; returns {case name: ``encode_request``} and the ranks to close."""
    metas, ranks = {}, []
    for case in cases:
        truth = global_tensors(case)
        case_ranks = [setup_rank(backend, "prefill", case, case.prefill, spec, truth, **extra)
                      for spec in rank_specs(case.prefill, case.num_layers)]
        ranks += case_ranks
        kv_meta, block_ids = prefill_kv_meta(case, case_ranks)
        metas[case.name] = encode_request(kv_meta, block_ids, engine_request_id=len(metas))
    return metas, ranks


def main(argv: list[str]) -> None:
    backend, cases = argv[0], [Case.from_json(text) for text in json.loads(argv[1])]
    metas, ranks = serve_prefill(backend, cases)
    print("METAS " + json.dumps(metas), flush=True)
    sys.stdin.read()  # serve until the decode side closes our stdin
    for rank in ranks:
        rank.close()


if __name__ == "__main__":
    main(sys.argv[1:])
