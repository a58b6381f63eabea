"""kvxfer's frames on SGLang's sockets (``kvxfer.integrations.sglang.wire``): what a peer sends is
checked (signature with the cluster key, then the tag's schema) before a field is used; SGLang's own
messages pass through untouched. No SGLang needed: the wire is kvxfer's."""

from __future__ import annotations

import pytest

from kvxfer.integrations.sglang import wire

KEY, OTHER = b"k" * 32, b"o" * 32
CHUNK = {"room": 7, "prefill": "127.0.0.1:5", "chunk": 0, "src": [3, 4], "dst_start": 0, "dst_end": 2, "last": True,
         "slot": 1, "lease": 9, "aux_index": None, "state": [[2], None]}


def test_a_signed_frame_round_trips_and_sglangs_own_messages_are_not_kvxfers():
    key = wire.FrameKey(KEY)
    frames = key.sign(wire.encode(wire.CHUNK, CHUNK))
    assert len(frames) == 3
    assert wire.decode(frames, key) == (wire.CHUNK, CHUNK)
    assert wire.decode(wire.encode(wire.CHUNK, CHUNK)) == (wire.CHUNK, CHUNK)  # no key on either side
    assert wire.decode([b"ABORT", b"1"], key) is None and wire.decode([], key) is None


@pytest.mark.parametrize("frames,reader,names", [
    (lambda: wire.encode(wire.CHUNK, CHUNK), wire.FrameKey(KEY), "not signed with this cluster's key"),
    (lambda: wire.FrameKey(OTHER).sign(wire.encode(wire.CHUNK, CHUNK)), wire.FrameKey(KEY), "another secret"),
    (lambda: wire.FrameKey(KEY).sign(wire.encode(wire.CHUNK, CHUNK)), wire.UNSIGNED, "no KVXFER_SECRET_FILE"),
    (lambda: [wire.META, wire.encode(wire.CHUNK, CHUNK)[1], b"x" * 32], wire.FrameKey(KEY), "not signed"),
    (lambda: [wire.CHUNK], wire.UNSIGNED, "1 frames"),
])
def test_a_frame_without_the_right_signature_is_refused_before_it_is_read(frames, reader, names):
    with pytest.raises(wire.WireError, match=names):
        wire.decode(frames(), reader)


@pytest.mark.parametrize("body,names", [
    (b"{not json", "malformed"),
    (b"[]", "Expected `object`"),
    (b'{"room": "7", "endpoint": "a"}', r"at `\$\.room`"),
    (b'{"room": true, "endpoint": "a"}', r"at `\$\.room`"),
    (b'{"endpoint": "a"}', "missing required field `room`"),
    (b'{"room": 1, "endpoint": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "recursion"),
    (b" " * (wire.MAX_BODY_BYTES + 1), "more than"),
])
def test_a_body_that_breaks_its_schema_is_refused_naming_why(body, names):
    key = wire.FrameKey(KEY)
    with pytest.raises(wire.WireError, match=names):
        wire.decode(key.sign([wire.META, body]), key)


def test_a_chunk_whose_fields_have_the_wrong_types_is_refused():
    key = wire.FrameKey(KEY)
    for field, bad in (("src", [1, "2"]), ("state", [[1], "x"]), ("last", "yes"), ("lease", None)):
        with pytest.raises(wire.WireError, match=field):
            wire.decode(key.sign(wire.encode(wire.CHUNK, {**CHUNK, field: bad})), key)
