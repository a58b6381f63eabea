"""A meta's capability fields travel encrypted under the cluster key (issue 49 item 7).

Round 6 read a prefill's KV with nothing but a copy of a signed meta taken off the wire (SGLang's HELLO
is plaintext): signing proves who wrote a meta, it did not hide the rkeys and read token in it. Now, with
the cluster key, NIXL's agent metadata and the ``ucx`` backend's rkey and read token are AES-GCM boxes
(``kvxfer/meta/capabilities.py``): the meta a wire carries holds none of their bytes, a reader with the key
opens them, and one without it (or with another key) is refused naming the setting, before anything is
posted. Real backends; the two-process keyed pull is ``tests/cli/test_loopback_keys.py`` (``kvxfer
loopback`` keys both processes) and the keyed vLLM/SGLang tests.
"""

from __future__ import annotations

import base64
import json

import pytest
import torch

from kvxfer import construct_kv_transfer_backend_class
from kvxfer.errors import PeerMetadataError
from kvxfer.meta.capabilities import BOX_PREFIX, conceal, reveal

KEY, OTHER_KEY = b"k" * 32, b"o" * 32
NUM_BLOCKS = 8
SHAPE = (2, 2, NUM_BLOCKS, 4, 2, 16)


def test_a_box_opens_only_with_its_key_and_its_field():
    box = conceal("secret-rkey", KEY, "ucx_rkey")
    assert box.startswith(BOX_PREFIX) and "secret-rkey" not in box
    assert reveal(box, KEY, "ucx_rkey") == "secret-rkey"
    assert conceal("secret-rkey", KEY, "ucx_rkey") != box  # a fresh nonce each time
    with pytest.raises(PeerMetadataError, match="does not open with this cluster's key"):
        reveal(box, OTHER_KEY, "ucx_rkey")
    with pytest.raises(PeerMetadataError, match="does not open"):
        reveal(box, KEY, "ucx_read_token")  # moved to another field
    with pytest.raises(PeerMetadataError, match="KVXFER_SECRET_FILE"):
        reveal(box, None, "ucx_rkey")
    with pytest.raises(PeerMetadataError, match="in the clear"):
        reveal("secret-rkey", KEY, "ucx_rkey")
    assert reveal("secret-rkey", None, "ucx_rkey") == "secret-rkey"  # keyless: nothing is encrypted
    raw = bytearray(base64.b64decode(box[len(BOX_PREFIX):]))
    raw[-1] ^= 1
    with pytest.raises(PeerMetadataError, match="does not open"):
        reveal(BOX_PREFIX + base64.b64encode(bytes(raw)).decode(), KEY, "ucx_rkey")


def _secrets(backend) -> list[bytes]:
    """The capability bytes a backend exports, read from the backend itself (not from its meta)."""
    if backend.name == "ucx":
        return [backend._region.packed_rkey, backend._read_token]
    with backend._share.lock:
        return [backend._share.agent.get_agent_metadata()]


@pytest.mark.parametrize("name", ["ucx", "nixl"])
def test_a_keyed_meta_carries_no_capability_in_the_clear(name):
    cls = construct_kv_transfer_backend_class(name)
    source = cls(f"cap-src-{name}", torch.ones(SHAPE), NUM_BLOCKS, meta_key=KEY)
    readers = []
    try:
        meta = source.export_meta()
        wire = json.dumps(meta)
        for secret in _secrets(source):
            assert base64.b64encode(secret).decode() not in wire
        for field in cls.capability_meta_fields:
            assert meta[field].startswith(BOX_PREFIX), field
        keyed = cls(f"cap-dst-{name}", torch.zeros(SHAPE), NUM_BLOCKS, meta_key=KEY)
        readers.append(keyed)
        assert keyed.parse_peer_meta(meta).transport is not None  # opens with the key
        other = cls(f"cap-other-{name}", torch.zeros(SHAPE), NUM_BLOCKS, meta_key=OTHER_KEY)
        readers.append(other)
        with pytest.raises(PeerMetadataError):
            other.parse_peer_meta(meta)  # another cluster's key: refused (by the signature first)
        keyless = cls(f"cap-nokey-{name}", torch.zeros(SHAPE), NUM_BLOCKS, meta_key=None)
        readers.append(keyless)
        with pytest.raises(PeerMetadataError, match="KVXFER_SECRET_FILE"):
            keyless.parse_peer_meta(meta)
    finally:
        for backend in readers + [source]:
            backend.close()


@pytest.mark.parametrize("name", ["ucx", "nixl"])
def test_a_keyless_meta_is_unchanged(name, monkeypatch):
    monkeypatch.delenv("KVXFER_SECRET_FILE", raising=False)
    cls = construct_kv_transfer_backend_class(name)
    source = cls(f"plain-src-{name}", torch.ones(SHAPE), NUM_BLOCKS)
    try:
        meta = source.export_meta()
        assert not any(str(meta.get(f, "")).startswith(BOX_PREFIX) for f in cls.capability_meta_fields)
        assert base64.b64encode(_secrets(source)[0]).decode() in json.dumps(meta)
    finally:
        source.close()
