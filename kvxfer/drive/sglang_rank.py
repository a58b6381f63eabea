"""One SGLang disaggregation rank as a process, run by the SGLang environment's Python:
``python -m kvxfer.drive.sglang_rank CONFIG_JSON`` (``kvxfer bench-sglang``, and the SGLang tests through
``tests/support/sglang_peer.py``, which adds the tests' own commands).

The rank is built by ``kvxfer.drive.sglang_build`` (SGLang's own queues make every manager). Then it answers JSON
commands on stdin, one reply line each on stdout: ``serve`` (prefill: senders made by the queue's
``create_sender``, chunked ``send``), ``receive`` (decode: receivers made by the queue's
``_create_receiver_and_enqueue``, ``send_metadata``), ``serve_queued`` / ``receive_queued`` (SGLang's queues move
the requests: ``add``, ``pop_bootstrapped``, ``pop_preallocated``, ``pop_transferred``; the decode also times
each room from ``add`` to SGLang committing it), ``build``, ``try_build``, ``sizes``, ``bound``,
``unset_reads``, ``exit``; ``"manager": NAME`` runs one on a further manager shaped by the config's ``NAME``
fields (a mismatched pool, another attention-TP size and rank, a pipeline stage, MLA, another backend), made on
first use; ``together`` runs several commands at once, one thread each (several ranks of one instance in this
process). Page, head and aux-row contents travel back as SHA-256 digests. kvxfer's own checks (``sizes``,
``bound``, the lease table, ``die_on_read``) are asked of kvxfer's managers only.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from typing import Callable, Optional

import numpy as np
import torch

from kvxfer.drive.sglang_build import (CFG, MAMBA, OWNED, QUEUES, UNSET_READS, bootstrap_server, build, fill,
                                       is_kvxfer, kvxfer_only, one_rank_group, pool_buffers, setup, stage_layers,
                                       state_digests, state_indices_for, state_written_slots)

#: Where replies go: a private copy of the process's stdout (``main`` points fd 1 itself, which SGLang's prints
#: and UCX's C-level logs use, at stderr).
OUT = [sys.stdout]


def reply(obj: dict) -> None:
    OUT[0].write(json.dumps(obj) + "\n")
    OUT[0].flush()


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
    in ``abort_rooms`` is aborted (SGLang's ``abort``) instead of sent, once the decode's metadata came. With
    ``offer_together`` no chunk goes out before every room's metadata came (a decode that dies on its first read
    has then sent all of it, so every room is offered under a lease)."""
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
        polled = {room: senders[room].poll() for room in pending}
        if cmd.get("offer_together") and any(status not in (KVPoll.WaitingForInput, KVPoll.Failed)
                                             for status in polled.values()):
            time.sleep(0.001)  # every room's metadata first: the decode has sent all of it before any read
            continue
        for room, r in list(pending.items()):
            status = polled[room]
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
    for i, r in enumerate(cmd["rooms"]):  # SGLang passes [] without state, else one entry per state type
        if i and cmd.get("metadata_gap_s"):
            time.sleep(cmd["metadata_gap_s"])  # a scheduler slow between rooms: reads may start before the next
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
    posted: list[int] = []
    with stood_in(queue, scheduler=stand_in_scheduler(group, page_size)), counting_nixl_posts(manager, posted):
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
            "left": left, "descriptors": sum(posted) if not is_kvxfer(manager) and hasattr(manager, "agent") else None}


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
        puller = getattr(manager, "kvxfer_puller", None)
        descriptors = puller.counters["descriptors"] if puller is not None else None
        added, committed_at, published = {}, {}, {}
        for room, req in reqs.items():
            added[room] = time.monotonic()
            prealloc.add(req)
        committed, failed, dst_slots = {}, [], {}
        while (prealloc.queue or transfer.queue) and time.monotonic() < deadline:
            ready, dropped = prealloc.pop_preallocated()
            failed += dropped
            dst_slots.update({d.req.bootstrap_room: d.metadata_buffer_index for d in ready})
            published.update({d.req.bootstrap_room: time.monotonic() for d in ready})
            transfer.extend(ready)
            for req in transfer.pop_transferred():
                committed[req.bootstrap_room] = req
                committed_at[req.bootstrap_room] = time.monotonic()
            time.sleep(0.001)
    left = {"prealloc": len(prealloc.queue), "pending": len(prealloc.pending_reqs), "transfer": len(transfer.queue),
            "metadata_slots": CFG["aux_rows"] - metadata_slots.available_size()}
    for queue in (prealloc.queue, prealloc.pending_reqs, transfer.queue):
        queue.clear()  # a timed-out command leaves the next one empty queues
    return {"rooms": {str(r): {"status": 4 if r in committed else 0,
                               "output_ids": committed[r].output_ids if r in committed else None,
                               "reason": None if r in committed else str(reqs[r].finished_reason),
                               # from SGLang's queue taking the request (``add``) to committing it
                               "handoff_s": committed_at[r] - added[r] if r in committed else None,
                               # of which: until SGLang's prealloc queue published the room's pages (its bootstrap,
                               # the decode's handshake, send_metadata), then until its transfer queue committed it
                               "published_s": published[r] - added[r] if r in published else None} for r in plan},
            "digests": {str(r): {"pages": page_digests(pool, plan[r]["pages"]),
                                 "aux": aux_seen.get(dst_slots.get(r), [])} for r in plan},
            "failed": [d.req.rid for d in failed], "left": left,
            "elapsed_s": max(committed_at.values(), default=min(added.values())) - min(added.values()),
            # kvxfer's: the descriptors its reads posted for these rooms, after merging (None for SGLang's own)
            "descriptors": None if puller is None else puller.counters["descriptors"] - descriptors}


@contextmanager
def counting_nixl_posts(manager, posted: list[int]):
    """For SGLang's own ``nixl`` manager (it writes from the prefill), add to ``posted`` the descriptors of each
    transfer it asks NIXL for while the block runs: the index list of a prepared transfer
    (``make_prepped_xfer``), the descriptor list of a plain one (``initialize_xfer``), as given (NIXL may merge
    them further). A measuring wrapper around SGLang's agent, removed after; anything else is left alone."""
    agent = getattr(manager, "agent", None)
    if is_kvxfer(manager) or agent is None:
        yield
        return
    prepped, plain = agent.make_prepped_xfer, agent.initialize_xfer

    def counted_prepped(operation, local_side, local_indices, *rest, **kw):
        posted.append(len(local_indices))
        return prepped(operation, local_side, local_indices, *rest, **kw)

    def counted_plain(operation, local_descs, *rest, **kw):
        posted.append(int(local_descs.descCount()))
        return plain(operation, local_descs, *rest, **kw)

    agent.make_prepped_xfer, agent.initialize_xfer = counted_prepped, counted_plain
    try:
        yield
    finally:
        del agent.make_prepped_xfer, agent.initialize_xfer


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
        if op in OPS:
            return OPS[op](cmd, backend, manager, pool, kv_args)
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
                    "known_prefills": manager.kvxfer_puller.known_prefills if manager.kvxfer_puller else None,
                    "hellos": hello_pacing(manager), "sockets": endpoint_sockets(manager),
                    "fds": len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None}
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


def endpoint_sockets(manager) -> Optional[dict]:
    """kvxfer's sockets to peer endpoints (``kvxfer.integrations.sglang.sockets``): open, held, and what happened."""
    table = getattr(manager, "kvxfer_sockets", None)
    return None if table is None else {**table.sizes(), **table.counters}


def hello_pacing(manager) -> Optional[dict]:
    """A kvxfer prefill's HELLO pacing: HELLOs sent, REGs coalesced or dropped, endpoints and REGs waiting."""
    pacer = getattr(manager, "kvxfer_hellos", None)
    return None if pacer is None else {**pacer.counters, **pacer.sizes()}


#: The commands that act on one manager: ``op -> f(cmd, backend, manager, pool, kv_args)``; a caller's ``main``
#: may add its own (the tests' token-exact generation).
OPS: dict[str, Callable] = {"serve": serve, "receive": receive, "serve_queued": serve_queued,
                            "receive_queued": receive_queued}


def main(argv: Optional[list[str]] = None, extra_ops: Optional[dict[str, Callable]] = None) -> None:
    """The rank: ``argv[0]`` (default ``sys.argv[1]``) its configuration as JSON; ``extra_ops`` more commands."""
    CFG.update(json.loads((sys.argv[1:] if argv is None else argv)[0]))
    OPS.update(extra_ops or {})
    # replies go on a private copy of stdout; fd 1 itself (SGLang's prints, UCX's C-level logs) goes to stderr
    OUT[0] = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        backend, server, pool, kv_args, manager = setup()
        if CFG["role"] == "prefill":
            fill(pool, kv_args, CFG.get("seed", 1), int(CFG.get("attn_tp_rank", 0)), int(CFG.get("pp_rank", 0)),
                 CFG.get("aux_seed"))
        from sglang.version import __version__ as sglang_version

        reply({"ready": True, "pid": os.getpid(), "sglang": sglang_version, "layout": getattr(manager, "kvxfer_layout", None),
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
    OUT[0].flush()
    os._exit(0)  # SGLang's non-daemon threads (bootstrap server) would keep the process


if __name__ == "__main__":
    main()