"""Metas signed with the cluster key: a re-sealed (forged) meta never reaches a transport.

The hash seal alone is recomputable by anyone; with ``KVXFER_SECRET_FILE`` set the
exporter signs it and an importer with the key refuses anything else. Without a key,
only metas of this host are accepted unless the user opts in. The forged metas here
are the ones that, unsigned, made the ucx backend read outside the exported region.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvxfer.errors import PeerMetadataError
from kvxfer.meta.seal import HOST_FIELD, seal_meta
from megatron_driver import Case, Side, global_tensors, poll_all, rank_specs, setup_rank
from test_megatron_contract import _start_prefill, _stop

CASE = Case("signed", Side(1), Side(1, rank_base=10), seed=21)


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "cluster.secret"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("backend", ["ucx", "nixl"])
def test_forged_metas_are_refused_and_signed_ones_move_exact_bytes(backend, secret_file):
    proc, metas = _start_prefill(backend, [CASE], KVXFER_SECRET_FILE=str(secret_file))
    key = secret_file.read_bytes()
    rank = setup_rank(backend, "decode", CASE, CASE.decode, rank_specs(CASE.decode, CASE.num_layers)[0], None,
                      meta_key=key)
    meta, src = metas["signed"]["kv_meta"], metas["signed"]["block_ids"]
    dst = list(range(len(src)))
    try:
        forged = [
            seal_meta({**meta, "base_addr": meta["base_addr"] + 64}),          # outside the region, re-sealed
            seal_meta({**meta, "num_blocks": 2 * meta["num_blocks"]}),
            seal_meta({**meta, "base_addr": 4096}),
            seal_meta({**meta, "base_addr": meta["base_addr"] + 64}, b"not the cluster key at all"),
            seal_meta(dict(meta)),                                              # unchanged but unsigned
        ]
        for bad in forged:
            with pytest.raises(PeerMetadataError, match="not signed with this cluster's key"):
                rank.kv.begin_pull_blocks(bad, src, dst)
        assert not rank.kv.memory_buffer.any(), "a refused meta moved bytes"
        poll_all([rank.kv.begin_pull_blocks(meta, src, dst)], 30)
        truth = global_tensors(CASE)["kv"]
        assert torch.equal(rank.kv.memory_buffer[:, :, dst].view(torch.uint8), truth[:, :, src].view(torch.uint8))
    finally:
        rank.close()
        _stop(proc)


def test_without_a_key_only_this_hosts_metas_are_accepted():
    truth = global_tensors(CASE)
    src = setup_rank("local", "prefill", CASE, CASE.prefill, rank_specs(CASE.prefill, CASE.num_layers)[0], truth)
    strict = setup_rank("local", "decode", CASE, CASE.decode, rank_specs(CASE.decode, CASE.num_layers)[0], None)
    try:
        elsewhere = seal_meta({**src.kv.export_meta(), HOST_FIELD: "another-boot/4026531840"})
        with pytest.raises(PeerMetadataError, match="another host"):
            strict.kv.begin_pull_blocks(elsewhere, [1], [2])
        assert not strict.kv.memory_buffer.any()
        strict.kv.begin_pull_blocks(src.kv.export_meta(), [1], [2]).wait(5)  # this host: fine
        trusting = setup_rank("local", "decode", CASE, CASE.decode, rank_specs(CASE.decode, CASE.num_layers)[0], None,
                              allow_unauthenticated_metas=True)
        try:
            trusting.kv.begin_pull_blocks(elsewhere, [1], [2]).wait(5)
            assert torch.equal(trusting.kv.memory_buffer[:, :, 2], truth["kv"][:, :, 1])
        finally:
            trusting.close()
    finally:
        src.close()
        strict.close()
