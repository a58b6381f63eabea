"""Every control-plane message, its schema, and the one place payloads are encoded and decoded.

Messages are frozen msgspec structs tagged by ``type``. Every field carries its
constraints (ranges, lengths, non-empty prompts), and cross-field rules live in
``__post_init__``, which msgspec turns into a ``ValidationError`` while decoding. So a
receiver either gets a message its handlers can trust or a ``WireError`` it counts and
drops: an insider's malformed message (a descriptor without ``block_hashes``, a
``StartDecode`` with an empty prompt) is refused at the door, never a ``KeyError``
three calls later.

Authentication and replay protection are *not* here: payloads travel inside a
per-connection session (``channel``). This module only turns
structs into bytes and back.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

import msgspec

from engine_integration.control_plane.limits import TooDeep, check_json
from engine_integration.control_plane.policy import MAX_EVICTED_REPORT, MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, TOKEN_ID_LIMIT

#: Limits of the schema; generous for real traffic, small enough that no field can be a weapon.
#: The request limits are the fleet policy's (``control_plane.policy``), so admission refuses
#: at submit anything a relayed message would fail here.
MAX_TOKENS = max(MAX_PROMPT_TOKENS, MAX_NEW_TOKENS)
MAX_BLOCKS = 1 << 24
MAX_TEXT = 16384
MAX_METAS = 4096
MAX_BATCH = 65536
MAX_MESSAGE_BYTES = 16 << 20   #: the channel's frame cap (``channel.MAX_FRAME_BYTES``) bounds it first

Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
RequestId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Count = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Token = Annotated[int, msgspec.Meta(ge=0, lt=TOKEN_ID_LIMIT)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Prompt = Annotated[list[Token], msgspec.Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
NewTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS)]


class Msg(msgspec.Struct, frozen=True, tag_field="type", forbid_unknown_fields=True):
    """Base of every message."""


class Descriptor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A ``HandoffDescriptor`` on the wire (``engine_integration.descriptor``), checked field by field."""

    request_id: RequestId
    source: Name
    meta_index: Annotated[int, msgspec.Meta(ge=0, lt=MAX_METAS)]
    block_ids: Annotated[list[BlockId], msgspec.Meta(min_length=1, max_length=MAX_BLOCKS)]
    block_hashes: Annotated[list[Int64], msgspec.Meta(max_length=MAX_BLOCKS)]
    prompt: Prompt
    resume_tokens: Annotated[list[Token], msgspec.Meta(min_length=1, max_length=MAX_TOKENS)]
    generations: Annotated[list[Int64], msgspec.Meta(max_length=MAX_BLOCKS)] = []

    def __post_init__(self) -> None:
        if len(self.block_hashes) > len(self.block_ids):
            raise ValueError(f"{len(self.block_hashes)} block hashes for {len(self.block_ids)} blocks")
        if self.generations and len(self.generations) != len(self.block_ids):
            raise ValueError(f"{len(self.generations)} generations for {len(self.block_ids)} blocks")
        if len(self.block_ids) > len(self.prompt):
            raise ValueError(f"{len(self.block_ids)} blocks for a prompt of {len(self.prompt)} tokens")
        if len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError("block_ids repeat a block")


# --- engine -> coordinator ---------------------------------------------------------------
class Register(Msg, frozen=True, tag="register"):
    role: Literal["prefill", "decode"]
    identity: Name
    incarnation: Name              #: new on every start: tells a restart from a duplicate
    pid: Annotated[int, msgspec.Meta(ge=1, lt=1 << 32)]
    host: Name
    model_fingerprint: Name
    transfer_meta: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1, max_length=MAX_METAS)]
    capacity_blocks: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCKS)]  #: the pool: admission checks fit


class Heartbeat(Msg, frozen=True, tag="heartbeat"):
    free_blocks: Count
    pinned_blocks: Count
    pins: Count
    queued: Count
    running: Count
    quarantined_blocks: Count = 0
    evictions: Count = 0        #: cached blocks this pool evicted so far (prefix-aware routing)
    evicted: Annotated[list[Int64], msgspec.Meta(max_length=MAX_EVICTED_REPORT)] = []  #: the newest evicted hashes


class HandoffReady(Msg, frozen=True, tag="handoff"):
    """Prefill: the prompt is computed and pinned; here is its descriptor."""
    request_id: RequestId
    descriptor: Descriptor
    prefill_s: Seconds


class TransferReady(Msg, frozen=True, tag="transfer_ready"):
    """Decode: the request's KV is committed in our pool (``cached_prefix_blocks`` were reused)."""
    request_id: RequestId
    cached_prefix_blocks: Count
    pulled_blocks: Count
    pull_s: Seconds = 0.0
    queue_s: Seconds = 0.0
    admit_seq: Count = 0


class ReadDone(Msg, frozen=True, tag="read_done"):
    """Decode: nothing of this request can still be read from the source; it may release."""
    request_id: RequestId


class SendKV(Msg, frozen=True, tag="send_kv"):
    """Decode, push backends only: our receives for this request are posted; push to us.

    ``decode_meta`` is this decode's registered transfer meta (one sealed entry per rank; the
    coordinator refuses any other), ``skip_blocks`` the cached prefix it does not receive."""
    request_id: RequestId
    decode_meta: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1, max_length=MAX_METAS)]
    skip_blocks: Annotated[int, msgspec.Meta(ge=0, lt=MAX_BLOCKS)] = 0


class Finished(Msg, frozen=True, tag="finished"):
    request_id: RequestId
    tokens: Annotated[list[Token], msgspec.Meta(max_length=MAX_TOKENS)]


class Failed(Msg, frozen=True, tag="failed"):
    request_id: RequestId
    reason: Text


class Goodbye(Msg, frozen=True, tag="goodbye"):
    reason: Text = ""


# --- coordinator -> engine ---------------------------------------------------------------
class Registered(Msg, frozen=True, tag="registered"):
    ok: bool
    reason: Text = ""


class AddRequest(Msg, frozen=True, tag="add_request"):
    request_id: RequestId
    prompt: Prompt
    max_new_tokens: NewTokens


class PeerMeta(Msg, frozen=True, tag="peer_meta"):
    identity: Name
    incarnation: Name
    transfer_meta: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1, max_length=MAX_METAS)]


class StartDecode(Msg, frozen=True, tag="start_decode"):
    request_id: RequestId
    descriptor: Descriptor
    max_new_tokens: NewTokens

    def __post_init__(self) -> None:
        if not isinstance(self.descriptor, Descriptor):
            return  # built locally from a dict: checked when the receiver decodes it
        if self.descriptor.request_id != self.request_id:
            raise ValueError(f"descriptor of request {self.descriptor.request_id} sent as request {self.request_id}")
        if self.max_new_tokens < len(self.descriptor.resume_tokens):
            raise ValueError(f"max_new_tokens {self.max_new_tokens} < {len(self.descriptor.resume_tokens)} "
                             "resume tokens")


class PushKV(Msg, frozen=True, tag="push_kv"):
    """To a prefill, push backends only: push the request's blocks from ``skip_blocks`` on to this decode."""
    request_id: RequestId
    decode_identity: Name
    decode_meta: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1, max_length=MAX_METAS)]
    skip_blocks: Annotated[int, msgspec.Meta(ge=0, lt=MAX_BLOCKS)] = 0


class Release(Msg, frozen=True, tag="release"):
    """To a prefill: no reader can still read these requests' blocks."""
    request_ids: Annotated[list[RequestId], msgspec.Meta(max_length=MAX_BATCH)]
    reason: Text


class Abort(Msg, frozen=True, tag="abort"):
    request_id: RequestId
    reason: Text


class Shutdown(Msg, frozen=True, tag="shutdown"):
    reason: Text = ""


# --- client <-> coordinator --------------------------------------------------------------
class Submit(Msg, frozen=True, tag="submit"):
    """A prompt from a client. Its content is checked by admission, which answers with a reason."""
    client_request_id: RequestId
    prompt: Annotated[list[Int64], msgspec.Meta(max_length=MAX_TOKENS)]
    max_new_tokens: Int64


class Result(Msg, frozen=True, tag="result"):
    client_request_id: RequestId
    tokens: Optional[list[Token]] = None
    error: Optional[Text] = None
    timings: dict[str, float] = {}
    cached_prefix_blocks: Count = 0
    pulled_blocks: Count = 0
    decode: Optional[Name] = None   #: the decode that served it


class StatsRequest(Msg, frozen=True, tag="stats_request"):
    pass


class Stats(Msg, frozen=True, tag="stats"):
    engines: dict[str, dict[str, Any]]
    requests_in_flight: Count
    dropped_frames: Count = 0  #: control frames refused, all reasons together
    dropped: dict[str, int] = {}  #: reason -> frames refused ("forged", "replayed", "reflected", "invalid", ...)
    connections: Count = 0     #: authenticated control connections open now (what ``max_connections`` caps)
    tcp_connections: Count = 0  #: every TCP connection open now, handshakes in progress included
    stuck_requests: Count = 0  #: failed requests whose live decode never released them (pins kept: no counters)
    sessions: Count = 0        #: control sessions held (connected peers, and closed ones within their grace)


AnyMsg = Union[Register, Heartbeat, HandoffReady, TransferReady, ReadDone, SendKV, Finished, Failed, Goodbye,
               Registered, AddRequest, PeerMeta, StartDecode, PushKV, Release, Abort, Shutdown,
               Submit, Result, StatsRequest, Stats]

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(AnyMsg)


class WireError(ValueError):
    """A payload that is not a valid message; the text says which field and why."""


def encode(msg: Msg) -> bytes:
    return _ENCODER.encode(msg)


def decode(payload: bytes) -> Msg:
    """The message in ``payload``, every constraint checked; ``WireError`` otherwise.

    Its depth and size are bounded before msgspec sees it (``control_plane.limits``): the
    metas inside messages are free-form dicts, and a value nested thousands deep must cost
    one refused message, not the process.
    """
    try:
        return _DECODER.decode(check_json(payload, max_bytes=MAX_MESSAGE_BYTES, what="control message"))
    except TooDeep as exc:
        raise WireError(f"invalid control message: {exc}") from None
    except msgspec.ValidationError as exc:
        raise WireError(f"invalid control message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable control message: {exc}") from None
    except RecursionError:   # cannot pass the depth check; a peer must still never crash us
        raise WireError("invalid control message: nested too deep") from None


def descriptor_dict(descriptor: Descriptor) -> dict[str, Any]:
    """A wire descriptor as the plain dict ``HandoffDescriptor.from_dict`` reads."""
    return msgspec.structs.asdict(descriptor)
