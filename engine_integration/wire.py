"""Every control-plane message, and the one place they are encoded and decoded.

Messages are typed, frozen msgspec structs tagged by ``type`` and sent as JSON, so a
malformed or unknown message is rejected at the door with a clear error. To add
authentication later (an HMAC over each frame), change ``encode``/``decode`` only.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

RequestId = int


class Msg(msgspec.Struct, frozen=True, tag_field="type", forbid_unknown_fields=True):
    """Base of every message."""


# --- engine -> coordinator ---------------------------------------------------------------
class Register(Msg, frozen=True, tag="register"):
    role: str                      #: "prefill" or "decode"
    identity: str
    incarnation: str               #: new on every start: tells a restart from a duplicate
    pid: int
    host: str
    model_fingerprint: str
    transfer_meta: list[dict[str, Any]]  #: static, exported once (one entry per TP/PP rank)
    capacity_blocks: int


class Heartbeat(Msg, frozen=True, tag="heartbeat"):
    free_blocks: int
    pinned_blocks: int
    pins: int
    queued: int
    running: int
    quarantined_blocks: int = 0


class HandoffReady(Msg, frozen=True, tag="handoff"):
    """Prefill: the prompt is computed and pinned; here is its descriptor."""
    request_id: RequestId
    descriptor: dict[str, Any]
    prefill_s: float


class TransferReady(Msg, frozen=True, tag="transfer_ready"):
    """Decode: the request's KV is committed in our pool (``cached_prefix_blocks`` were reused)."""
    request_id: RequestId
    cached_prefix_blocks: int
    pulled_blocks: int
    pull_s: float = 0.0
    queue_s: float = 0.0
    admit_seq: int = 0


class ReadDone(Msg, frozen=True, tag="read_done"):
    """Decode: nothing of this request can still be read from the source; it may release."""
    request_id: RequestId


class Finished(Msg, frozen=True, tag="finished"):
    request_id: RequestId
    tokens: list[int]


class Failed(Msg, frozen=True, tag="failed"):
    request_id: RequestId
    reason: str


class Goodbye(Msg, frozen=True, tag="goodbye"):
    reason: str = ""


# --- coordinator -> engine ---------------------------------------------------------------
class Registered(Msg, frozen=True, tag="registered"):
    ok: bool
    reason: str = ""


class AddRequest(Msg, frozen=True, tag="add_request"):
    request_id: RequestId
    prompt: list[int]
    max_new_tokens: int


class PeerMeta(Msg, frozen=True, tag="peer_meta"):
    identity: str
    incarnation: str
    transfer_meta: list[dict[str, Any]]


class StartDecode(Msg, frozen=True, tag="start_decode"):
    request_id: RequestId
    descriptor: dict[str, Any]
    max_new_tokens: int


class Release(Msg, frozen=True, tag="release"):
    """To a prefill: no reader can still read these requests' blocks."""
    request_ids: list[RequestId]
    reason: str


class Abort(Msg, frozen=True, tag="abort"):
    request_id: RequestId
    reason: str


class Shutdown(Msg, frozen=True, tag="shutdown"):
    reason: str = ""


# --- client <-> coordinator --------------------------------------------------------------
class Submit(Msg, frozen=True, tag="submit"):
    client_request_id: int
    prompt: list[int]
    max_new_tokens: int


class Result(Msg, frozen=True, tag="result"):
    client_request_id: int
    tokens: Optional[list[int]] = None
    error: Optional[str] = None
    timings: dict[str, float] = {}
    cached_prefix_blocks: int = 0
    pulled_blocks: int = 0


class StatsRequest(Msg, frozen=True, tag="stats_request"):
    pass


class Stats(Msg, frozen=True, tag="stats"):
    engines: dict[str, dict[str, Any]]
    requests_in_flight: int
    dropped_frames: int = 0  #: control frames refused (unauthenticated or malformed)


AnyMsg = Union[Register, Heartbeat, HandoffReady, TransferReady, ReadDone, Finished, Failed, Goodbye,
               Registered, AddRequest, PeerMeta, StartDecode, Release, Abort, Shutdown,
               Submit, Result, StatsRequest, Stats]

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(AnyMsg)


class WireError(ValueError):
    """A frame that is not a valid message."""


class Codec:
    """Encodes and decodes frames; with a shared secret, every frame is HMAC-sealed (``kvxfer.security.auth``).

    The transfer metadata in ``Register``/``PeerMeta`` is the key to an instance's
    registered memory, so production deployments should set a secret.
    """

    def __init__(self, secret: Union[str, bytes, None] = None) -> None:
        self._auth = None
        self.dropped = 0  #: frames refused: unauthenticated, undecodable or invalid
        if secret is not None:
            from kvxfer.security.auth import MessageAuthenticator

            self._auth = MessageAuthenticator(secret)

    def encode(self, msg: Msg) -> bytes:
        payload = _ENCODER.encode(msg)
        return self._auth.seal(payload) if self._auth is not None else payload

    def decode(self, frame: bytes) -> Msg:
        """The message in ``frame``; raises ``WireError`` (or ``AuthenticationError``) otherwise.

        An unauthenticated frame is refused before its payload is parsed at all.
        """
        try:
            payload = self._auth.open(frame) if self._auth is not None else frame
            return _DECODER.decode(payload)
        except msgspec.ValidationError as exc:
            self.dropped += 1
            raise WireError(f"invalid control message: {exc}") from None
        except msgspec.DecodeError as exc:
            self.dropped += 1
            raise WireError(f"undecodable control message: {exc}") from None
        except Exception:
            self.dropped += 1
            raise
