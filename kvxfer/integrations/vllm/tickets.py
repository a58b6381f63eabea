"""The handoff ticket: the ``kv_transfer_params`` a producer returns, signed, and their check.

A prefill request's output carries ``kv_transfer_params`` that a proxy passes, unchanged,
to the decode request (vLLM's P/D flow). The fields NixlConnector uses are all here with
the same names and meaning (``do_remote_prefill``, ``remote_block_ids`` as one list per KV
cache group, ``remote_engine_id``, ``remote_request_id``, ``remote_host``/``remote_port``,
``tp_size``, ``remote_num_tokens``, ...), so a router written for NixlConnector works
unchanged. kvxfer adds one field, ``kvxfer``: the lease of the pinned blocks, a digest of
the prompt tokens the blocks hold, the producer instance, and an HMAC over everything the
decode acts on.

Why signed: the decode reads whatever blocks these params name, and params can come from
anywhere a client can reach (vLLM's API accepts ``kv_transfer_params`` in a request). A
forged or altered ticket (other blocks: another user's KV; another host) must be refused
before any byte moves. The key is derived from the cluster secret (``KVXFER_SECRET_FILE``)
when there is one; otherwise it is the producer instance's random key, which its side
channel hands only to peers on its own host (the same rule kvxfer applies to metas).

The prompt digest binds the blocks to the tokens: a proxy that pairs the ticket of one
prompt with another request is refused, not answered from the wrong KV.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping  # typing's Mapping is several times slower in isinstance
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import msgspec

from kvxfer.errors import PeerMetadataError
from kvxfer.plan.descriptors import int_id_list
from kvxfer.integrations.vllm.specs import MAMBA, TransferGroup

TICKET_FIELD = "kvxfer"
TICKET_VERSION = 1
#: The NixlConnector fields the decode acts on: covered by the signature.
SIGNED_PARAMS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                 "tp_size", "remote_num_tokens")
MAX_BLOCKS = 1 << 20
_MAX_ID = 1 << 40
_MAX_STR = 512


def derive_ticket_key(secret: bytes) -> bytes:
    """The ticket key under a cluster secret (distinct from the frame and meta keys)."""
    return hmac.new(secret, b"kvxfer/vllm-handoff-ticket", hashlib.sha256).digest()


def prompt_digest(token_ids: Sequence[int], num_tokens: int) -> str:
    """SHA-256 over the first ``num_tokens`` prompt token ids (as little-endian int64)."""
    body = b"".join(int(t).to_bytes(8, "little", signed=True) for t in list(token_ids)[:num_tokens])
    return hashlib.sha256(num_tokens.to_bytes(8, "little") + body).hexdigest()


_SORTED_JSON = msgspec.json.Encoder(order="sorted")


def _canonical(params: Mapping[str, Any], ticket: Mapping[str, Any]) -> bytes:
    """The signed bytes: the acted-on fields as compact JSON with sorted keys. msgspec writes it in
    ~1 us where ``json`` takes ~8 (it runs on the decode engine's step). Its bytes are
    ``json.dumps``'s for what every producer writes (the params ``parse_ticket`` checked, ticket
    values that are exact strs and ints, printable ASCII), so kvxfer versions on either side of this
    change still agree; anything else (floats, None, nested values, non-ASCII, DEL) goes through
    ``json`` as before. ``ValueError`` (NaN with allow_nan off) and ``RecursionError`` pass to the caller."""
    body = {name: params.get(name) for name in SIGNED_PARAMS}
    body[TICKET_FIELD] = fields = {k: v for k, v in ticket.items() if k != "sig"}
    if all(type(v) is str or type(v) is int for v in fields.values()):
        try:
            data = _SORTED_JSON.encode(body)
            if data.isascii() and b"\x7f" not in data:
                return data
        except (TypeError, UnicodeEncodeError):  # keys that are not strings, a lone surrogate: json as before
            pass
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign_ticket(params: dict[str, Any], ticket: dict[str, Any], key: bytes) -> dict[str, Any]:
    """Add the signed ``kvxfer`` field to ``params`` (which already hold the NixlConnector fields)."""
    ticket = dict(ticket, v=TICKET_VERSION)
    ticket["sig"] = hmac.new(key, _canonical(params, ticket), hashlib.sha256).hexdigest()
    params[TICKET_FIELD] = ticket
    return params


@dataclass(frozen=True)
class Ticket:
    """A decode request's handoff, every field checked (the signature is checked separately)."""

    engine_id: str
    request_id: str
    host: str
    port: int
    tp_size: int
    block_ids: tuple[int, ...]
    num_tokens: int
    instance: str
    slot: int
    lease: int
    prompt_sha256: str
    backend: str
    raw: Mapping[str, Any]
    #: a hybrid model's ids per transfer group (``block_ids`` is then the first group's); else empty
    groups: tuple[tuple[int, ...], ...] = ()
    #: the producer's block size (``kvxfer.block_size``), None from a producer that does not say it: the
    #: decode's own is assumed (a different one is refused at the handshake, ``block_sizes``)
    block_size: Optional[int] = None

    def verify(self, key: bytes) -> None:
        """``PeerMetadataError`` unless the ticket was signed with ``key`` and is unchanged."""
        ticket = self.raw[TICKET_FIELD]
        try:
            signed = _canonical(self.raw, ticket)
        except (ValueError, TypeError, RecursionError) as exc:  # NaN, unsortable keys, nesting: never a producer's
            raise PeerMetadataError(f"kv_transfer_params of remote request {self.request_id!r} hold values no "
                                    f"producer signs ({type(exc).__name__}); refused before any byte moved") from None
        expected = hmac.digest(key, signed, "sha256").hex()  # one-shot, in C
        if not hmac.compare_digest(str(ticket.get("sig")), expected):
            raise PeerMetadataError(
                f"kv_transfer_params of remote request {self.request_id!r} are not signed by prefill engine "
                f"{self.engine_id!r} (forged or altered, or the two instances use different KVXFER_SECRET_FILE "
                "secrets); refused before any byte moved"
            )

    def check_prompt(self, token_ids: Sequence[int]) -> None:
        if len(token_ids) < self.num_tokens or prompt_digest(token_ids, self.num_tokens) != self.prompt_sha256:
            raise PeerMetadataError(
                f"kv_transfer_params of remote request {self.request_id!r} describe the KV of another prompt "
                f"(its first {self.num_tokens} tokens differ from this request's): pass each prefill's params "
                "to the decode request with the same prompt"
            )


def _str(params: Mapping[str, Any], name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_STR:
        raise PeerMetadataError(f"kv_transfer_params field {name!r} must be a non-empty string, got {value!r:.80}")
    return value


def _int(params: Mapping[str, Any], name: str, low: int, high: int) -> int:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PeerMetadataError(f"kv_transfer_params field {name!r} must be an int in [{low}, {high}], got {value!r:.80}")
    return value


def block_ids_of(value: Any, max_count: int = MAX_BLOCKS) -> tuple[int, ...]:
    """``remote_block_ids`` as NixlConnector 0.32 writes it (one list per KV cache group) or flat.

    The length is checked against ``max_count`` before any id is looked at: a forged list of
    a million ids costs a ``len``, not a walk on the engine's thread."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(g, (list, tuple)) for g in value):
        if len(value) != 1:
            raise PeerMetadataError(
                f"kv_transfer_params 'remote_block_ids' has {len(value)} KV cache groups; KvxferConnector moves "
                "models with one group (full attention)"
            )
        value = value[0]
    if not isinstance(value, (list, tuple)) or len(value) > MAX_BLOCKS:
        raise PeerMetadataError("kv_transfer_params 'remote_block_ids' must be a list of block ids")
    if len(value) > max_count:
        raise PeerMetadataError(f"kv_transfer_params 'remote_block_ids' lists {len(value)} blocks, more than the "
                                f"{max_count} that 'remote_num_tokens' can fill")
    if not value or (int_id_list(value, MAX_BLOCKS) and min(value) >= 0 and max(value) < _MAX_ID):
        return tuple(value)  # every id an int in range, checked in C (the common case, on the engine's step)
    for b in value:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < _MAX_ID:
            raise PeerMetadataError(f"kv_transfer_params 'remote_block_ids' holds {b!r:.40}, not a block id")
    return tuple(value)


def group_block_ids_of(value: Any, groups: Sequence[TransferGroup], num_tokens: int) -> tuple[tuple[int, ...], ...]:
    """A hybrid model's ``remote_block_ids``: one list per transfer group of this decode, each bounded
    before its ids are read: an attention group by the blocks ``num_tokens`` fill in its block size
    (+1), a Mamba group exactly its one running-state slot."""
    if not isinstance(value, (list, tuple)) or len(value) != len(groups) \
            or not all(isinstance(ids, (list, tuple)) for ids in value):
        count = len(value) if isinstance(value, (list, tuple)) else "no"
        raise PeerMetadataError(
            f"kv_transfer_params 'remote_block_ids' has {count} KV cache groups; this decode's model has "
            f"{len(groups)} ({', '.join(g.kind for g in groups)}): run the same model on both sides"
        )
    out = []
    for index, (ids, group) in enumerate(zip(value, groups)):
        if group.kind == MAMBA:
            if len(ids) != 1:
                raise PeerMetadataError(
                    f"kv_transfer_params 'remote_block_ids' group {index} (Mamba state) lists {len(ids)} blocks; a "
                    "Mamba group hands over exactly one, its running-state slot"
                )
            out.append(block_ids_of(list(ids), 1))
        else:
            out.append(block_ids_of(list(ids), min(-(-num_tokens // group.block_size) + 1, MAX_BLOCKS)))
    return tuple(out)


def parse_ticket(params: Any, *, block_size: Optional[int] = None, max_tokens: Optional[int] = None,
                 groups: Optional[Sequence[TransferGroup]] = None) -> Ticket:
    """Schema-check a decode request's ``kv_transfer_params``; ``PeerMetadataError`` names the field.

    ``remote_num_tokens`` is bounded by ``max_tokens`` (the decode's prompt, when known) and
    the block-id list by the blocks those tokens fill (the ticket's own ``kvxfer.block_size``, the
    producer's, else ``block_size``; plus the one the producer may have allocated for the token it
    sampled), checked before the ids are read.
    ``groups``: a hybrid model's transfer groups (``group_block_ids_of``); with a Mamba group the
    ticket must hold fewer tokens than the prompt, since vLLM recomputes the last loaded prompt token
    and a state that already holds it would advance twice."""
    if not isinstance(params, Mapping):
        raise PeerMetadataError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
    ticket = params.get(TICKET_FIELD)
    if not isinstance(ticket, Mapping):
        raise PeerMetadataError(
            "kv_transfer_params have no 'kvxfer' field: they were not made by a KvxferConnector producer "
            "(both instances must run KvxferConnector)"
        )
    if ticket.get("v") != TICKET_VERSION:
        raise PeerMetadataError(f"kv_transfer_params 'kvxfer.v' is {ticket.get('v')!r}; this kvxfer speaks "
                                f"{TICKET_VERSION} (run the same kvxfer on both sides)")
    digest = ticket.get("prompt")
    if not isinstance(digest, str) or len(digest) != 64:
        raise PeerMetadataError("kv_transfer_params 'kvxfer.prompt' must be a SHA-256 hex digest")
    num_tokens = _int(params, "remote_num_tokens", 1, max_tokens if max_tokens else 1 << 40)
    if groups and any(g.kind == MAMBA for g in groups) and max_tokens and num_tokens >= max_tokens:
        raise PeerMetadataError(
            f"kv_transfer_params 'remote_num_tokens' is {num_tokens} for a prompt of {max_tokens} tokens; with Mamba "
            "state the prefill must stop one token short (KvxferConnector's producer does), since the decode "
            "recomputes the last prompt token: run KvxferConnector on the prefill"
        )
    theirs = ticket.get("block_size")
    if theirs is not None:  # the producer's blocks may be smaller than ours (``block_sizes``): bound by its own
        theirs = _int(ticket, "block_size", 1, 1 << 24)
        block_size = theirs
    max_blocks = -(-num_tokens // block_size) + 1 if block_size else num_tokens + 1
    per_group = group_block_ids_of(params.get("remote_block_ids"), groups, num_tokens) if groups else ()
    return Ticket(
        engine_id=_str(params, "remote_engine_id"),
        request_id=_str(params, "remote_request_id"),
        host=_str(params, "remote_host"),
        port=_int(params, "remote_port", 1, 65535),
        tp_size=_int(params, "tp_size", 1, 1 << 16),
        block_ids=per_group[0] if per_group else block_ids_of(params.get("remote_block_ids"), min(max_blocks, MAX_BLOCKS)),
        num_tokens=num_tokens,
        instance=_str(ticket, "instance"),
        slot=_int(ticket, "slot", 0, (1 << 24) - 1),
        lease=_int(ticket, "lease", 1, (1 << 62)),
        prompt_sha256=digest,
        backend=_str(ticket, "backend"),
        raw=params,
        groups=per_group,
        block_size=theirs,
    )


def ticket_key(cluster_secret: Optional[bytes], instance_key: Optional[bytes]) -> Optional[bytes]:
    """The key tickets are signed with: the cluster's when there is a secret, else the instance's."""
    return derive_ticket_key(cluster_secret) if cluster_secret is not None else instance_key
