"""The 64-byte header in front of every message, and the request fingerprint it carries.

Two-sided transports pair a send with a receive by post order alone: NCCL has no
tags, and Megatron's engine passes no request id to the backend. If the prefill
pushes requests in a different order than the decode posted their receives, two
requests of equal size would silently trade KV. So every message starts with a
header the receiver checks *before* scattering a byte into its pool: a magic, the
payload size the sender planned, both ranks, and a fingerprint of the source block
ids (the one thing both sides know per request: the prefill pins them, the decode
is told them in the meta). Blocks pinned at the same time are distinct, so two
in-flight requests never share a fingerprint. The version it carries is the wire's one version
(``kvxfer.meta.version``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from kvxfer.errors import TransferError
from kvxfer.meta.version import WIRE_VERSION

HEADER_BYTES = 64
MAGIC = 0x6B76786665724E43  # "kvxferNC"
_FIELDS = 8  # int64 fields: magic, version, payload, src_rank, dst_rank, fp_hi, fp_lo, num_blocks


@dataclass(frozen=True)
class MessageHeader:
    """What a receiver expects (or a sender announces) for one (request, peer pair) message."""

    payload_bytes: int
    src_rank: int
    dst_rank: int
    fingerprint: tuple[int, int]
    num_blocks: int

    @staticmethod
    def for_request(kind: str, src_rank: int, dst_rank: int, src_ids: np.ndarray, payload_bytes: int) -> "MessageHeader":
        """The header both sides compute independently for the same request and pair."""
        digest = hashlib.sha256()
        digest.update(f"kvxfer-nccl/{WIRE_VERSION}/{kind}/{src_rank}/{dst_rank}/{payload_bytes}/".encode())
        digest.update(np.ascontiguousarray(src_ids, dtype="<i8").tobytes())
        hi, lo = np.frombuffer(digest.digest()[:16], dtype="<i8").tolist()
        return MessageHeader(int(payload_bytes), int(src_rank), int(dst_rank), (int(hi), int(lo)), int(src_ids.size))

    def encode(self) -> torch.Tensor:
        """The header as 64 host bytes."""
        fields = np.array([MAGIC, WIRE_VERSION, self.payload_bytes, self.src_rank, self.dst_rank,
                           self.fingerprint[0], self.fingerprint[1], self.num_blocks], dtype="<i8")
        return torch.from_numpy(fields.view(np.uint8).copy())

    def check_received(self, raw: torch.Tensor) -> None:
        """Raise ``TransferError`` unless ``raw`` (64 host bytes) is the header this side expects."""
        fields = raw.numpy().view("<i8")[:_FIELDS].tolist()
        magic, version, payload, src, dst, hi, lo, blocks = fields
        if magic != MAGIC or version != WIRE_VERSION:
            raise TransferError(
                "received a message that is not a kvxfer nccl message of this version: another sender uses "
                "this process group's point-to-point channel with the same peers, or the pair is out of step "
                "after an earlier failure; give kvxfer its own process group"
            )
        if (src, dst) != (self.src_rank, self.dst_rank):
            raise TransferError(f"received a message from rank {src} to rank {dst}, expected {self.src_rank} -> {self.dst_rank}")
        if payload != self.payload_bytes:
            raise TransferError(
                f"rank {src} pushed {payload} bytes ({blocks} blocks) for this pair, this side expected "
                f"{self.payload_bytes} bytes ({self.num_blocks} blocks): the two sides disagree on the block count "
                "or the layouts; nothing was written"
            )
        if (hi, lo) != self.fingerprint:
            raise TransferError(
                f"rank {src} pushed a different request's blocks from the one this receive was posted for: "
                "the prefill pushed requests in a different order than the decode posted their receives. "
                "Both sides must post requests to a peer pair in the same order; nothing was written"
            )
