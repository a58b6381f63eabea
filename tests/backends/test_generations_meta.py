"""A verified pull checks its generations meta whole before the data read is posted (issue 26, row 9).

A sealed but wrong generations meta (other dtype, other geometry, too few blocks, another
pool's or another agent's table) used to pass the seal check, let the data read be posted,
and fail only when the counters read was planned after it: safe, but a read that ran for
nothing. Now each is refused before anything is posted. The source is a real process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.errors import BlockIdError, PeerMetadataError
from kvxfer.handoff.generations import GenerationChecker
from kvxfer.security.auth import SECRET_FILE_ENV, new_secret_file
from tests.support.generations_source import source_pool

ROOT = Path(__file__).resolve().parents[2]
BACKEND, NUM_BLOCKS, SEED = "ucx", 32, 7
SRC, DST = [5, 6, 9], [1, 2, 3]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    env = {**os.environ, SECRET_FILE_ENV: new_secret_file(str(tmp_path_factory.mktemp("key"))),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.generations_source", BACKEND, str(NUM_BLOCKS), str(SEED)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        metas = json.loads(proc.stdout.readline())
        yield env[SECRET_FILE_ENV], metas
    finally:
        proc.stdin.close()
        proc.wait(20)


@pytest.fixture
def decode(source, monkeypatch):
    monkeypatch.setenv(SECRET_FILE_ENV, source[0])
    cls = construct_kv_transfer_backend_class(BACKEND)
    with cls("gen-dst", torch.zeros((2, 2, NUM_BLOCKS, 4, 2, 8), dtype=torch.bfloat16), NUM_BLOCKS,
             timeout_s=10.0) as dst:
        checker = GenerationChecker(dst)
        try:
            yield dst, checker
        finally:
            checker.close()


WRONG = ["float64 counters", "the KV pool's own meta", "a table too short for the blocks read",
         "a table of another pool size", "another agent's table"]


@pytest.mark.parametrize("what", WRONG)
def test_a_wrong_generations_meta_is_refused_before_the_data_read_is_posted(source, decode, what):
    _, metas = source
    dst, checker = decode
    with pytest.raises((PeerMetadataError, BlockIdError)):
        checker.begin_pull_verified(metas["kv"], metas["wrong"][what], SRC, DST, [0] * len(SRC), request_id=what)
    assert dst.stats()["transfers_started"] == 0            # no data read was posted
    assert checker.registration.stats()["transfers_started"] == 0
    assert not dst.memory_buffer.any()                       # and no byte landed


def test_the_right_generations_meta_still_verifies_the_pull(source, decode):
    _, metas = source
    dst, checker = decode
    handle = checker.begin_pull_verified(metas["kv"], metas["generations"], SRC, DST, [0] * len(SRC), request_id=1)
    handle.wait(10)
    expected = source_pool(NUM_BLOCKS, SEED)[:, :, SRC]
    assert torch.equal(dst.memory_buffer[:, :, DST].view(torch.uint8), expected.view(torch.uint8))
    assert dst.stats()["transfers_started"] == 1 and checker.registration.stats()["transfers_started"] == 1
