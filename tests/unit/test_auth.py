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


def test_a_process_secret_file_is_read_by_path_and_goes_with_its_process(tmp_path):
    """The worker's key for its own transports (``process_secret_file``): readable by path by another
    process of this user while its process lives; nothing left anywhere once that process is SIGKILLed."""
    import os
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvxfer.security.auth import process_secret_file as p; "
         "print(p(sys.argv[1]), flush=True); sys.stdin.read()", SECRET.decode()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        path = child.stdout.readline().strip()
        assert path.startswith(f"/proc/{child.pid}/fd/"), path
        assert load_secret(secret_file=path) == SECRET
    finally:
        child.kill()
        child.wait(timeout=30)
    assert not os.path.exists(path)
    assert not list(tmp_path.iterdir())  # no key file in the temporary folder either
    with pytest.raises(KVXferError, match="whitespace"):
        from kvxfer.security.auth import process_secret_file
        process_secret_file(SECRET + b" ")
