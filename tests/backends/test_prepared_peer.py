"""A source's meta verified and parsed once (``prepare_peer``), then read from request after request.

Real registrations (ucx and local) in one process; every read is compared byte for byte.
"""

from __future__ import annotations

import pytest
import torch

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.errors import PeerMetadataError
from kvxfer.meta.records import PreparedPeer

SHAPE = (2, 24, 2, 4, 16)  # outer x blocks x ...


def _pair(name: str):
    cls = construct_kv_transfer_backend_class(name)
    torch.manual_seed(3)
    src = cls(f"prep-src-{name}", torch.randn(SHAPE).to(torch.bfloat16), SHAPE[1])
    dst = cls(f"prep-dst-{name}", torch.zeros(SHAPE, dtype=torch.bfloat16), SHAPE[1])
    return src, dst


@pytest.mark.parametrize("name", ["ucx", "local"])
def test_prepared_source_reads_byte_exact_many_times_and_ignores_later_changes_to_the_callers_dict(name):
    src, dst = _pair(name)
    try:
        meta = src.export_meta()
        prepared = dst.prepare_peer(meta)
        assert isinstance(prepared, PreparedPeer) and prepared.backend == name
        meta["num_blocks"] = 10**6  # the caller's dict changes afterwards: the prepared copy does not
        for i, (s_ids, d_ids) in enumerate([([3, 4, 5], [0, 1, 2]), ([20, 7], [9, 23]), ([0], [0])]):
            dst.begin_pull_blocks(prepared, s_ids, d_ids, request_id=f"r{i}", notify=False).wait()
            assert torch.equal(dst.memory_buffer[:, d_ids].view(torch.int16), src.memory_buffer[:, s_ids].view(torch.int16))
    finally:
        src.close()
        dst.close()


def test_prepare_refuses_what_is_per_request_and_a_pull_through_another_backend_type():
    src, dst = _pair("ucx")
    local_src, local_dst = _pair("local")
    try:
        meta = src.export_meta()
        for wrapped in ({"tp_metas": [meta]}, {**meta, "block_ids": [1]}, {**meta, "ssm": {}}, [meta]):
            with pytest.raises(PeerMetadataError, match="prepare_peer takes one source's export_meta"):
                dst.prepare_peer(wrapped)
        tampered = {**meta, "num_blocks": 5}
        with pytest.raises(PeerMetadataError):
            dst.prepare_peer(tampered)  # verified as any meta is: the seal covers the geometry
        foreign = local_dst.prepare_peer(local_src.export_meta())
        with pytest.raises(PeerMetadataError, match="prepared by the local backend cannot be read by ucx"):
            dst.begin_pull_blocks(foreign, [0], [0])
        assert dst.memory_buffer.abs().sum() == 0  # nothing moved
    finally:
        for backend in (src, dst, local_src, local_dst):
            backend.close()
