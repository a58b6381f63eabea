"""What a prefill instance publishes per request: references, never bulk data.

The transport's address metadata (buffer pointers, keys, agent blobs) is exported once
when an instance registers; a descriptor names its source instance and the index of the
registered meta to use (one per TP/PP rank), so per-request traffic is block ids,
hashes and a few tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

RequestId = int | str


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

    def __post_init__(self) -> None:
        if len(self.block_hashes) > len(self.block_ids):
            raise ValueError(f"{len(self.block_hashes)} hashes for {len(self.block_ids)} blocks")
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
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "HandoffDescriptor":
        return cls(
            request_id=d["request_id"], source=str(d["source"]), meta_index=int(d["meta_index"]),
            block_ids=tuple(int(b) for b in d["block_ids"]), block_hashes=tuple(int(h) for h in d["block_hashes"]),
            prompt=tuple(int(t) for t in d["prompt"]), resume_tokens=tuple(int(t) for t in d["resume_tokens"]),
        )
