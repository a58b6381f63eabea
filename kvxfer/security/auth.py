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


# --- per-connection sessions ---------------------------------------------------------------
#
# The HMAC above proves a frame was made by a key holder, not that it is *new*: a frame
# captured on the wire verifies forever, from any connection, in either direction. A
# session fixes that. Each connection runs a two-message handshake (client ``hello``
# with a fresh nonce, server ``welcome`` with its own), both sealed with the cluster
# key and bound to the connection's routing id; the session key is derived from the
# key, that routing id and both nonces, so it exists on exactly one connection of one
# server instance. Every frame then carries a direction byte and a counter that only
# grows, both under the tag: a frame replayed from another connection fails its tag, a
# frame replayed or reordered within its connection fails the counter, and a frame
# reflected back to its sender fails the direction. Each refusal is counted by reason.

SESSION_MAGIC = b"KVX2"
HELLO_MAGIC = b"KVXH"
WELCOME_MAGIC = b"KVXW"
CLIENT_TO_SERVER = b"C"
SERVER_TO_CLIENT = b"S"
NONCE_BYTES = 16
COUNTER_BYTES = 8
SESSION_HEADER = len(SESSION_MAGIC) + 1 + COUNTER_BYTES + TAG_BYTES


class FrameDropped(AuthenticationError):
    """A control frame refused by a session; ``reason`` is the counter it went to."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"control frame dropped ({reason}){': ' + detail if detail else ''}")
        self.reason = reason


def derive_key(key: bytes, label: str, *parts: bytes) -> bytes:
    """A key for one purpose (``label``) bound to ``parts``; parts are length-prefixed so none can shift into another."""
    mac = hmac.new(key, b"kvxfer/" + label.encode(), hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


class SessionChannel:
    """One connection's session: seals what this end sends, opens what it receives.

    ``sends`` is this end's direction (``CLIENT_TO_SERVER`` or ``SERVER_TO_CLIENT``).
    Counters may skip (a peer's send queue may drop a frame) but never repeat or go back.
    """

    def __init__(self, key: bytes, *, sends: bytes) -> None:
        if sends not in (CLIENT_TO_SERVER, SERVER_TO_CLIENT):
            raise ValueError("sends must be CLIENT_TO_SERVER or SERVER_TO_CLIENT")
        self._key = key
        self._send_dir = sends
        self._recv_dir = SERVER_TO_CLIENT if sends == CLIENT_TO_SERVER else CLIENT_TO_SERVER
        self._sent = 0
        self._received = 0
        self._lock = threading.Lock()
        self.dropped: dict[str, int] = {}  #: reason -> frames refused ("forged", "replayed", "reflected")

    def __repr__(self) -> str:
        return f"SessionChannel(key=<hidden>, sent={self._sent}, received={self._received}, dropped={self.dropped})"

    def _tag(self, header: bytes, payload: bytes) -> bytes:
        return hmac.new(self._key, header + payload, hashlib.sha256).digest()

    def seal(self, payload: bytes) -> bytes:
        with self._lock:
            self._sent += 1
            header = SESSION_MAGIC + self._send_dir + self._sent.to_bytes(COUNTER_BYTES, "big")
        return header + self._tag(header, payload) + payload

    def _drop(self, reason: str) -> "FrameDropped":
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        return FrameDropped(reason)

    def open(self, frame: bytes) -> bytes:
        """The payload of a fresh authentic frame; otherwise count the reason and raise ``AuthenticationError``."""
        frame = bytes(frame)
        with self._lock:
            if len(frame) < SESSION_HEADER or not frame.startswith(SESSION_MAGIC):
                raise self._drop("forged")
            header, tag = frame[:SESSION_HEADER - TAG_BYTES], frame[SESSION_HEADER - TAG_BYTES:SESSION_HEADER]
            payload = frame[SESSION_HEADER:]
            if not hmac.compare_digest(tag, self._tag(header, payload)):
                raise self._drop("forged")
            if header[len(SESSION_MAGIC):len(SESSION_MAGIC) + 1] != self._recv_dir:
                raise self._drop("reflected")
            counter = int.from_bytes(header[len(SESSION_MAGIC) + 1:], "big")
            if counter <= self._received:
                raise self._drop("replayed")
            self._received = counter
        return payload


class SessionClient:
    """Client half of the handshake: ``hello()``, send it, then ``finish(welcome)``."""

    def __init__(self, secret: Union[str, bytes], peer_id: bytes) -> None:
        self._key = load_secret(secret)
        self._peer_id = bytes(peer_id)
        self._nonce = os.urandom(NONCE_BYTES)

    def __repr__(self) -> str:
        return "SessionClient(secret=<hidden>)"

    def hello(self) -> bytes:
        tag = hmac.new(derive_key(self._key, "hello"), self._peer_id + self._nonce, hashlib.sha256).digest()
        return HELLO_MAGIC + self._nonce + tag

    def finish(self, welcome: bytes) -> SessionChannel:
        """The session, if ``welcome`` answers *this* hello from a key holder; else ``AuthenticationError``."""
        welcome = bytes(welcome)
        n = len(WELCOME_MAGIC)
        if len(welcome) != n + 2 * NONCE_BYTES + TAG_BYTES or not welcome.startswith(WELCOME_MAGIC):
            raise AuthenticationError("the coordinator's handshake answer is malformed")
        server_nonce, instance = welcome[n:n + NONCE_BYTES], welcome[n + NONCE_BYTES:n + 2 * NONCE_BYTES]
        expected = _welcome_tag(self._key, self._peer_id, self._nonce, server_nonce, instance)
        if not hmac.compare_digest(welcome[n + 2 * NONCE_BYTES:], expected):
            raise AuthenticationError("the coordinator's handshake answer failed authentication "
                                      "(a different cluster secret, or not our coordinator)")
        key = derive_key(self._key, "session", self._peer_id, self._nonce, server_nonce, instance)
        return SessionChannel(key, sends=CLIENT_TO_SERVER)


def _welcome_tag(key: bytes, peer_id: bytes, client_nonce: bytes, server_nonce: bytes, instance: bytes) -> bytes:
    return hmac.new(derive_key(key, "welcome"), peer_id + client_nonce + server_nonce + instance,
                    hashlib.sha256).digest()


class SessionServer:
    """Server half: answers authentic hellos with a welcome and a new session for that peer."""

    def __init__(self, secret: Union[str, bytes]) -> None:
        self._key = load_secret(secret)
        self._instance = os.urandom(NONCE_BYTES)  # a restarted server never re-creates an old session
        self.dropped: dict[str, int] = {}

    def __repr__(self) -> str:
        return "SessionServer(secret=<hidden>)"

    @staticmethod
    def is_hello(frame: bytes) -> bool:
        return bytes(frame[:len(HELLO_MAGIC)]) == HELLO_MAGIC

    def accept(self, peer_id: bytes, hello: bytes) -> tuple[bytes, SessionChannel]:
        """(the welcome to send back, the peer's session); ``AuthenticationError`` for a forged hello."""
        hello = bytes(hello)
        n = len(HELLO_MAGIC)
        nonce = hello[n:n + NONCE_BYTES]
        ok = len(hello) == n + NONCE_BYTES + TAG_BYTES and hmac.compare_digest(
            hello[n + NONCE_BYTES:],
            hmac.new(derive_key(self._key, "hello"), bytes(peer_id) + nonce, hashlib.sha256).digest())
        if not ok:
            self.dropped["forged"] = self.dropped.get("forged", 0) + 1
            raise FrameDropped("forged", "handshake hello failed authentication")
        server_nonce = os.urandom(NONCE_BYTES)
        welcome = WELCOME_MAGIC + server_nonce + self._instance + _welcome_tag(
            self._key, bytes(peer_id), nonce, server_nonce, self._instance)
        key = derive_key(self._key, "session", bytes(peer_id), nonce, server_nonce, self._instance)
        return welcome, SessionChannel(key, sends=SERVER_TO_CLIENT)


def curve_server_keys(secret: Union[str, bytes]) -> tuple[bytes, bytes]:
    """(public, secret) CURVE keys of the coordinator, derived from the cluster secret (Z85).

    Only a holder of the cluster secret knows the server's public key, so nobody else can
    even complete a CURVE handshake; everyone else's bytes are encrypted on the wire.
    """
    import zmq
    from zmq.utils import z85

    secret_key = z85.encode(derive_key(load_secret(secret), "curve-server"))
    return zmq.curve_public(secret_key), secret_key


def new_secret_file(directory: Optional[str] = None, secret: Union[str, bytes, None] = None) -> str:
    """``secret`` (else a fresh random one) in a new file only this user can read (0600, in a 0700 directory).

    This is how a secret reaches processes we spawn: by path (or inherited fd), never in
    argv, where every local user can read it in ``/proc/<pid>/cmdline``. A file, not a
    value, because the transports read their meta key from ``$KVXFER_SECRET_FILE``: a
    secret handed over as a value would key the control plane and leave the metas unsigned.
    """
    import secrets
    import tempfile

    raw = _file_secret(secret) if secret is not None else secrets.token_hex(32).encode()
    folder = tempfile.mkdtemp(prefix="kvxfer-secret-", dir=directory)  # mkdtemp makes it 0700
    path = os.path.join(folder, "secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(raw)
    return path


def process_secret_file(secret: Union[str, bytes]) -> str:
    """``secret`` in an anonymous in-memory file of this process; its path, ``/proc/<pid>/fd/<n>``.

    For a key only this process (and its user's processes, while it lives) reads through
    ``$KVXFER_SECRET_FILE``. It goes with the process however that ends: a file from
    ``new_secret_file`` stays in the temporary folder after a SIGKILL, which no exit handler sees.
    """
    raw = _file_secret(secret)
    fd = os.memfd_create("kvxfer-secret", os.MFD_CLOEXEC)  # stays open: the file lives as long as we do
    os.fchmod(fd, 0o600)
    with open(fd, "wb", closefd=False) as fh:
        fh.write(raw)
    return f"/proc/{os.getpid()}/fd/{fd}"


def _file_secret(secret: Union[str, bytes]) -> bytes:
    """``secret`` as the bytes a secret file holds, refused where reading the file back would differ."""
    raw = load_secret(secret)
    if raw != raw.strip():  # load_secret strips what it reads from a file: the key would differ
        raise KVXferError("a control-plane secret must not begin or end with whitespace")
    return raw


def remove_secret_file(path: str) -> None:
    """Delete a file from ``new_secret_file`` and its private directory (missing is fine)."""
    for remove, target in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
        try:
            remove(target)
        except OSError:
            pass
