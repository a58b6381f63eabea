"""Shared helpers for the engine tests: prompts and an in-process prefill/decode pair."""

from __future__ import annotations

from typing import Any, Sequence

from engine_integration.handoff_engine import StateHandoffDynamicInferenceEngine
from engine_integration.reference import ModelConfig, build_reference_engine
from kvxfer.handoff.poll import KVPoll

MODEL = ModelConfig()


def varied_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of lengths 1..21: full and partial last blocks (T=4), a few sharing prefixes."""
    out = []
    for i in range(n):
        length = 1 + (i * 5 + seed) % 21
        out.append([(i * 31 + j * 17 + seed) % 256 for j in range(length)])
    if n >= 4:
        out[3] = out[2][:8] + [7, 7, 7, 7, 7]  # shares two full blocks with prompt 2
    return out


def make_pair(decode_blocks: int = 256, prefill_blocks: int = 512, backend: str = "local", verify_reads: bool = True):
    """A prefill and a decode engine in this process, driven by ``drive_pair`` (no coordinator)."""
    prefill = build_reference_engine(MODEL, prefill_blocks, engine_cls=StateHandoffDynamicInferenceEngine)
    decode = build_reference_engine(MODEL, decode_blocks, engine_cls=StateHandoffDynamicInferenceEngine)
    prefill.setup_kv_transfer("prefill", backend, identity="p0", verify_reads=verify_reads)
    decode.setup_kv_transfer("decode", backend, identity="d0", verify_reads=verify_reads)
    decode.add_peer_transfer_meta("p0", prefill.transfer_meta)
    return prefill, decode


def drive_pair(prefill: Any, decode: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               max_steps: int = 10_000, first_id: int = 0) -> tuple[dict, list]:
    """The control plane in miniature: descriptors to decode, read-done back to prefill."""
    for i, p in enumerate(prompts):
        prefill.add_request(first_id + i, p, max_new_tokens)
    results: dict = {}
    events: list = []
    for _ in range(max_steps):
        prefill.step()
        for descriptor in prefill.handoff_outbox:
            decode.add_handoff(descriptor, max_new_tokens)
        prefill.handoff_outbox.clear()
        for record in decode.step():
            results[record["request_id"]] = record
        for event in decode.handoff_events:
            events.append(event)
            if event.source_safe:
                prefill.release_handoff(event.request_id)
        decode.handoff_events.clear()
        if len(results) == len(prompts) and not prefill.has_unfinished_requests():
            return results, events
    raise AssertionError(f"not finished after {max_steps} steps: {len(results)}/{len(prompts)}")


def successes(events: list) -> list:
    return [e for e in events if e.state is KVPoll.Success]


# --- the etcd control plane (issue 16) ---------------------------------------------------------
#: a private, secured etcd started by the cluster (demo mode); short lease and poll for tests
ETCD_PLANE = "etcd:///engine?ttl=2&poll=0.1"
ETCD_TTL_S, ETCD_POLL_S = 2, 0.1


def build_engine_here(cluster: Any, spec: Any) -> Any:
    """``worker.build_engine`` in this process, on whichever plane ``cluster`` runs (its caller disconnects).

    ``build_engine`` makes a cluster key file this process's ``$KVXFER_SECRET_FILE``; it is
    put back afterwards, so later clusters of this test process are not affected.
    """
    import os

    from engine_integration.worker import build_engine
    from kvxfer.security.auth import SECRET_FILE_ENV

    before = os.environ.get(SECRET_FILE_ENV)
    try:
        return build_engine(spec, cluster.address)
    finally:
        if before is None:
            os.environ.pop(SECRET_FILE_ENV, None)
        else:
            os.environ[SECRET_FILE_ENV] = before


def short_prompts(n: int) -> list[list[int]]:
    """``n`` prompts of 1-3 tokens (the soaks': many handoffs, little compute)."""
    return [[(i * 7 + j * 13) % 256 for j in range(1 + i % 3)] for i in range(n)]


def engine_idle(figures: dict, decode_blocks: int = 0) -> bool:
    """An engine's published figures say it holds nothing: alive, nothing pinned, queued, running, reading,
    published, awaiting a death or quarantined; a decode (``decode_blocks``) has every block free."""
    quiet = all(figures.get(k) == 0 for k in ("pins", "pinned_blocks", "queued", "running", "quarantined_blocks",
                                                "reads", "published", "awaiting_death"))
    return bool(figures.get("alive")) and quiet and (not decode_blocks or figures.get("free_blocks") == decode_blocks)
