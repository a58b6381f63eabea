"""Unwrap the per-request meta Megatron's engine hands a backend into (source meta, block ids) records.

Megatron's prefill side does not pass a peer's ``export_meta()`` along unchanged. Per
request it sends one of three shapes (``docs/megatron.md`` has the facts and the
commit they were read at):

* **flat**: the rank's meta itself, plus request fields (``resume_tokens``, ``ssm``,
  sometimes ``block_ids``);
* **TP**: ``{"tp_metas": [meta_rank0, meta_rank1, ...], ...}``, or the bare list;
* **PP**: ``{"pp_metas": [{"tp_metas": [...] or meta, "block_ids": [...]}, ...]}``,
  each pipeline stage with its own source block ids.

A record's block ids are, in order of precedence, its own ``block_ids``, its stage's
``block_ids`` (PP), or the call's ``src_block_ids``. A cached prefix on the decode side
is removed from all of them at once by ``drop_transfer_prefix_blocks``.

Pure functions over plain data: no transport, no I/O. Sizes are bounded so that a
hostile wrapper cannot make the decode side allocate or loop without limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from kvxfer.errors import PeerMetadataError
from kvxfer.plan.descriptors import IdList
from kvxfer.plan.geometry import PeerGeometry
from kvxfer.plan.pool import LocalPool
from kvxfer.plan.request import RequestPlan, SourceRecord, plan_request

#: More source records than any real TP x PP product; a wrapper beyond it is refused.
MAX_PEER_RECORDS = 4096

PeerRecord = tuple[Mapping[str, Any], Sequence[int]]


def _list_of_metas(value: Any, where: str) -> list[Mapping[str, Any]]:
    metas = [value] if isinstance(value, Mapping) else value
    if not isinstance(metas, (list, tuple)):
        raise PeerMetadataError(f"peer meta field {where!r} must be a list of metas or one meta, got {type(value).__name__}")
    for i, meta in enumerate(metas):
        if not isinstance(meta, Mapping):
            raise PeerMetadataError(f"peer meta field {where}[{i}] must be a dict, got {type(meta).__name__}")
    return list(metas)


def _block_ids(owner: Mapping[str, Any], default: Sequence[int], where: str) -> Sequence[int]:
    ids = owner.get("block_ids", default)
    if not isinstance(ids, (list, tuple)) and not hasattr(ids, "__array__"):
        raise PeerMetadataError(f"peer meta field {where}.block_ids must be a list of ints, got {type(ids).__name__}")
    return ids


def is_whole_request(peer_meta: Any) -> bool:
    """True for a wrapped meta (TP/PP records, or a list): it names every source of the request."""
    return not isinstance(peer_meta, Mapping) or "tp_metas" in peer_meta or "pp_metas" in peer_meta


def transfer_peer_records(peer_meta: Any, src_block_ids: Sequence[int]) -> list[PeerRecord]:
    """Every ``(source meta, source block ids)`` a per-request meta names, in order.

    Raises ``PeerMetadataError`` for a shape that is none of the three, a record that
    is not a dict, or more than ``MAX_PEER_RECORDS`` records.
    """
    if not isinstance(peer_meta, (Mapping, list, tuple)):
        raise PeerMetadataError(f"peer meta must be a dict or a list of dicts, got {type(peer_meta).__name__}")
    stages: list[tuple[list[Mapping[str, Any]], Sequence[int], str]]
    if not isinstance(peer_meta, Mapping):  # a bare list of TP metas (Megatron's SSM metas at TP > 1)
        if len(peer_meta) > MAX_PEER_RECORDS:
            raise PeerMetadataError(f"peer meta lists {len(peer_meta)} metas; at most {MAX_PEER_RECORDS} are accepted")
        stages = [(_list_of_metas(peer_meta, "metas"), src_block_ids, "metas")]
    elif "pp_metas" in peer_meta:
        pp = peer_meta["pp_metas"]
        if not isinstance(pp, (list, tuple)):
            raise PeerMetadataError(f"peer meta field 'pp_metas' must be a list, got {type(pp).__name__}")
        if len(pp) > MAX_PEER_RECORDS:
            raise PeerMetadataError(f"peer meta has {len(pp)} pipeline stages; at most {MAX_PEER_RECORDS} are accepted")
        stages = []
        for i, stage in enumerate(pp):
            if not isinstance(stage, Mapping):
                raise PeerMetadataError(f"peer meta field pp_metas[{i}] must be a dict, got {type(stage).__name__}")
            metas = _list_of_metas(stage.get("tp_metas", stage), f"pp_metas[{i}].tp_metas")
            stages.append((metas, _block_ids(stage, [], f"pp_metas[{i}]"), f"pp_metas[{i}]"))
    elif "tp_metas" in peer_meta:
        stages = [(_list_of_metas(peer_meta["tp_metas"], "tp_metas"), src_block_ids, "tp_metas")]
    else:
        stages = [([peer_meta], src_block_ids, "meta")]
    records: list[PeerRecord] = []
    for metas, default, where in stages:
        for j, meta in enumerate(metas):
            records.append((meta, _block_ids(meta, default, f"{where}[{j}]")))
            if len(records) > MAX_PEER_RECORDS:
                raise PeerMetadataError(f"peer meta names more than {MAX_PEER_RECORDS} source records")
    return records


def _trim(value: Any, prefix: int) -> Any:
    """``value`` with ``prefix`` ids dropped from its ``block_ids`` and those of its TP/PP records."""
    if isinstance(value, (list, tuple)):
        return [_trim(item, prefix) for item in value]
    if not isinstance(value, Mapping):
        return value
    out = dict(value)
    if "block_ids" in out:
        ids = list(out["block_ids"])
        if prefix > len(ids):
            raise PeerMetadataError(f"cannot drop a cached prefix of {prefix} blocks from a record of {len(ids)} blocks")
        out["block_ids"] = ids[prefix:]
    for key in ("pp_metas", "tp_metas"):
        if key in out:
            out[key] = _trim(out[key], prefix)
    return out


def drop_transfer_prefix_blocks(peer_meta: Mapping[str, Any], src_block_ids: Sequence[int],
                                prefix: int) -> tuple[Any, list[int]]:
    """Remove the first ``prefix`` blocks (already cached on decode) from a request's sources.

    Trims ``src_block_ids`` and every ``block_ids`` of the meta, its ``tp_metas`` and its
    ``pp_metas`` (not those under other keys, such as the SSM slots). The seal is
    unaffected: ``block_ids`` is never sealed.
    """
    if not isinstance(prefix, int) or isinstance(prefix, bool) or prefix < 0:
        raise ValueError(f"prefix must be a non-negative int, got {prefix!r}")
    return _trim(peer_meta, prefix), list(src_block_ids)[prefix:]


@dataclass(frozen=True)
class PreparedPeer:
    """One source's ``export_meta()``, verified and parsed once (``KVTransportBackend.prepare_peer``).

    A caller that reads from the same source request after request (the vLLM connector: the metas
    of a handshake) passes this instead of the meta, and its requests skip the seal check, the
    parse and the look-up of what was verified: the handshake's work is not redone per request.
    ``meta`` is the preparing backend's own copy (a later change to the caller's dict is not seen).
    """

    backend: str  #: the backend type that verified it (a pull through another type is refused)
    meta: Mapping[str, Any]
    peer: PeerGeometry


def parse_request(peer_meta: Any, src_block_ids: Sequence[int],
                  parse: Callable[[Mapping[str, Any]], PeerGeometry]) -> tuple[list[SourceRecord], bool]:
    """Every source record the engine's meta names, each parsed once by ``parse`` (the backend's
    ``parse_peer_meta``: seal or signature, geometry, transport fields), and whether the meta is a
    wrapper naming the whole request (``is_whole_request``). A ``PreparedPeer`` is one source, parsed."""
    if isinstance(peer_meta, PreparedPeer):
        return [SourceRecord(peer_meta.meta, peer_meta.peer, src_block_ids)], False
    return ([SourceRecord(meta, parse(meta), ids) for meta, ids in transfer_peer_records(peer_meta, src_block_ids)],
            is_whole_request(peer_meta))


def plan_from_meta(peer_meta: Any, src_block_ids: IdList, dst_block_ids: IdList, local: LocalPool,
                   parse: Callable[[Mapping[str, Any]], PeerGeometry], *, staging_chunk_bytes: int = 0) -> RequestPlan:
    """``parse_request`` then ``kvxfer.plan.request.plan_request``: the one call a backend plans a request by."""
    sources, whole = parse_request(peer_meta, src_block_ids, parse)
    return plan_request(sources, dst_block_ids, local, whole=whole, staging_chunk_bytes=staging_chunk_bytes)
