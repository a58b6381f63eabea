"""What a prefill instance publishes per request: references, never bulk data.

The transport's address metadata (buffer pointers, keys, agent blobs) is exported once
when an instance registers; a descriptor names its source instance and the index of the
registered meta to use (one per TP/PP rank), so per-request traffic is block ids,
hashes and a few tokens.

``generations`` are the source's per-block generation counters as they were when the
blocks were pinned (``kvxfer.handoff.generations``); the reader re-reads the counters after the
data and refuses the bytes if any moved. Empty when the source does not track them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

RequestId = int | str

#: Key, in one rank's static transfer meta, of the generation counters' own transport meta.
GENERATIONS_META_KEY = "generations"


def rank_transfer_meta(kv_meta: Mapping[str, Any], generations_meta: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """One rank's static transfer meta: the KV pool's meta, with its counters' meta beside it.

    The KV fields stay at the top level, so the coordinator's geometry check reads them
    as before and never compares the counters' registration (an int64 vector, not KV).
    Both metas keep their exporter's seal: ``split_transfer_meta`` gives them back intact.
    """
    entry = dict(kv_meta)
    if GENERATIONS_META_KEY in entry:
        raise ValueError(f"a KV transfer meta must not have a field {GENERATIONS_META_KEY!r}")
    if generations_meta is not None:
        entry[GENERATIONS_META_KEY] = dict(generations_meta)
    return entry


def split_transfer_meta(entry: Mapping[str, Any]) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """(the KV meta exactly as exported, the counters' meta or ``None`` if the source has none)."""
    kv = dict(entry)
    generations = kv.pop(GENERATIONS_META_KEY, None)
    return kv, generations


@dataclass(frozen=True)
class HandoffDescriptor:
    """Everything a decode instance needs to pull one request's KV and resume it."""

    request_id: RequestId
    source: str                     #: identity of the prefill instance holding the blocks
    meta_index: int                 #: which of the source's registered transfer metas to read through
    block_ids: tuple[int, ...]      #: the prompt's blocks in the source pool, in order (last may be partial)
    block_hashes: tuple[int, ...]   #: chained hashes of the *full* prompt blocks (prefix reuse)
    prompt: tuple[int, ...]         #: the prompt tokens (the decode keeps them with the request)
    resume_tokens: tuple[int, ...]  #: tokens already sampled on prefill; decoding continues after them
    generations: tuple[int, ...] = ()  #: per block of ``block_ids``, its counter when pinned (or empty)

    def __post_init__(self) -> None:
        if len(self.block_hashes) > len(self.block_ids):
            raise ValueError(f"{len(self.block_hashes)} hashes for {len(self.block_ids)} blocks")
        if self.generations and len(self.generations) != len(self.block_ids):
            raise ValueError(f"{len(self.generations)} generations for {len(self.block_ids)} blocks")
        if not self.prompt or not self.resume_tokens:
            raise ValueError("a handoff needs a non-empty prompt and at least one resume token")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "source": self.source, "meta_index": self.meta_index,
            "block_ids": list(self.block_ids), "block_hashes": list(self.block_hashes),
            "prompt": list(self.prompt), "resume_tokens": list(self.resume_tokens),
            "generations": list(self.generations),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "HandoffDescriptor":
        return cls(
            request_id=d["request_id"], source=str(d["source"]), meta_index=int(d["meta_index"]),
            block_ids=tuple(int(b) for b in d["block_ids"]), block_hashes=tuple(int(h) for h in d["block_hashes"]),
            prompt=tuple(int(t) for t in d["prompt"]), resume_tokens=tuple(int(t) for t in d["resume_tokens"]),
            generations=tuple(int(g) for g in d.get("generations", ())),
        )
