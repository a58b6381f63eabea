"""Fuzz the NIXL and UCX peer metadata (agent metadata, rkeys, worker addresses).

These fields come from another process and are handed to C libraries; a
malformed one must be refused with a ``KVXferError`` before anything is posted,
never crash the process or raise anything else. An accepted mutation (an extra
key, say) must still move exactly the right bytes.
"""

import base64
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.errors import KVXferError

SHAPE = (2, 2, 8, 2, 1, 4)


@pytest.fixture(params=["nixl", "ucx"])
def pair(request):
    cls = construct_kv_transfer_backend_class(request.param)
    src = cls(f"fz-src-{request.param}", torch.arange(float(torch.Size(SHAPE).numel())).view(SHAPE), 8, timeout_s=5)
    dst = cls(f"fz-dst-{request.param}", torch.zeros(SHAPE), 8, timeout_s=5)
    yield src, dst, src.export_meta()
    dst.close()
    src.close()


def _b64_junk(draw):
    raw = draw(st.binary(max_size=64))
    return base64.b64encode(raw).decode() if draw(st.booleans()) else draw(st.text(max_size=12))


@st.composite
def mutation(draw, valid):
    meta = json.loads(json.dumps(valid))
    transport_keys = [k for k in meta if k.startswith(("nixl_", "ucx_"))]
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(transport_keys + ["agent_name", "backend", "base_addr", "num_blocks", "extra"]))
        choice = draw(st.integers(0, 4))
        if choice == 0:
            meta.pop(key, None)
        elif choice == 1 and isinstance(meta.get(key), str):
            text = meta[key]
            cut = draw(st.integers(0, max(0, len(text) - 1)))
            meta[key] = text[:cut]  # truncated
        elif choice == 2:
            meta[key] = _b64_junk(draw)
        elif choice == 3:
            meta[key] = draw(st.integers(-(2**66), 2**66))
        else:
            meta[key] = draw(st.none() | st.booleans() | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    return meta


def test_transport_meta_fuzz(pair):
    src, dst, valid = pair

    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(mutation(valid))
    def check(meta):
        before = dst.memory_buffer.clone()
        try:
            handle = dst.begin_pull_blocks(meta, [1, 5], [2, 3], request_id=7)
        except KVXferError:
            assert torch.equal(dst.memory_buffer, before)
            return
        handle.wait(10)
        assert torch.equal(dst.memory_buffer[:, :, [2, 3]], src.memory_buffer[:, :, [1, 5]])
        dst.memory_buffer.copy_(before)

    check()
    # and the pair still works normally afterwards
    dst.begin_pull_blocks(valid, [0], [0], request_id=8).wait(10)
    assert torch.equal(dst.memory_buffer[:, :, 0], src.memory_buffer[:, :, 0])
