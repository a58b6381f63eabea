"""A reader cannot exhaust a ucx source (issue 39, item 2): served reads are bounded and flow-controlled.

Over tcp the source serves reads itself (``kvxfer/backends/ucx/served.py``): a reader with the real read
token sends ``READ`` active messages naming rows of the source's pool. Round 5's attack: 8 READs of 4,096
rows, each row the whole 16 MiB pool, grew the source from 251 to 1,278 MiB (+128 MiB per 64 KiB READ):
every READ's 262,144 chunk sends were posted at once from its handler. Now a READ may ask for at most
``MAX_READ_BYTES``; a reader may have at most ``READER_READS`` READs, ``READER_INFLIGHT_BYTES`` and
``READER_SENDS`` in flight, and all readers together ``MAX_SERVES``, ``TOTAL_INFLIGHT_BYTES`` and
``MAX_SENDS``; a READ past any bound is refused with a reason the reader reads. A genuine pull larger than
those bounds is paced by its reader (its next READs sent as earlier ones land), and a reader that stops
taking its chunks is given up after ``SERVE_STALL_S``.

Real processes: the source is its own process (``tests/support/ucx_served_source.py``); the attackers are raw UCP
workers and endpoints of this process (the binding kvxfer uses) sending crafted READs over tcp with the
source's real token; the genuine reader is a ``UcxBackend``.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch

from kvxfer.backends.ucx import binding as _ucp
from kvxfer.backends.ucx import served
from kvxfer.backends.ucx.backend import UcxBackend
from kvxfer.errors import TransferError

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (Path(__file__).resolve().parents[2] / "tests/support/ucx_served_source.py")
POOL_MIB = 16
POOL_BYTES = POOL_MIB << 20
BLOCKS = 64
#: What the source may grow by under any of these attacks: its requests in flight (at most MAX_SENDS, ~512 B
#: each: 16 MiB; a single reader at most READER_SENDS, 4 MiB) and its serves, with room for UCX's receive
#: buffers and the allocator (docs/reliability.md, round 5).
RSS_BOUND_MIB = 48
_REQUEST = struct.Struct("<16sQQ")
_REFUSED_SIZE = struct.calcsize("<QQQqQQ")


class Source:
    """The source process: a 16 MiB pool whose reads it serves over tcp."""

    def __init__(self, overrides: Optional[dict[str, int]] = None, env: Optional[dict[str, str]] = None) -> None:
        env = {**os.environ, "UCX_TLS": "tcp", "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), str(POOL_MIB), json.dumps(overrides or {})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(ROOT), env=env)
        hello = self._line(120)
        self.meta, self.pid, self.shape = hello["meta"], hello["pid"], tuple(hello["shape"])
        self.token = base64.b64decode(self.meta["ucx_read_token"])
        self.address = base64.b64decode(self.meta["ucx_worker_address"])

    def _line(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, "the source process did not answer"
        line = self.proc.stdout.readline()
        assert line, f"the source process ended (exit {self.proc.poll()})"
        return json.loads(line)

    def ask(self, command: str, timeout_s: float = 30) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line(timeout_s)

    def stats(self) -> dict[str, Any]:
        return self.ask("stats")

    def served(self) -> dict[str, Any]:
        found = self.stats()["served"]
        assert len(found) == 1, found
        return found[0]

    def peak_rss(self, seconds: float) -> float:
        """The source's largest RSS over ``seconds`` (it may still be growing when asked first)."""
        deadline, peak = time.monotonic() + seconds, 0.0
        while time.monotonic() < deadline:
            peak = max(peak, self.stats()["rss_mib"])
            time.sleep(0.1)
        return peak

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("exit", timeout_s=30)
                self.proc.wait(timeout=30)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)


class Attacker:
    """A raw UCP worker with an endpoint to the source (peer error mode, as a reader's), sending READs."""

    def __init__(self, source: Source) -> None:
        self.context = _ucp.Context()
        self.worker = _ucp.Worker(self.context, 0x4B5E)
        self.endpoint = _ucp.Endpoint(self.worker, source.address, lambda ep, status: None, True)
        self.token = source.token
        self.refusals: list[tuple[int, int, int]] = []  # (reason code, asked, bound)
        self.chunks = 0
        self._kept: list[Any] = []
        self.worker.set_am_handler(served.DATA_AM_ID, self._on_data)

    def _on_data(self, header: bytes, data: Any, length: int, param: Any) -> None:
        if len(header) == _REFUSED_SIZE:
            _, _, code, _, asked, limit = struct.unpack("<QQQqQQ", header)
            self.refusals.append((code, asked, limit))
        else:
            self.chunks += 1

    def read(self, rows: np.ndarray, batch: int) -> None:
        rows = np.ascontiguousarray(rows, dtype=np.uint64)
        request = _ucp.send_request(self.endpoint, served.READ_AM_ID, _REQUEST.pack(self.token, batch, 0),
                                    data=rows, reply=True)
        # progress until UCX sent it (connecting first), no more: what the source answers stays on the socket
        deadline = time.monotonic() + 10
        while request is not None and time.monotonic() < deadline:
            if not _ucp.in_progress(_ucp.request_status(self.worker, request)):
                request = None  # completed and freed
                break
            self.progress(0.002)
        self._kept.append((request, rows))

    def progress(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            self.worker.progress()
            if time.monotonic() >= deadline:
                return
            time.sleep(0.001)

    def progress_until(self, done: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                return False
            self.progress(0.01)
        return True

    def close(self) -> None:
        for request, _ in self._kept:
            if request is not None:
                self.worker.wait_request(request, time.monotonic(), give_up=True)
        self.endpoint.close()
        self.worker.close()
        self.context.close()


@pytest.fixture(autouse=True)
def _tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sides on UCX's tcp transport: the path whose reads the source serves."""
    monkeypatch.setenv("UCX_TLS", "tcp")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def test_reads_spanning_the_whole_pool_are_refused_and_the_source_does_not_grow() -> None:
    """Round 5's attack, as it was run: 8 READs with the real token, each 4,096 rows of the whole 16 MiB pool
    (64 GiB asked per 64 KiB message). Before: source RSS 251 -> 1,278 MiB. Now each READ is refused with
    its reason, no byte of the pool is sent, and the source's RSS stays within RSS_BOUND_MIB."""
    source = Source()
    attacker = None
    try:
        before = source.stats()["rss_mib"]
        attacker = Attacker(source)
        rows = np.zeros((4096, 2), dtype=np.uint64)
        rows[:, 1] = POOL_BYTES
        for batch in range(1, 9):
            attacker.read(rows, batch)  # progress only to send it: what the source answers stays on the socket
        after = source.peak_rss(5.0)
        assert after - before < RSS_BOUND_MIB, f"source RSS {before:.0f} -> {after:.0f} MiB under 8 whole-pool READs"
        attacker.progress_until(lambda: len(attacker.refusals) >= 8, 30)
        stats = source.served()
        asked = 4096 * POOL_BYTES
        assert attacker.refusals == [(5, asked, served.MAX_READ_BYTES)] * 8, attacker.refusals
        assert stats["refused_by"] == {"read_too_large": 8} and stats["bytes_posted"] == 0, stats
        assert served.refusal_text(5, asked, served.MAX_READ_BYTES).endswith(
            f"it asks for {asked} bytes; a READ may ask for at most {served.MAX_READ_BYTES} (served.MAX_READ_BYTES)")
        print(f"source RSS {before:.0f} -> {after:.0f} MiB; {stats['refused']} refused, 0 bytes posted")
    finally:
        if attacker is not None:
            attacker.close()
        source.close()


def _stalled_reader(source: Source, reads: int, rows: list[list[int]]) -> subprocess.Popen:
    """A reader process that sends ``reads`` READs of ``rows`` with the real token, then stops itself."""
    env = {**os.environ, "UCX_TLS": "tcp", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "stall", str(reads), json.dumps(rows)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=str(ROOT), env=env)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(source.meta) + "\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"sent": reads}
    return proc


def test_a_reader_that_stops_holds_a_bounded_part_of_the_source_until_it_is_given_up() -> None:
    """A reader within every per-READ bound asks for 40 READs of MAX_READ_BYTES and stops (SIGSTOP): the
    source accepts what READER_INFLIGHT_BYTES and READER_READS allow, refuses the rest, and does not grow
    past RSS_BOUND_MIB. Once its chunks have not moved for SERVE_STALL_S (8 s here), the source gives its READs
    up: they count against no bound any more (UCX keeps the few sends in flight, counted apart); it
    serves the next reader as before."""
    source = Source({"SERVE_STALL_S": 8.0})
    stalled = None
    try:
        before = source.stats()["rss_mib"]
        half = served.MAX_READ_BYTES // 2
        stalled = _stalled_reader(source, 40, [[0, half], [POOL_BYTES // 2, half]])
        after = source.peak_rss(1.0)
        stats = source.served()
        accepted = served.READER_INFLIGHT_BYTES // served.MAX_READ_BYTES
        window = served.READER_INFLIGHT_BYTES // served.CHUNK_BYTES
        assert stats["reads_accepted"] + stats["refused"] == 40, stats
        # in flight, never past the bounds; READs whose sends the kernel's socket buffers took count no more, so how
        # many were accepted in all depends on the machine's buffers, not on kvxfer
        assert 1 <= stats["reads_active"] <= accepted, stats
        assert stats["bytes_in_flight"] <= served.READER_INFLIGHT_BYTES, stats
        assert set(stats["refused_by"]) == {"reader_bytes"} and stats["refused"] >= 1, stats
        assert stats["sends_in_flight_peak"] <= window, stats
        assert after - before < RSS_BOUND_MIB, f"source RSS {before:.0f} -> {after:.0f} MiB"
        print(f"source RSS {before:.0f} -> {after:.0f} MiB; accepted {stats['reads_accepted']}, refused "
              f"{stats['refused_by']}, sends in flight at most {stats['sends_in_flight_peak']}, "
              f"{_mib(stats['bytes_posted'])} posted")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = source.served()
            if stats["reads_active"] == 0 and stats["readers"] == 0:
                break
            time.sleep(0.2)
        assert (stats["reads_active"], stats["readers"], stats["sends_in_flight"], stats["bytes_in_flight"]) == \
            (0, 0, 0, 0), stats
        assert stats["readers_abandoned"] == 1 and stats["sends_abandoned"] <= window, stats
        pool = torch.full(source.shape, -1.0)
        reader = UcxBackend("next-reader", pool, BLOCKS, timeout_s=30)
        try:
            reader.begin_pull_blocks(source.meta, [1, 2], [1, 2], request_id="next").wait(30)
        finally:
            reader.close()
        assert torch.equal(pool[:, :, [1, 2]], _pool(source.shape)[:, :, [1, 2]])
    finally:
        if stalled is not None:
            stalled.kill()
            stalled.wait(30)
        source.close()


#: Socket buffers of a few KiB on both sides (UCX's own options): a 4 MiB READ's sends cannot all land in the kernel's
#: buffers, so a READ stays in flight until its reader takes its chunks, whatever the machine's autotuned sizes.
SMALL_SOCKET_BUFFERS = {"UCX_TCP_SNDBUF": "16K", "UCX_TCP_RCVBUF": "16K"}


def _wait_decided(source: Source, decided: int, timeout_s: float = 10) -> dict[str, Any]:
    """The source's served stats once it has accepted or refused ``decided`` READs."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = source.served()
        if stats["reads_accepted"] + stats["refused"] >= decided or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_readers_together_are_bounded_in_reads_served_and_sends_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Endpoints cost an attacker nothing, so the bounds hold in total too: with MAX_SERVES 4 (and 3 READs
    per reader), reader 0's 4th READ is refused at its own bound, reader 1's first READ is the 4th in flight
    and its second is refused at the total one, each refusal carries that bound's numbers, and no more than
    4 READs' bytes and sends are in flight.

    The readers take none of their chunks while they send (their sends complete without progress once
    connected), and the socket buffers are a few KiB (SMALL_SOCKET_BUFFERS), so every accepted READ is still
    in flight when the next one comes: the counts below are what the bounds decide, not the machine's timing."""
    source = Source({"MAX_SERVES": 4, "READER_READS": 3}, env=SMALL_SOCKET_BUFFERS)
    for name, value in SMALL_SOCKET_BUFFERS.items():
        monkeypatch.setenv(name, value)
    attackers: list[Attacker] = []
    try:
        attackers = [Attacker(source), Attacker(source)]
        too_large = np.array([[0, served.MAX_READ_BYTES + 1]], dtype=np.uint64)
        for attacker in attackers:  # connected both ways by one READ refused before any byte is sent
            attacker.read(too_large, 100)
            assert attacker.progress_until(lambda: len(attacker.refusals) == 1, 10), "no refusal to the warm-up READ"
        rows = np.array([[0, served.MAX_READ_BYTES]], dtype=np.uint64)
        for batch in range(1, 5):
            attackers[0].read(rows, batch)  # 3 accepted, the 4th refused: reader_reads
        stats = _wait_decided(source, 2 + 4)
        assert (stats["reads_accepted"], stats["reads_active"], stats["refused_by"]) == \
            (3, 3, {"read_too_large": 2, "reader_reads": 1}), stats
        for batch in range(5, 7):
            attackers[1].read(rows, batch)  # 1 accepted (4 in flight in all), the next refused: busy_reads
        stats = _wait_decided(source, 2 + 6)
        assert (stats["reads_accepted"], stats["reads_active"], stats["refused_by"]) == \
            (4, 4, {"read_too_large": 2, "reader_reads": 1, "busy_reads": 1}), stats
        assert stats["bytes_in_flight"] <= 4 * served.MAX_READ_BYTES, stats
        assert stats["sends_in_flight_peak"] <= 4 * served.MAX_READ_BYTES // served.CHUNK_BYTES, stats
        # each refusal reaches its reader (behind the chunks of its accepted READs) with its bound's numbers
        assert attackers[0].progress_until(lambda: len(attackers[0].refusals) == 2, 30), attackers[0].refusals
        assert attackers[0].refusals[1] == (6, 4, 3)  # reader_reads: READ 4, bound 3
        assert attackers[1].progress_until(lambda: len(attackers[1].refusals) == 2, 30), attackers[1].refusals
        assert attackers[1].refusals[1] == (9, 5, 4)  # busy_reads: READ 5 in flight in all, bound 4
    finally:
        for attacker in attackers:
            attacker.close()
        source.close()


SMALL = {"MAX_READ_BYTES": 1 << 20, "READER_INFLIGHT_BYTES": 2 << 20, "READER_READS": 4, "READER_SENDS": 16}


def _pool(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64).to(torch.float32).reshape(shape)


def test_a_pull_larger_than_the_bounds_is_paced_by_its_reader_and_lands_byte_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With every bound small (READs of 1 MiB; 4 READs, 2 MiB and 16 sends in flight per reader), a pull of
    the whole 16 MiB pool and a scattered one land byte-exact: the reader sends READs as earlier ones land,
    within half the source's bounds, and the source refuses none."""
    source = Source(SMALL)
    for name, value in SMALL.items():
        monkeypatch.setattr(served, name, value)
    monkeypatch.setattr(served, "READ_AHEAD_READS", SMALL["READER_READS"] // 2)
    monkeypatch.setattr(served, "READ_AHEAD_BYTES", SMALL["READER_INFLIGHT_BYTES"] // 2)
    monkeypatch.setattr(served, "READ_AHEAD_SENDS", SMALL["READER_SENDS"] // 2)
    reader = None
    try:
        want = _pool(source.shape)
        pool = torch.full(source.shape, -1.0)
        reader = UcxBackend("paced-reader", pool, BLOCKS, timeout_s=60)
        handle = reader.begin_pull_blocks(source.meta, list(range(BLOCKS)), list(range(BLOCKS)), request_id="all")
        handle.wait(60)
        assert handle.path == "peer-error-mode"
        assert torch.equal(pool, want)
        pool.fill_(-1.0)
        src_ids, dst_ids = [63, 5, 6, 7, 40, 0], [0, 1, 2, 3, 9, 63]
        reader.begin_pull_blocks(source.meta, src_ids, dst_ids, request_id="scattered").wait(60)
        assert torch.equal(pool[:, :, dst_ids], want[:, :, src_ids])
        assert bool((pool[:, :, [b for b in range(BLOCKS) if b not in dst_ids]] == -1.0).all())
        deadline = time.monotonic() + 10
        done: list[str] = []
        while len(done) < 2 and time.monotonic() < deadline:
            done += source.ask("drain")["done"]
        assert sorted(done) == ["all", "scattered"]
        stats = source.served()
        assert stats["refused"] == 0 and stats["reads_accepted"] >= POOL_MIB, stats
        assert stats["sends_in_flight_peak"] <= SMALL["READER_SENDS"], stats
    finally:
        if reader is not None:
            reader.close()
        source.close()


def test_a_reader_asking_more_than_its_source_allows_fails_with_the_sources_reason() -> None:
    """A reader whose READs are larger than its source allows (another version, other settings) is refused,
    and the pull fails with the source's reason in words, before any byte of that READ is sent; a pull
    within the bound then works."""
    source = Source({"MAX_READ_BYTES": 1 << 20})
    reader = None
    try:
        pool = torch.full(source.shape, -1.0)
        reader = UcxBackend("greedy-reader", pool, BLOCKS, timeout_s=30)
        with pytest.raises(TransferError) as failure:
            reader.begin_pull_blocks(source.meta, list(range(BLOCKS)), list(range(BLOCKS)), request_id="big").wait(30)
        text = str(failure.value)
        assert "the source refused the served read (read_too_large)" in text, text
        assert "a READ may ask for at most 1048576 (served.MAX_READ_BYTES)" in text, text
        stats = source.served()
        assert stats["refused_by"].get("read_too_large", 0) >= 1, stats
        reader.begin_pull_blocks(source.meta, [3], [3], request_id="small").wait(30)
        assert torch.equal(pool[:, :, 3], _pool(source.shape)[:, :, 3])
    finally:
        if reader is not None:
            reader.close()
        source.close()
