"""Authenticated control-plane messages: HMAC-SHA256 with a shared secret.

The metadata a peer exports (agent metadata, packed rkeys) is the key to that
peer's registered memory, so it must only reach authenticated peers. Every
control message is framed as ``MAGIC | tag | payload``; a frame whose tag does
not verify is dropped and counted *before* its payload is parsed.

The secret comes from configuration or from a file named by ``KVXFER_SECRET_FILE``;
it is never logged (``repr`` of a ``MessageAuthenticator`` hides it).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from pathlib import Path
from typing import Optional, Union

from kvxfer.errors import AuthenticationError, KVXferError

MAGIC = b"KVX1"
TAG_BYTES = 32
SECRET_FILE_ENV = "KVXFER_SECRET_FILE"
MIN_SECRET_BYTES = 16


def load_secret(secret: Union[str, bytes, None] = None, *, secret_file: Optional[str] = None) -> bytes:
    """The shared secret: explicit value first, then ``secret_file``, then ``$KVXFER_SECRET_FILE``."""
    if secret is None:
        path = secret_file or os.environ.get(SECRET_FILE_ENV)
        if not path:
            raise KVXferError(
                f"no control-plane secret: pass one in the config or point {SECRET_FILE_ENV} at a file holding it"
            )
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise KVXferError(f"cannot read the control-plane secret file {path!r}: {exc.strerror}") from None
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET_BYTES:
        raise KVXferError(f"the control-plane secret must be at least {MIN_SECRET_BYTES} bytes")
    return raw


class MessageAuthenticator:
    """Seals outgoing frames and opens incoming ones; counts what it drops."""

    def __init__(self, secret: Union[str, bytes]) -> None:
        self._key = load_secret(secret)
        self._lock = threading.Lock()
        self.dropped = 0

    def __repr__(self) -> str:
        return f"MessageAuthenticator(secret=<hidden>, dropped={self.dropped})"

    def _tag(self, payload: bytes) -> bytes:
        return hmac.new(self._key, MAGIC + payload, hashlib.sha256).digest()

    def seal(self, payload: bytes) -> bytes:
        return MAGIC + self._tag(payload) + payload

    def open(self, frame: bytes) -> bytes:
        """The payload of an authentic frame; otherwise count it and raise ``AuthenticationError``."""
        header = len(MAGIC) + TAG_BYTES
        if (
            not isinstance(frame, (bytes, bytearray, memoryview))
            or len(frame) < header
            or bytes(frame[: len(MAGIC)]) != MAGIC
            or not hmac.compare_digest(bytes(frame[len(MAGIC):header]), self._tag(bytes(frame[header:])))
        ):
            with self._lock:
                self.dropped += 1
            raise AuthenticationError("control message failed authentication and was dropped")
        return bytes(frame[header:])
