"""Property tests: whatever a peer sends, only KVXferError subclasses come out.

Peer metadata and block-id lists come from another process (and, across hosts,
another machine); a malformed one must be refused with a clear error, never crash
the decode process with a TypeError or post a read.
"""

import json

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.backends.local.backend import _LIVE, LocalBackend
from kvxfer.errors import KVXferError
from kvxfer.meta.geometry import parse_geometry_meta
from kvxfer.meta.seal import seal_meta

SHAPE = (2, 2, 8, 2, 1, 4)
_SRC = LocalBackend("fuzz-src", torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE), 8)
_DST_POOL = torch.zeros(SHAPE)
_DST = LocalBackend("fuzz-dst", _DST_POOL, 8)
VALID = _SRC.export_meta()

junk = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80) | st.floats(allow_nan=True)
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def mutated_meta(draw):
    meta = json.loads(json.dumps(VALID))
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(sorted(meta) + ["extra"]))
        action = draw(st.sampled_from(["set", "delete", "nudge"]))
        if action == "delete":
            meta.pop(key, None)
        elif action == "nudge" and isinstance(meta.get(key), int) and not isinstance(meta.get(key), bool):
            meta[key] = meta[key] + draw(st.integers(-3, 3)) * draw(st.sampled_from([1, 64, 2**40]))
        else:
            meta[key] = draw(junk)
    if draw(st.booleans()):
        try:  # half the time: a peer that seals what it sends, so the field checks are what is tested
            seal_meta(meta)
        except KVXferError:
            pass  # not JSON-serialisable: the seal check refuses it either way
    return meta


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(mutated_meta())
def test_parse_raises_only_kvxfer_errors(meta):
    try:
        parse_geometry_meta(meta)
    except KVXferError:
        pass


@FUZZ
@given(junk)
def test_parse_of_arbitrary_values(value):
    try:
        parse_geometry_meta(value)
    except KVXferError:
        pass


@st.composite
def id_lists(draw):
    """Mostly valid, equal-length id lists (so the meta is what gets tested), sometimes junk."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.lists(junk, max_size=4)), draw(st.lists(junk, max_size=4))
    n = draw(st.integers(1, 4))
    return (draw(st.lists(st.integers(0, 7), min_size=n, max_size=n, unique=True)),
            draw(st.lists(st.integers(0, 7), min_size=n, max_size=n, unique=True)))


@FUZZ
@given(mutated_meta(), id_lists())
def test_pull_with_fuzzed_meta_and_ids_never_misbehaves(meta, ids):
    src_ids, dst_ids = ids
    before = _DST_POOL.clone()
    try:
        handle = _DST.begin_pull_blocks(meta, src_ids, dst_ids, request_id=1)
    except KVXferError:
        assert torch.equal(_DST_POOL, before), "a refused pull must not move a byte"
        return
    handle.wait(5)
    if len(src_ids) == 0:  # nothing to move: accepted without touching the transport
        assert torch.equal(_DST_POOL, before)
        return
    # accepted: the meta still truly describes a live registration; the copy must be exact
    source = _LIVE[meta["local_buffer_id"]]
    source.drain_read_done()
    ids_src, ids_dst = list(src_ids), list(dst_ids)
    expected = before.clone()
    expected[:, :, ids_dst] = source.memory_buffer[:, :, ids_src]
    assert torch.equal(_DST_POOL, expected)
    _DST_POOL.copy_(before)


@FUZZ
@given(st.lists(st.integers(-(2**70), 2**70), max_size=6), st.lists(st.integers(-(2**70), 2**70), max_size=6))
def test_huge_and_negative_block_ids(src_ids, dst_ids):
    try:
        _DST.begin_pull_blocks(VALID, src_ids, dst_ids).wait(5)
    except KVXferError:
        return
    _SRC.drain_read_done()
