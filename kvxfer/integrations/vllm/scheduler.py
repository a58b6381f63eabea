"""The connector's scheduler role: what to load, what to keep pinned, and the signed tickets.

Decode side (``kv_consumer``/``kv_both``): a request whose ``kv_transfer_params`` say
``do_remote_prefill`` loads its prompt's KV asynchronously (``get_num_new_matched_tokens``
returns the tokens beyond the local prefix-cache hit, ``True``); after vLLM allocated its
blocks (``update_state_after_alloc``) the blocks past the hit become one ``LoadSpec``
(prefix-cache hits pull only the missing blocks). The scheduler never decides to recompute:
a bad ticket still becomes a load, which the worker refuses before any byte moves, so vLLM's
``kv_load_failure_policy`` applies to it like to any failed load.

Producer side (``kv_producer``/``kv_both``): ``request_finished`` of a request with
``do_remote_decode`` keeps its blocks (``delay_free``) and returns the ticket: NixlConnector's
fields plus kvxfer's signed lease. The blocks go back to vLLM when the worker reports the
request in ``finished_sending`` (read-done, read-failed, or the lease grace), never on a
bare timer. It also binds ``kv_ip:kv_port`` for the handshake, served from a process of its own
(``handshake_server``: a thread of this process would wait for the engine's GIL).

Hybrid attention+Mamba models (several transfer groups): a Mamba layer's state after ``n`` tokens
is one slot, not a block per token range, and vLLM recomputes the last prompt token of a whole-
prompt load (``scheduler.py``: ``num_computed_tokens = num_tokens - 1``), which would advance a
state that already holds it. So the producer computes the prompt without its last token
(``on_new_request``, as NixlConnector's ``_truncate_request_for_prefill``), the ticket carries
``remote_num_tokens`` = N-1 and, per group, the attention blocks and the one running Mamba slot;
the decode loads N-1 tokens and computes the last one itself.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import TYPE_CHECKING, Any, Optional

from kvxfer.errors import KVXferError
from kvxfer.handoff.guard import LeaseSlots
from kvxfer.integrations.vllm.config import ConnectorConfigError, KvxferConfig
from kvxfer.integrations.vllm.pp_stages import compose_stages
from kvxfer.integrations.vllm.handshake import EngineLayout, build_handshake
from kvxfer.integrations.vllm.metadata import (KvxferConnectorMetadata, KvxferHandshakeMetadata, LoadSpec,
                                               SendSpec)
from kvxfer.integrations.vllm.handshake_server import HandshakeServer
from kvxfer.integrations.vllm.side_channel import local_only_policy
from kvxfer.integrations.vllm.specs import ATTENTION, MAMBA, GroupLoad, TransferGroup
from kvxfer.integrations.vllm.tickets import parse_ticket, prompt_digest, sign_ticket, ticket_key
from kvxfer.meta.seal import meta_key_from_env

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def running_slot(block_ids: "list[int]", spec_blocks: int) -> list[int]:
    """A Mamba group's running-state slot in vLLM's list for a request: the last one before the
    ``spec_blocks`` speculative scratch slots (``[]`` if there is none)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks

    return list(clip_ssm_state_blocks(list(block_ids), spec_blocks))


class KvxferScheduler:
    def __init__(self, vllm_config: "VllmConfig", engine_id: str, cfg: KvxferConfig,
                 kv_cache_config: Optional["KVCacheConfig"] = None,
                 groups: tuple[TransferGroup, ...] = ()) -> None:
        kv_cfg = vllm_config.kv_transfer_config
        parallel = vllm_config.parallel_config
        self.cfg = cfg
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size
        self.kv_cache_config = kv_cache_config
        #: per transfer group when the model is hybrid (several groups); empty: one attention/MLA group
        self.groups: tuple[TransferGroup, ...] = groups if len(groups) > 1 else ()
        self.has_mamba = any(g.kind == MAMBA for g in self.groups)
        if self.groups:
            self.block_size = min(g.block_size for g in self.groups if g.kind == ATTENTION)
        self.is_producer = bool(kv_cfg.is_kv_producer)
        self.is_consumer = bool(kv_cfg.is_kv_consumer)
        self.tp_size = parallel.tensor_parallel_size
        self.pp_size = parallel.pipeline_parallel_size
        self.instance = uuid.uuid4().hex
        self.cluster_key = meta_key_from_env()
        self._instance_key = None if self.cluster_key is not None else os.urandom(32)
        self._ticket_key = ticket_key(self.cluster_key, self._instance_key)
        base_port = int(kv_cfg.kv_port)
        self.port = base_port + parallel.data_parallel_index if base_port else 0
        self.listener: Optional[HandshakeServer] = None
        self._document = b""  # the sealed handshake the listener's process serves
        self._served_ranks: dict[int, Any] = {}
        self._slots = LeaseSlots(cfg.lease_slots)
        self._slot_of: dict[str, int] = {}
        self._local_computed: dict[str, int] = {}
        self._loads: list[LoadSpec] = []
        self._sends: list[SendSpec] = []
        self.exports_refused = 0
        self._exports_refused_told = 0  # what interval_stats already reported

    # --- producer: the handshake listener ------------------------------------------------
    def set_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """The workers' metas, served sealed on ``kv_ip:kv_port``. vLLM calls it after the KV cache was
        registered, and (0.33) again after a sleep re-registered it: the new document then replaces the old
        under a new instance id, so decodes fetch it again and tickets made before the sleep are refused (the
        cache they name was discarded)."""
        if not self.is_producer:
            return
        import json

        ranks: dict[int, Any] = {}
        layout: Optional[EngineLayout] = None
        stage_layouts: dict[int, EngineLayout] = {}
        windows: dict[int, Any] = {}
        for key, item in metadata.items():  # ``tp_rank``, or ``(pp_rank, tp_rank)`` from a prefill of PP > 1
            pp_rank, tp_rank = (int(key[0]), int(key[1])) if isinstance(key, tuple) else (0, int(key))
            if not isinstance(item, KvxferHandshakeMetadata):
                raise ConnectorConfigError(f"KvxferConnector got handshake metadata of type {type(item).__name__}")
            payload = json.loads(item.payload)
            ranks[pp_rank * self.tp_size + tp_rank] = {"kv": payload["kv"], "lease": payload["lease"]}
            if tp_rank == 0:
                stage_layouts[pp_rank] = EngineLayout.from_dict(payload["layout"])
                if payload.get("stage") is not None:
                    windows[pp_rank] = payload["stage"]
        if self.pp_size > 1 and len(stage_layouts) == self.pp_size:  # every stage's regions and window
            layout = compose_stages(stage_layouts, windows)
        else:
            layout = stage_layouts.get(0) if self.pp_size == 1 else None
        if layout is None:
            raise ConnectorConfigError(f"KvxferConnector got no handshake metadata from TP rank 0 of each of its "
                                       f"{self.pp_size} pipeline stage(s)")
        again = self.listener is not None
        if again:
            if self._served_ranks == ranks:
                return  # the same registrations: nothing to serve anew
            old, self.instance = self.instance, uuid.uuid4().hex
        self._document = build_handshake(engine_id=self.engine_id, instance=self.instance,
                                         backend=self.cfg.backend_name, layout=layout, ranks=ranks,
                                         ticket_key=self._instance_key, cluster_key=self.cluster_key)
        self._served_ranks = ranks
        if again:
            assert self.listener is not None
            self.listener.update(self._document)
            logger.info("kvxfer vllm: producer %s registered its KV cache again (sleep mode): serving instance %s, "
                        "tickets of instance %s are refused from now on", self.engine_id, self.instance, old)
            return
        self.listener = HandshakeServer(self.cfg.kv_ip, self.port, self._document,
                                        local_peers_only=local_only_policy(self.cluster_key))
        self.port = self.listener.port
        document = self._document
        logger.info("kvxfer vllm: producer %s serves its handshake on %s:%d (%d bytes, %s; process %d)",
                    self.engine_id, self.cfg.kv_ip, self.port, len(document),
                    "signed" if self.cluster_key is not None else "same-host peers only: no KVXFER_SECRET_FILE",
                    self.listener.pid)

    # --- decode side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not self.is_consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        remote = params.get("remote_num_tokens")
        if isinstance(remote, bool) or not isinstance(remote, int) or remote <= 0:
            remote = request.num_prompt_tokens  # malformed: the worker refuses the ticket, the policy decides
        # Mamba: the producer stopped one token short (on_new_request), so N-1 load; a ticket claiming all N
        # still loads N-1 here and is refused before any byte moves (_prompt_refusal, parse_ticket)
        cap = request.num_prompt_tokens - 1 if self.has_mamba else request.num_prompt_tokens
        count = min(remote, cap) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_computed[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not self.is_consumer or not params or not params.get("do_remote_prefill"):
            return
        spec_params = dict(params)
        params["do_remote_prefill"] = False  # one transfer per request, as NixlConnector does
        local_computed = self._local_computed.pop(request.request_id, 0)
        if num_external_tokens <= 0:
            # Nothing to load (the local prefix cache holds it all): let the producer free its pin now.
            self._loads.append(LoadSpec(request.request_id, spec_params, (), 0, awaiting=False,
                                        refusal=self._prompt_refusal(request, spec_params),
                                        groups=self._release_groups()))
            return
        refusal = self._prompt_refusal(request, spec_params)
        if self.groups:
            loads = self._group_loads(blocks, local_computed, num_external_tokens)
            union = tuple(b for load in loads for b in load.local_block_ids)
            self._loads.append(LoadSpec(request.request_id, spec_params, union, 0, awaiting=True, refusal=refusal,
                                        groups=loads))
            return
        first = local_computed // self.block_size
        last = _cdiv(local_computed + num_external_tokens, self.block_size)
        local_ids = tuple(blocks.get_block_ids()[0][first:last])
        self._loads.append(LoadSpec(request.request_id, spec_params, local_ids, first, awaiting=True,
                                    refusal=refusal))

    def _release_groups(self) -> tuple[GroupLoad, ...]:
        """A release-only load of a hybrid model: its transfer groups, no blocks (the worker parses the
        ticket per group, as the producer made it, then only reads the lease)."""
        return tuple(GroupLoad(group, ()) for group in self.groups)

    def _group_loads(self, blocks: "KVCacheBlocks", local_computed: int, num_external_tokens: int
                     ) -> tuple[GroupLoad, ...]:
        """Per transfer group, the decode's blocks the load fills: attention, the blocks past the local
        hit up to the loaded tokens (in that group's block size); Mamba, the running slot vLLM allocated
        for the request (unhashed, not a null placeholder, before the speculative scratch slots)."""
        assert self.kv_cache_config is not None
        ids = self.kv_cache_config.select_transfer_block_ids(blocks.get_block_ids())
        unhashed = self.kv_cache_config.select_transfer_block_ids(blocks.get_unhashed_block_ids_all_groups())
        out = []
        for group, group_ids, fresh in zip(self.groups, ids, unhashed):
            if group.kind == MAMBA:
                out.append(GroupLoad(group, tuple(running_slot(fresh, group.spec_blocks))))
                continue
            first = local_computed // group.block_size
            last = _cdiv(local_computed + num_external_tokens, group.block_size)
            out.append(GroupLoad(group, tuple(group_ids[first:last]), first))
        return tuple(out)

    def _prompt_refusal(self, request: "Request", params: dict[str, Any]) -> Optional[str]:
        tokens = request.prompt_token_ids
        if tokens is None:
            return "the request has no prompt token ids (prompt embeds): its KV cannot be matched to a ticket"
        try:
            parse_ticket(params, block_size=self.block_size, max_tokens=len(tokens),
                         groups=self.groups or None).check_prompt(tokens)
        except KVXferError as exc:
            return str(exc)
        return None

    # --- both ---------------------------------------------------------------------------------
    def build_connector_meta(self) -> KvxferConnectorMetadata:
        meta = KvxferConnectorMetadata(loads=self._loads, sends=self._sends)
        self._loads, self._sends = [], []
        return meta

    def update_connector_output(self, finished_sending: Any) -> None:
        for request_id in finished_sending or ():
            slot = self._slot_of.pop(request_id, None)
            if slot is not None:
                self._slots.give_back(slot)

    def on_new_request(self, request: "Request") -> None:
        """Producer of a Mamba model: compute the prompt without its last token, so the exported state
        is the one after N-1 tokens and the decode's recompute of the last token advances it once
        (``_p_side_truncated`` guards a preempted request; a request that skips reading the prefix cache
        loads nothing on the decode, which recomputes it all)."""
        params = request.kv_transfer_params
        if not (self.is_producer and self.has_mamba and params and params.get("do_remote_decode")):
            return
        if params.get("_p_side_truncated") or request.num_prompt_tokens <= 1 or request.prompt_token_ids is None \
                or request.get_skip_reading_prefix_cache():
            return
        del request.prompt_token_ids[-1]
        del request._all_token_ids[-1]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_p_side_truncated"] = True

    def _ticket_block_ids(self, block_ids: "tuple[list[int], ...]") -> list[list[int]]:
        """``remote_block_ids``: one list per transfer group; a Mamba group's only its running slot.
        One group (not hybrid): the list vLLM gave, as before."""
        if not self.groups:
            return [list(block_ids[0])]
        assert self.kv_cache_config is not None
        chosen = self.kv_cache_config.select_transfer_block_ids(list(block_ids))
        return [running_slot(ids, g.spec_blocks) if g.kind == MAMBA else list(ids)
                for g, ids in zip(self.groups, chosen)]

    def request_finished(self, request: "Request", block_ids: "tuple[list[int], ...]"
                         ) -> tuple[bool, Optional[dict[str, Any]]]:
        """``block_ids``: one list per KV cache group (all groups, as vLLM's scheduler passes them)."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill") and self.is_consumer:
            # Finished (aborted) before it was scheduled: release the producer's pin now.
            params["do_remote_prefill"] = False
            self._local_computed.pop(request.request_id, None)
            release = dict(params, do_remote_prefill=True)  # checked against the prompt, as a load's ticket is
            self._loads.append(LoadSpec(request.request_id, release, (), 0, awaiting=False,
                                        refusal=self._prompt_refusal(request, release),
                                        groups=self._release_groups()))
            return False, None
        if not params.get("do_remote_decode") or not self.is_producer:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        remote_block_ids = self._ticket_block_ids(block_ids) if block_ids else []
        if not remote_block_ids or not all(remote_block_ids) or request.prompt_token_ids is None:
            return False, None
        taken = self._slots.take()
        if taken is None:
            self.exports_refused += 1
            logger.error("kvxfer vllm: request %s not exported: all %d lease slots are held by exports still "
                         "waiting for their decode (raise kv_connector_extra_config 'lease_slots')",
                         request.request_id, self._slots.num_slots)
            return False, None
        slot, lease = taken
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        out: dict[str, Any] = dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=remote_block_ids,
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_host=self.cfg.remote_host,
            remote_port=self.port,
            tp_size=self.tp_size,
            dcp_size=1,
            pp_size=self.pp_size,
            remote_num_tokens=num_tokens,
            remote_blocks_expiry_time=None,
            transfer_mode="pull",
        )
        assert self._ticket_key is not None
        sign_ticket(out, {"instance": self.instance, "slot": slot, "lease": lease, "backend": self.cfg.backend_name,
                          "prompt": prompt_digest(request.prompt_token_ids, num_tokens),
                          "block_size": self.block_size}, self._ticket_key)  # bounds the ids before the handshake
        self._slot_of[request.request_id] = slot
        self._sends.append(SendSpec(request.request_id, tuple(b for ids in remote_block_ids for b in ids), slot, lease))
        return True, out

    def interval_stats(self) -> Optional[dict[str, Any]]:
        """The scheduler's part of vLLM's stats since the last call (None when nothing changed)."""
        refused, self._exports_refused_told = self.exports_refused - self._exports_refused_told, self.exports_refused
        return {"exports_refused": refused} if refused else None

    def shutdown(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
