import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.security.auth import MessageAuthenticator, load_secret
from kvxfer.errors import AuthenticationError, KVXferError

SECRET = b"0123456789abcdef-test-secret"


def test_round_trip():
    auth = MessageAuthenticator(SECRET)
    assert auth.open(auth.seal(b'{"meta": 1}')) == b'{"meta": 1}'


def test_wrong_secret_is_dropped_and_counted():
    ours, theirs = MessageAuthenticator(SECRET), MessageAuthenticator(b"another-secret-of-16+bytes")
    with pytest.raises(AuthenticationError):
        ours.open(theirs.seal(b"hello"))
    assert ours.dropped == 1


def test_tampered_payload_is_dropped():
    auth = MessageAuthenticator(SECRET)
    frame = bytearray(auth.seal(b"blocks=[1,2,3]"))
    frame[-2] ^= 1
    with pytest.raises(AuthenticationError):
        auth.open(bytes(frame))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_frames_never_authenticate(frame):
    with pytest.raises(AuthenticationError):
        MessageAuthenticator(SECRET).open(frame)


def test_secret_is_never_shown():
    assert SECRET.decode() not in repr(MessageAuthenticator(SECRET))


def test_secret_from_file(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    monkeypatch.setenv("KVXFER_SECRET_FILE", str(path))
    assert load_secret() == SECRET
    monkeypatch.setenv("KVXFER_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(KVXferError, match="cannot read"):
        load_secret()
    monkeypatch.delenv("KVXFER_SECRET_FILE")
    with pytest.raises(KVXferError, match="KVXFER_SECRET_FILE"):
        load_secret()
    with pytest.raises(KVXferError, match="at least 16 bytes"):
        load_secret("short")
