"""The local backend: the full contract, in one process."""

import json

import numpy as np
import pytest
import torch

from kvxfer.backends.base import TransferState
from kvxfer.backends.local.backend import LocalBackend
from kvxfer.errors import BackendClosedError, BlockIdError, KVXferError, PeerMetadataError
from kvxfer.meta.seal import seal_meta
from tests.conftest import DTYPES, random_pool

SHAPE = (2, 4, 16, 4, 2, 8)


def _pair(dtype=torch.float32, device="cpu"):
    src_pool = random_pool(SHAPE, dtype, seed=3, device=device)
    dst_pool = torch.zeros(SHAPE, dtype=dtype, device=device)
    return LocalBackend("prefill", src_pool, 16), LocalBackend("decode", dst_pool, 16), src_pool, dst_pool


@pytest.mark.parametrize("dtype", DTYPES)
def test_pull_copies_exactly_and_reports_read_done(dtype):
    src, dst, src_pool, dst_pool = _pair(dtype)
    rng = np.random.default_rng(0)
    src_ids, dst_ids = rng.choice(16, 7, replace=False), rng.choice(16, 7, replace=False)
    meta = json.loads(json.dumps(src.export_meta()))  # it must survive the wire
    handle = dst.begin_pull_blocks(meta, src_ids, dst_ids, request_id="req-1")
    handle.wait(5)
    assert handle.state is TransferState.DONE and handle.storage_safe and handle.poll()
    expected = torch.zeros_like(dst_pool)
    expected[:, :, dst_ids] = src_pool[:, :, src_ids]
    assert torch.equal(dst_pool.view(torch.uint8), expected.view(torch.uint8))
    assert src.drain_read_done() == ["req-1"]
    assert src.drain_read_done() == []


def test_pulls_without_request_id_get_a_label_but_send_no_read_done():
    """Megatron never drains transport notices: a pull without an id must not fill the source's queue."""
    src, dst, *_ = _pair()
    a = dst.begin_pull_blocks(src.export_meta(), [0], [0])
    b = dst.begin_pull_blocks(src.export_meta(), [1], [1])
    a.wait(5), b.wait(5)
    assert a.request_id != b.request_id
    assert src.drain_read_done() == []
    dst.begin_pull_blocks(src.export_meta(), [2], [2], request_id="r").wait(5)
    assert src.drain_read_done() == ["r"]


@pytest.mark.parametrize("mutate, error, message", [
    (lambda m: m.update(dtype="float16"), PeerMetadataError, "float16"),
    (lambda m: m.update(backend="nixl"), PeerMetadataError, "'backend' is 'nixl'"),
    (lambda m: m.update(pid=-1), PeerMetadataError, "only reaches registrations in this process"),
    (lambda m: m.pop("num_outer"), PeerMetadataError, "num_outer"),
    (lambda m: m.update(local_buffer_id=10**9), PeerMetadataError, "no live local registration"),
])
def test_bad_peer_meta_moves_nothing(mutate, error, message):
    src, dst, _, dst_pool = _pair()
    meta = src.export_meta()
    mutate(meta)
    seal_meta(meta)  # a peer whose meta is well-formed but wrong: the field checks must catch it
    with pytest.raises(error, match=message):
        dst.begin_pull_blocks(meta, [1, 2], [3, 4], request_id=1)
    assert not dst_pool.any() and src.drain_read_done() == []
    dst.begin_pull_blocks(src.export_meta(), [1], [3], request_id=2).wait(5)  # still usable
    assert src.drain_read_done() == [2]


@pytest.mark.parametrize("src_ids, dst_ids", [([0, 1], [0]), ([16], [0]), ([0, 1], [2, 2])])
def test_bad_ids_move_nothing(src_ids, dst_ids):
    src, dst, _, dst_pool = _pair()
    with pytest.raises(BlockIdError):
        dst.begin_pull_blocks(src.export_meta(), src_ids, dst_ids)
    assert not dst_pool.any()


_BAD_IDS = {   # issue 21, A14: each held on main; kept so that none regresses
    "negative source": ([-1], [0]), "negative destination": ([0], [-1]),
    "source out of range": ([16], [0]), "destination out of range": ([0], [16]),
    "duplicate destination": ([0, 1], [2, 2]), "lengths differ": ([0, 1], [0]),
    "float ids": ([1.0], [2]), "float array": (np.array([1.0]), np.array([2.0])), "bool ids": ([True], [2]),
    "str ids": (["1"], [2]), "None": (None, [2]), "nested list": ([[1]], [2]), "2**70": ([2 ** 70], [0]),
    "a million ids": (list(range(10 ** 6)), list(range(10 ** 6))), "a set": ({1}, {2}), "a dict": ({1: 1}, {2: 2}),
    "bytes": (b"\x01", b"\x02"),
}


@pytest.mark.parametrize("src_ids, dst_ids", list(_BAD_IDS.values()), ids=list(_BAD_IDS))
def test_every_malformed_id_list_is_a_kvxfer_error_before_a_byte_moves(src_ids, dst_ids):
    src, dst, _, dst_pool = _pair()
    with pytest.raises(KVXferError):
        dst.begin_pull_blocks(src.export_meta(), src_ids, dst_ids, request_id="bad")
    assert not dst_pool.view(torch.uint8).any() and src.drain_read_done() == []
    assert dst.stats()["in_flight"] == 0


@pytest.mark.parametrize("as_ids", [lambda ids: [np.int64(i) for i in ids], np.array, torch.tensor],
                         ids=["numpy ints", "numpy array", "tensor"])
def test_integer_ids_of_numpy_and_torch_are_taken_as_ints(as_ids):
    src, dst, src_pool, dst_pool = _pair()
    dst.begin_pull_blocks(src.export_meta(), as_ids([1, 5]), as_ids([2, 0]), request_id="np").wait(5)
    view, src_view = dst_pool.view(torch.uint8), src_pool.view(torch.uint8)
    assert torch.equal(view[:, :, [2, 0]], src_view[:, :, [1, 5]]) and src.drain_read_done() == ["np"]


def test_close_is_idempotent_and_closed_backend_raises():
    src, dst, *_ = _pair()
    meta = src.export_meta()
    src.close()
    src.close()
    with pytest.raises(BackendClosedError):
        src.export_meta()
    with pytest.raises(PeerMetadataError, match="was the source closed"):
        dst.begin_pull_blocks(meta, [0], [0])
    dst.close()
    with pytest.raises(BackendClosedError):
        dst.begin_pull_blocks(meta, [0], [0])


def test_sibling_registration_shares_the_agent_name():
    src, _, _, _ = _pair()
    ssm = src.new_registered_buffer(memory_buffer=torch.zeros(3, 16, 5), expected_num_blocks=16)
    assert ssm.agent_name == src.agent_name and ssm.geometry.num_outer == 3
    ssm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_pull_stays_on_device(dtype):
    src, dst, src_pool, dst_pool = _pair(dtype, device="cuda")
    handle = dst.begin_pull_blocks(src.export_meta(), [5, 6, 1], [0, 9, 2], request_id=7)
    handle.wait(10)
    assert torch.equal(dst_pool[:, :, [0, 9, 2]].cpu().view(torch.uint8), src_pool[:, :, [5, 6, 1]].cpu().view(torch.uint8))
    assert src.drain_read_done() == [7]


def test_stats_count_transfers_bytes_and_notifications():
    src, dst, *_ = _pair()
    bps = dst.geometry.bytes_per_slice
    dst.begin_pull_blocks(src.export_meta(), [0, 1, 2], [4, 5, 6], request_id=1).wait(5)
    pending = dst.begin_pull_blocks(src.export_meta(), [3], [7], request_id=2)
    stats = dst.stats()
    assert stats["transfers_started"] == 2 and stats["transfers_completed"] == 1 and stats["in_flight"] == 1
    assert stats["bytes_requested"] == 4 * 8 * bps and stats["bytes_completed"] == 3 * 8 * bps
    pending.wait(5)
    assert dst.stats()["in_flight"] == 0 and dst.stats()["bytes_completed"] == 4 * 8 * bps
    assert sorted(src.drain_read_done()) == [1, 2] and src.stats()["read_done_received"] == 2


@pytest.mark.parametrize("change", [
    lambda m: m.update(base_addr=m["base_addr"] + 64),   # a stale or corrupted address
    lambda m: m.update(agent_name=m["agent_name"][:-1]),  # truncated
    lambda m: m.pop("meta_seal"),
    lambda m: m.update(meta_seal="0" * 64),
])
def test_altered_meta_fails_the_seal_before_any_field_is_used(change):
    src, dst, _, dst_pool = _pair()
    meta = src.export_meta()
    change(meta)
    with pytest.raises(PeerMetadataError, match="meta_seal|integrity check"):
        dst.begin_pull_blocks(meta, [1], [2])
    assert not dst_pool.any()


@pytest.mark.parametrize("shape, offset", [((2, 3, 16, 1, 1, 3), 0),   # 6-byte bf16 slices: 2-byte words
                                           ((2, 3, 16, 1, 1, 4), 1)])  # 8-byte slices, pool misaligned by 2
def test_oracle_copies_exactly_whatever_word_fits(shape, offset):
    """The fast path copies in the widest word that divides slices and aligns both pools."""
    n = int(np.prod(shape))
    src_storage = random_pool((n + offset,), torch.bfloat16, seed=4)
    dst_storage = torch.zeros(n + offset, dtype=torch.bfloat16)
    src_pool, dst_pool = src_storage[offset:].view(shape), dst_storage[offset:].view(shape)
    src, dst = LocalBackend("p", src_pool, 16), LocalBackend("d", dst_pool, 16)
    try:
        dst.begin_pull_blocks(src.export_meta(), [3, 0, 15], [1, 14, 2], request_id=1).wait(5)
        expected = torch.zeros_like(dst_pool)
        expected[:, :, [1, 14, 2]] = src_pool[:, :, [3, 0, 15]]
        assert torch.equal(dst_pool.view(torch.int16), expected.view(torch.int16))
        assert not dst_storage[:offset].any()
    finally:
        src.close()
        dst.close()


def test_verified_meta_cache_never_lets_a_changed_field_through():
    """A verified meta is remembered by its seal; a later one must match it field for field, type for type."""
    src, dst, _, dst_pool = _pair()
    meta = src.export_meta()
    dst.begin_pull_blocks(meta, [1], [2], request_id=1).wait(5)  # verified and remembered
    dst.begin_pull_blocks(json.loads(json.dumps(meta)), [3], [4], request_id=2).wait(5)  # same fields: cached
    before = dst_pool.clone()
    for change in ({"base_addr": meta["base_addr"] + 64}, {"base_addr": float(meta["base_addr"])},
                   {"num_blocks": True} if meta["num_blocks"] == 1 else {"num_blocks": meta["num_blocks"] - 1}):
        with pytest.raises(PeerMetadataError, match="integrity check"):
            dst.begin_pull_blocks({**meta, **change}, [1], [5])
    meta["base_addr"] += 64  # the caller's own dict changed after the first pull: still refused
    with pytest.raises(PeerMetadataError, match="integrity check"):
        dst.begin_pull_blocks(meta, [1], [5])
    assert torch.equal(dst_pool.view(torch.uint8), before.view(torch.uint8))
