"""The vLLM connector's pure parts, without vLLM: tickets, leases, config, handshake, side channel, KV regions.

The connector itself is tested inside real vLLM in ``test_vllm_connector.py``.
"""

from __future__ import annotations

import copy
import json
import socket
import time

import pytest
import torch

from kvxfer.errors import GeometryError, LayoutError, PeerMetadataError
from kvxfer.handoff.guard import lease_holds
from kvxfer.integrations.vllm.config import ConnectorConfigError, KvxferConfig
from kvxfer.integrations.vllm.handshake import (EngineLayout, build_handshake, check_compatible, parse_handshake,
                                                rank_agent_name)
from kvxfer.integrations.vllm.kv_buffers import kv_regions, layout_signature
from kvxfer.handoff.guard import LeaseSlots
from kvxfer.integrations.vllm.side_channel import HandshakeListener, fetch_handshake
from kvxfer.integrations.vllm.tickets import derive_ticket_key, parse_ticket, prompt_digest, sign_ticket

KEY = derive_ticket_key(b"s" * 32)
PROMPT = list(range(1, 80))


def ticket(**changes):
    params = dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=[[4, 5, 9]], remote_engine_id="e1",
                  remote_request_id="r1", remote_host="127.0.0.1", remote_port=5555, tp_size=1,
                  remote_num_tokens=len(PROMPT), transfer_mode="pull")
    params.update(changes)
    return sign_ticket(params, {"instance": "i1", "slot": 3, "lease": 7, "backend": "nixl",
                                "prompt": prompt_digest(PROMPT, len(PROMPT))}, KEY)


def test_ticket_round_trip_and_json():
    t = parse_ticket(json.loads(json.dumps(ticket())))  # a proxy carries it as JSON
    t.verify(KEY)
    t.check_prompt(PROMPT)
    assert (t.block_ids, t.slot, t.lease, t.engine_id) == ((4, 5, 9), 3, 7, "e1")


@pytest.mark.parametrize("field,value", [
    ("remote_block_ids", [[4, 5, 10]]), ("remote_engine_id", "e2"), ("remote_request_id", "r2"),
    ("remote_host", "10.0.0.9"), ("remote_port", 5556), ("remote_num_tokens", 40),
])
def test_altered_ticket_fields_are_refused(field, value):
    params = ticket()
    params[field] = value
    with pytest.raises(PeerMetadataError, match="not signed"):
        parse_ticket(params).verify(KEY)


@pytest.mark.parametrize("field,value", [("slot", 4), ("lease", 8), ("instance", "i2"), ("prompt", "0" * 64)])
def test_altered_lease_fields_are_refused(field, value):
    params = ticket()
    params["kvxfer"] = dict(params["kvxfer"], **{field: value})
    with pytest.raises(PeerMetadataError, match="not signed"):
        parse_ticket(params).verify(KEY)


def test_wrong_key_and_wrong_prompt_are_refused():
    with pytest.raises(PeerMetadataError, match="not signed"):
        parse_ticket(ticket()).verify(derive_ticket_key(b"t" * 32))
    with pytest.raises(PeerMetadataError, match="another prompt"):
        parse_ticket(ticket()).check_prompt(PROMPT[:-1] + [999])
    with pytest.raises(PeerMetadataError, match="another prompt"):
        parse_ticket(ticket()).check_prompt(PROMPT[:10])


@pytest.mark.parametrize("mutate,match", [
    (lambda p: p.pop("kvxfer"), "no 'kvxfer' field"),
    (lambda p: p.__setitem__("remote_port", "5555"), "remote_port"),
    (lambda p: p.__setitem__("remote_block_ids", [[1], [2]]), "KV cache groups"),
    (lambda p: p.__setitem__("remote_block_ids", [["x"]]), "not a block id"),
    (lambda p: p.__setitem__("remote_block_ids", [[4, True]]), "not a block id"),
    (lambda p: p.__setitem__("remote_block_ids", [[4, -1]]), "not a block id"),
    (lambda p: p.__setitem__("remote_block_ids", [[4, 1 << 40]]), "not a block id"),
    (lambda p: p.__setitem__("remote_block_ids", list(range(2_000_000))), "list of block ids"),
    (lambda p: p["kvxfer"].__setitem__("v", 9), "speaks 1"),
    (lambda p: p["kvxfer"].__setitem__("slot", -1), "slot"),
    (lambda p: p.__setitem__("remote_engine_id", "x" * 10_000), "remote_engine_id"),
])
def test_malformed_tickets_name_the_field(mutate, match):
    params = copy.deepcopy(ticket())
    mutate(params)
    with pytest.raises(PeerMetadataError, match=match):
        parse_ticket(params)


def test_ticket_signature_bytes_are_json_dumps_bytes():
    """The signed bytes come from msgspec (fast, on the engine's step) but are exactly the sorted
    compact ``json.dumps`` an earlier kvxfer signed, so both versions verify each other's tickets;
    what msgspec would write otherwise (non-ASCII, keys that are not strings) is left to json."""
    from kvxfer.integrations.vllm.tickets import _canonical

    def legacy(params):
        body = {name: params.get(name) for name in ("remote_block_ids", "remote_engine_id", "remote_request_id",
                                                    "remote_host", "remote_port", "tp_size", "remote_num_tokens")}
        body["kvxfer"] = {k: v for k, v in params["kvxfer"].items() if k != "sig"}
        return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    for params in (ticket(), ticket(remote_request_id="réq-ü"), ticket(remote_block_ids=[list(range(1000, 1070))]),
                   ticket(remote_engine_id="e\ud800")):
        assert _canonical(params, params["kvxfer"]) == legacy(params)
        parse_ticket(params).verify(KEY)
    odd = ticket()
    odd["kvxfer"] = dict(odd["kvxfer"], extra={1: "int key"})
    assert _canonical(odd, odd["kvxfer"]) == legacy(odd)
    for extra in (1e16, 1e-05, None, True, [1.5], "r\x7f"):  # msgspec would write some of these otherwise
        odd["kvxfer"] = dict(ticket()["kvxfer"], extra=extra)
        assert _canonical(odd, odd["kvxfer"]) == legacy(odd), extra
    assert _canonical(ticket(remote_request_id="r\x7f"), ticket()["kvxfer"]) == legacy(ticket(remote_request_id="r\x7f"))


def test_a_ticket_holding_what_no_producer_signs_is_refused_with_words():
    """NaN (JSON parsers accept it) beside a non-ASCII value, or nesting past json's depth, in a forged
    ticket's extra fields: a PeerMetadataError the receiver reports, never a ValueError it does not catch."""
    params = ticket()
    params["kvxfer"] = dict(params["kvxfer"], x=float("nan"), y="é")
    with pytest.raises(PeerMetadataError, match="values no producer signs"):
        parse_ticket(params).verify(KEY)
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    params["kvxfer"] = dict(ticket()["kvxfer"], x=deep)
    with pytest.raises(PeerMetadataError, match="values no producer signs"):
        parse_ticket(params).verify(KEY)


def test_flat_block_ids_are_accepted():
    assert parse_ticket(ticket(remote_block_ids=[4, 5, 9])).block_ids == (4, 5, 9)


def test_lease_rule():
    assert lease_holds(7, 7)        # pinned
    assert lease_holds(0, 7)        # not pinned yet: vLLM still holds the blocks
    assert lease_holds(-6, 7) and lease_holds(6, 7)  # an older export of the slot
    assert not lease_holds(-7, 7)   # released
    assert not lease_holds(8, 7) and not lease_holds(-9, 7)  # the slot went to a later export
    slots = LeaseSlots(2)
    a, b = slots.take(), slots.take()
    assert slots.take() is None and a[1] < b[1]
    slots.give_back(a[0])
    c = slots.take()
    assert c[0] == a[0] and c[1] > b[1]  # a reused slot gets a larger lease


def test_config_errors_name_the_key():
    with pytest.raises(ConnectorConfigError, match="backends"):
        KvxferConfig.from_extra_config({"backends": ["UCX"]})  # NixlConnector's key, not ours
    with pytest.raises(ConnectorConfigError, match="'backend'"):
        KvxferConfig.from_extra_config({"backend": "nccl"})
    with pytest.raises(ConnectorConfigError, match="pin_grace_s"):
        KvxferConfig.from_extra_config({"pin_grace_s": 0})
    assert KvxferConfig.from_extra_config({"backend": "UCX", "kv_ip": "0.0.0.0"}).remote_host == "127.0.0.1"


def test_the_backend_is_chosen_by_what_its_class_can_do_not_by_name(monkeypatch):
    """``backend``: any registered class that reads another process's pool one-sided qualifies; the error names
    why a class does not and which do (``connector_backends``, from the registry)."""
    import kvxfer.backends as registry
    from kvxfer.integrations.vllm.config import backend_problem, connector_backends

    assert connector_backends() == ["nixl", "ucx"]
    with pytest.raises(ConnectorConfigError, match="reads only its own process's memory.*one of \\['nixl', 'ucx'\\]"):
        KvxferConfig.from_extra_config({"backend": "local"})
    with pytest.raises(ConnectorConfigError, match="pushes blocks from the prefill"):
        KvxferConfig.from_extra_config({"backend": "nccl"})
    with pytest.raises(ConnectorConfigError, match="unknown backend 'rdma-x'"):
        KvxferConfig.from_extra_config({"backend": "rdma-x"})
    real = registry.construct_kv_transfer_backend_class

    class Puller:  # a third party's one-sided backend: only its answers matter
        is_push, reads_other_processes = False, True

    monkeypatch.setattr(registry, "construct_kv_transfer_backend_class",
                        lambda name: Puller if name == "rdma-x" else real(name))
    assert backend_problem("rdma-x") is None
    assert KvxferConfig.from_extra_config({"backend": "rdma-x"}).backend_name == "rdma-x"


def test_modules_log_under_their_own_names():
    """``logging.getLogger(__name__)`` in every module of the package: a name typed by hand drifts."""
    from pathlib import Path

    import kvxfer.integrations.vllm as package

    typed = [f.name for f in Path(package.__file__).parent.glob("*.py") if 'getLogger("' in f.read_text()]
    assert typed == []


def layout(tp=1, heads=2, block=32, num_blocks=1024):
    return EngineLayout(model={"num_layers": 4, "num_kv_heads": heads, "head_size": 64, "dtype": "bfloat16",
                               "kv_dtype": "auto"}, tp_size=tp, pp_size=1, block_size=block,
                        regions=({"layers": 4, "layer_shape": [None, heads // tp, block, 128], "blocks_axis": 0,
                                  "dtype": "bfloat16"},), num_blocks=num_blocks)


def handshake_doc(key=None, lay=None):
    lay = lay or layout()
    # with several ranks each rank's metas name it (as a worker's agent name does)
    named = {r: {"agent_name": rank_agent_name("e1", r, lay.tp_size)} if lay.tp_size > 1 else {}
             for r in range(lay.tp_size)}
    ranks = {r: {"kv": [{"m": r, **named[r]}], "lease": {"l": r, **named[r]}} for r in range(lay.tp_size)}
    return json.loads(build_handshake(engine_id="e1", instance="i1", backend="nixl", layout=lay, ranks=ranks,
                                      ticket_key=None if key else b"k" * 32, cluster_key=key))


def test_handshake_sealed_signed_and_checked():
    hs = parse_handshake(handshake_doc(), None)
    assert hs.ticket_key == b"k" * 32 and hs.rank_kv_metas == (({"m": 0},),)
    signed = handshake_doc(key=b"s" * 32)
    assert parse_handshake(signed, b"s" * 32).ticket_key is None
    with pytest.raises(PeerMetadataError, match="not signed"):
        parse_handshake(signed, b"t" * 32)
    altered = handshake_doc()
    altered["ranks"][0]["lease"] = {"l": 9}
    with pytest.raises(PeerMetadataError, match="integrity"):
        parse_handshake(altered, None)
    foreign = handshake_doc()
    foreign["host_id"] = "another-host"
    with pytest.raises(PeerMetadataError):
        parse_handshake(foreign, None)


def test_tp_mismatch_is_refused_naming_both_layouts():
    remote = parse_handshake(handshake_doc(lay=layout(tp=2)), None)
    with pytest.raises(LayoutError) as err:
        check_compatible(layout(tp=1), "nixl", remote)
    text = str(err.value)
    assert "prefill: TP 2" in text and "decode: TP 1" in text and "1 per rank" in text and "2 per rank" in text
    with pytest.raises(LayoutError, match="prefill block_size 32, decode block_size 16"):  # decode smaller
        check_compatible(layout(block=16), "nixl", parse_handshake(handshake_doc(), None))
    with pytest.raises(LayoutError, match="backend"):
        check_compatible(layout(), "ucx", parse_handshake(handshake_doc(), None))
    check_compatible(layout(), "nixl", parse_handshake(handshake_doc(), None))


def _other_local_address():
    """A non-loopback address of this host, if it has one."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))
        address = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if address.startswith("127.") else address


def test_side_channel_serves_and_refuses():
    doc = json.dumps({"hello": 1}).encode()
    listener = HandshakeListener("0.0.0.0", 0, lambda: doc, local_peers_only=True)
    try:
        assert fetch_handshake("127.0.0.1", listener.port, 5.0) == {"hello": 1}
        other = _other_local_address()
        if other is not None:  # a peer that is not on loopback is refused without a cluster secret
            with pytest.raises(PeerMetadataError, match="same-host"):
                fetch_handshake(other, listener.port, 5.0)
        with pytest.raises(OSError, match="kv_port"):
            HandshakeListener("0.0.0.0", listener.port, lambda: doc, local_peers_only=True)
    finally:
        listener.close()
    started = time.monotonic()
    with pytest.raises(PeerMetadataError, match="refused"):  # a closed port answers at once: no timeout waited
        fetch_handshake("127.0.0.1", listener.port, 5.0)
    assert time.monotonic() - started < 1.0


def test_ticket_block_ids_bounded():
    """A forged ticket's id list is bounded by the tokens it claims before any id is walked: 2**20 ids
    for 79 tokens are refused in far less than the 0.25 s a walk took."""
    params = ticket(remote_block_ids=[list(range(1 << 20))])
    started = time.perf_counter()
    with pytest.raises(PeerMetadataError, match="more than the 4"):
        parse_ticket(params, block_size=32)
    with pytest.raises(PeerMetadataError, match="remote_num_tokens"):
        parse_ticket(ticket(remote_num_tokens=10_000), block_size=32, max_tokens=len(PROMPT))
    assert time.perf_counter() - started < 0.02
    assert parse_ticket(ticket(remote_block_ids=[[1, 2, 3, 4]]), block_size=32).block_ids == (1, 2, 3, 4)


def test_pools_of_different_sizes_are_compatible():
    """vLLM sizes each pool by profiling: the number of blocks is not compared, everything else is."""
    small, large = kv_regions({"l0": torch.zeros(100, 2, 32, 128)}, 100), kv_regions({"l0": torch.zeros(300, 2, 32, 128)}, 300)
    assert small[0].signature == large[0].signature
    check_compatible(layout(num_blocks=100), "nixl", parse_handshake(handshake_doc(lay=layout(num_blocks=300)), None))
    with pytest.raises(LayoutError, match="model"):  # what a block holds still has to match
        check_compatible(layout(heads=4, tp=2), "nixl", parse_handshake(handshake_doc(lay=layout(heads=2, tp=2)), None))


def test_kv_regions_one_registration_for_layers_of_one_buffer():
    # vLLM's CPU layout: per layer [blocks, heads, block_size, 2*head], layers back to back in one buffer
    buffer = torch.zeros(4, 100, 2, 32, 128, dtype=torch.bfloat16)
    caches = {f"model.layers.{i}.attn": buffer[i] for i in range(4)}
    (region,) = kv_regions(caches, 100)
    # registered one slab per head (id = block * heads + head), so different TP reads a head range
    assert region.view.shape == (4, 100 * 2, 32 * 128) and region.view.data_ptr() == buffer.data_ptr()
    assert region.head_slabs == 2 and layout_signature([region], 32)["num_blocks"] == 100
    buffer[2, 7, 1].fill_(3)
    assert region.view[2, 7 * 2 + 1].eq(3).all() and region.view[2, 7 * 2].eq(0).all()
    # flash-attention layout, one allocation per layer: [2, blocks, block_size, heads, head]
    caches = {f"l{i}": torch.zeros(2, 100, 16, 2, 64) for i in range(3)}
    regions = kv_regions(caches, 100)
    assert len(regions) == 3 and regions[0].view.shape == (2, 100, 16 * 2 * 64)
    with pytest.raises(GeometryError, match="exactly one"):
        kv_regions({"l0": torch.zeros(100, 100, 4)}, 100)
    with pytest.raises(GeometryError, match="not dense"):  # a strided slice: gaps between its elements
        kv_regions({"l0": torch.zeros(100, 8, 4)[:, :, :2]}, 100)
    # a permutation of a contiguous tensor (vLLM 0.32's NHD views) is dense: one block is one slice
    (region,) = kv_regions({"l0": torch.zeros(100, 4, 8).transpose(1, 2)}, 100)
    assert region.view.shape == (1, 100, 32) and region.signature["layout"] == "order021"


def test_a_slab_as_long_as_the_slab_count_is_registered_and_read_byte_exact():
    """A tiny Llama's CPU pool: 1,024 blocks x 4 heads = 4,096 slabs of 32 x 2 x 64 = 4,096 elements.
    Registered as ``[layers, 4096, 4096]`` its blocks axis was ambiguous (registration refused, found by
    ``kvxfer bench-vllm``); the slab is now two axes, and a read into a pool of another size is exact."""
    from kvxfer.backends import construct_kv_transfer_backend_class

    cls = construct_kv_transfer_backend_class("local")
    pools = {n: torch.randn(2, n, 4, 32, 128).to(torch.bfloat16) for n in (1024, 600)}
    regions = {n: kv_regions({f"l{i}": pools[n][i] for i in range(2)}, n)[0] for n in pools}
    assert regions[1024].view.shape == (2, 4096, 2048, 2) and regions[600].view.shape == (2, 2400, 4096)
    src, dst = (cls(f"slab-{n}", regions[n].view, n * 4) for n in (1024, 600))
    try:
        src_ids, dst_ids = [4 * 1000 + h for h in range(4)], [4 * 7 + h for h in range(4)]  # block 1000 -> 7
        dst.begin_pull_blocks(src.export_meta(), src_ids, dst_ids).wait()
        assert torch.equal(pools[600][:, 7].view(torch.int16), pools[1024][:, 1000].view(torch.int16))
    finally:
        src.close()
        dst.close()


def test_step_hold_counts_the_connector_calls_not_the_forward_between_them():
    """``step_hold_max_s`` is what the connector's two calls of a step cost (start_load, then
    transfer_results after the model's forward): a slow forward (a first one compiles) is not ours."""
    import subprocess

    from tests.support.vllm_support import require_vllm_python

    script = """
import time, types
from kvxfer.integrations.vllm.worker import KvxferWorker
worker = KvxferWorker.__new__(KvxferWorker)
worker.sender = worker.receiver = None
worker._step_spent_s = worker._step_hold_max_s = 0.0
worker.asleep, worker._held_results = False, (set(), set(), set())
worker.start_load(types.SimpleNamespace(sends=[], loads=[]))
time.sleep(0.5)  # the model's forward
worker.transfer_results()
print(worker._step_hold_max_s)
"""
    run = subprocess.run([require_vllm_python(), "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert 0.0 <= float(run.stdout.split()[-1]) < 0.25, run.stdout


def test_a_fetch_that_cannot_resolve_or_parse_fails_alone_and_the_fetcher_serves_on():
    """Peer input that broke the decode's handshake fetcher (review, 2026-12-05): a ticket's host
    like "a..b" raised UnicodeError in the resolver (not an OSError), leaving its fetch pending for
    good, and 32 of them refused every later fetch; a producer answering with JSON nested deeper
    than the parser goes raised RecursionError on the fetcher's thread and ended it. Now each fails
    its own fetch, in time, and the same fetcher then fetches a real handshake."""
    import socket
    import struct
    import threading

    from kvxfer.integrations.vllm.side_channel import MAX_FETCHES, HandshakeFetcher

    deep = b"[" * 200_000 + b"]" * 200_000
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer_nested() -> None:  # a real producer's framing, a hostile body
        conn, _ = server.accept()
        with conn:
            conn.recv(64)
            conn.sendall(struct.pack(">Q", len(deep)) + deep)

    threading.Thread(target=answer_nested, daemon=True).start()
    doc = json.dumps({"hello": 2}).encode()
    listener = HandshakeListener("127.0.0.1", 0, lambda: doc, local_peers_only=True)
    fetcher = HandshakeFetcher()
    results: list = []
    done = threading.Event()

    def collect(document, error) -> None:
        results.append((document, error))
        if len(results) == MAX_FETCHES + 2:
            done.set()

    try:
        for i in range(MAX_FETCHES):
            fetcher.fetch(f"a..b{i}", 1, 5.0, collect)
        assert done.wait(0) is False
        deadline = time.monotonic() + 10
        while fetcher.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fetcher.in_flight == 0  # none left pending
        fetcher.fetch("127.0.0.1", port, 5.0, collect)
        fetcher.fetch("127.0.0.1", listener.port, 5.0, collect)
        assert done.wait(10)
    finally:
        fetcher.close()
        listener.close()
        server.close()
    errors = [str(e) for d, e in results[:MAX_FETCHES]]
    assert all("cannot resolve prefill host 'a..b" in e for e in errors), errors[:2]
    assert {str(e) for d, e in results[MAX_FETCHES:] if e} == {f"the prefill instance at 127.0.0.1:{port} answered "
                                                                "with a malformed handshake"}, results[MAX_FETCHES:]
    assert [d for d, e in results[MAX_FETCHES:] if d] == [{"hello": 2}]


def test_a_ticket_naming_another_instance_refetches_a_handshake_only_once_it_is_not_fresh():
    """Without a cluster key a ticket is checked only after the handshake, so a forged ticket naming a
    made-up producer instance must not flush a real producer's fresh handshake (every real load would
    then wait for a fetch): a refetch is asked only of a handshake older than REFETCH_AFTER_S (a
    restarted vLLM takes far longer than that to come back)."""
    from kvxfer.integrations.vllm.handshake_cache import REFETCH_AFTER_S, HandshakeCache, _Entry

    now = [100.0]
    cache = HandshakeCache(5.0, None, False, clock=lambda: now[0])
    try:
        cache._entries[("127.0.0.1", 9)] = _Entry(started=99.0, finished=100.0)
        now[0] = 100.0 + REFETCH_AFTER_S / 2
        assert cache.invalidate("127.0.0.1", 9) is False and ("127.0.0.1", 9) in cache._entries
        now[0] = 100.0 + REFETCH_AFTER_S + 0.1
        assert cache.invalidate("127.0.0.1", 9) is True and ("127.0.0.1", 9) not in cache._entries
        cache._entries[("127.0.0.1", 9)] = _Entry(started=now[0])  # a fetch in flight is never dropped
        now[0] += 60
        assert cache.invalidate("127.0.0.1", 9) is False
    finally:
        cache.close()
