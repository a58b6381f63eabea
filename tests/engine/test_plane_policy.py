"""Both control planes make the same decision from the same fleet and the same requests (issue 22, item 1).

Policy (admission, prefill choice, decode choice, compatibility) is written once, in
``control_plane.policy``; each plane turns what it knows into the policy's inputs. This
checks the whole chain on a table: the real ``Coordinator`` (in this process; its messages
are observed on their way out, nobody is connected) against the real etcd plane on a real,
secured etcd (``EtcdPlane.route`` over a fresh snapshot and the decodes' published load
figures, ``EtcdGenerationClient.submit`` for admission and prefill choice). Each row is a
fleet and a sequence of steps; after every step both planes must agree.
"""

from __future__ import annotations

import itertools
import os
import socket

import pytest

from engine_integration.control_plane import policy
from engine_integration.control_plane.etcd.client import EtcdGenerationClient
from engine_integration.control_plane.etcd.plane import EtcdPlane
from engine_integration.control_plane.etcd.records import HandoffState
from engine_integration.control_plane.etcd.requests import stats_body
from engine_integration.control_plane.zmq import wire
from engine_integration.control_plane.zmq.coordinator import Coordinator, CoordinatorConfig
from kvxfer.meta.seal import HOST_FIELD, host_identity, seal_meta

from etcd_support import Fleet, secured_etcd

pytestmark = [pytest.mark.usefixtures("etcd_required"), pytest.mark.timeout(120)]

SECRET = "plane-policy-test-secret-0123456789"
TPB = 4
GEOMETRY = {"schema_version": 1, "backend": "local", "dtype": "float32", "element_size": 4, "tokens_per_block": TPB,
            "heads_per_partition": 2, "head_dim": 16, "num_outer": 4, "bytes_per_slice": 512}
CLIENT = b"client/policy"
_clusters = itertools.count()


etcd = pytest.fixture(scope="module", name="etcd")(secured_etcd)


class Planes:
    """One fleet on both planes: engines registered with an in-process coordinator and in etcd."""

    def __init__(self, etcd, engines: list[tuple[str, str, int]], prefix_routing: bool = True) -> None:
        server, password = etcd
        self.fleet = Fleet(endpoint=server.endpoint, user="kvxfer", password=password, cluster_key=os.urandom(32),
                           cluster=f"policy{next(_clusters)}")
        self.coord = Coordinator(CoordinatorConfig(secret=SECRET, prefix_routing=prefix_routing))
        self.sent: list[tuple[bytes, wire.Msg]] = []
        send = self.coord.send
        self.coord.send = lambda zmq_id, msg: (self.sent.append((zmq_id, msg)), send(zmq_id, msg))  # observe
        self.stores, self.records, self.rids = {}, {}, {}
        self.zmq_ids: dict[str, bytes] = {}      # name -> its current incarnation's connection
        self.engines = {name: (role, capacity) for name, role, capacity in engines}
        for name, role, capacity in engines:
            self.stores[name] = self.fleet.plane()
            self.start(name, 1)
        self.prefill = next(n for n, role, _ in engines if role == "prefill")
        self.etcd_plane = EtcdPlane(self.stores[self.prefill], prefix_routing=prefix_routing)
        self.client = EtcdGenerationClient(self.fleet.plane())
        self.cids = itertools.count(1)

    def start(self, name: str, incarnation: int) -> None:
        """Register ``name`` with both planes (again: a new incarnation, as a restarted engine)."""
        role, capacity = self.engines[name]
        self.zmq_ids[name] = f"{name}/{incarnation}".encode()
        self.arrive(self.zmq_ids[name], wire.Register(role, name, str(incarnation), os.getpid(), socket.gethostname(),
                                                      "fp", [GEOMETRY], capacity))
        meta = seal_meta({**GEOMETRY, "agent": name, HOST_FIELD: host_identity()}, self.fleet.cluster_key)
        self.records[name] = self.stores[name].register(name=name, role=role, transfer_meta=[meta],
                                                        capacity_blocks=capacity, extra={"fingerprint": "fp"})

    def restart(self, name: str) -> None:
        """``name`` says goodbye and registers again: a new incarnation, with an empty cache."""
        self.arrive(self.zmq_ids[name], wire.Goodbye("restarting"))
        self.start(name, int(self.zmq_ids[name].rsplit(b"/", 1)[1]) + 1)

    def arrive(self, zmq_id: bytes, msg: wire.Msg) -> None:
        """``msg`` from ``zmq_id``, as the coordinator gets it off the wire (decoded and schema-checked)."""
        self.coord.handle(zmq_id, wire.decode(wire.encode(msg)))

    def close(self) -> None:
        self.client.close()
        for store in self.stores.values():
            store.deregister()
            store.close()
        self.client.store.close()
        self.coord.channel.close()
        self.coord.ctx.term()

    # --- the steps ------------------------------------------------------------------------
    def report(self, decode: str, free: int, evictions: int = 0, evicted: tuple[int, ...] = ()) -> None:
        """A decode's load figure (and the newest hashes its pool evicted): a heartbeat to the coordinator,
        a stats record in etcd."""
        self.arrive(self.zmq_ids[decode], wire.Heartbeat(free, 0, 0, 0, 0, evictions=evictions,
                                                         evicted=list(evicted)))
        store, rec = self.stores[decode], self.records[decode]
        store.put_record(store.layout.stat(decode), stats_body(decode, rec.incarnation, rec.lease,
                                                               {"free_blocks": free, "evictions": evictions},
                                                               evicted), rec.lease)

    def submit(self, prompt: list[int], max_new: int) -> tuple[str, str]:
        """(coordinator's answer, etcd client's answer): the prefill chosen, or the refusal."""
        self.sent.clear()
        self.arrive(CLIENT, wire.Submit(next(self.cids), prompt, max_new))
        coordinator = next((m.error if isinstance(m, wire.Result) else zmq_id.decode().rsplit("/", 1)[0])
                           for zmq_id, m in self.sent
                           if isinstance(m, (wire.Result, wire.AddRequest)))
        rid = self.client.submit(prompt, max_new)
        result = self.client._results.pop(rid, None)
        etcd = result.error if result is not None else self.client._pending[rid].prefill
        return coordinator, etcd

    def route(self, label: str, prompt_len: int, hashes: list[int], max_new: int) -> tuple[str, str]:
        """(coordinator's decode, etcd plane's decode) for one prefilled request ('-' where none can hold it)."""
        prompt = [(7 * i + prompt_len) % 256 for i in range(prompt_len)]
        own = int.from_bytes(label.encode(), "big") * 1000   # hashes of this request's own blocks: shared with none
        hashes = hashes[: prompt_len // TPB] + [own + i for i in range(len(hashes), prompt_len // TPB)]
        blocks = list(range(-(-prompt_len // TPB)))
        self.sent.clear()
        self.arrive(CLIENT, wire.Submit(next(self.cids), prompt, max_new))
        add = next(m for _, m in self.sent if isinstance(m, wire.AddRequest))
        self.sent.clear()
        descriptor = {"request_id": add.request_id, "source": self.prefill, "meta_index": 0, "block_ids": blocks,
                      "block_hashes": hashes, "prompt": prompt, "resume_tokens": [1]}
        self.arrive(self.zmq_ids[self.prefill], wire.HandoffReady(add.request_id, descriptor, 0.01))
        coordinator = next((zmq_id.decode().rsplit("/", 1)[0] for zmq_id, m in self.sent
                            if isinstance(m, wire.StartDecode)), "-")

        store = self.stores[self.prefill]
        view = store.snapshot()
        self.etcd_plane.refresh_loads(view)
        decode = self.etcd_plane.route(view, hashes, prompt_len + max_new - 1)
        if decode is not None:
            store.publish_handoff(label, reader=decode.name, reader_incarnation=decode.incarnation, descriptor={})
            self.etcd_plane.routed(decode, hashes, policy.reserved_blocks(prompt_len + max_new - 1, TPB))
        self.rids[label] = (add.request_id, coordinator, len(blocks))
        return coordinator, decode.name if decode is not None else "-"

    def pulled(self, label: str) -> None:
        """The routed decode has committed the pull (``TransferReady``; ``READ_DONE`` in etcd)."""
        rid, decode, blocks = self.rids[label]
        self.arrive(self.zmq_ids[decode], wire.TransferReady(rid, 0, blocks))
        self.stores[decode].set_reader_state(self.prefill, label, HandoffState.READ_DONE,
                                             source_incarnation=self.records[self.prefill].incarnation)


P, D = "prefill", "decode"
# (fleet: (name, role, capacity blocks), steps, the decisions both planes must make[, prefix routing on])
TABLE = [
    ("most free blocks wins",
     [("p0", P, 256), ("d-a", D, 64), ("d-b", D, 64)],
     [("report", "d-a", 10), ("report", "d-b", 60), ("route", "r1", 9, [1, 2], 4)],
     ["d-b"]),
    ("an expected cached prefix beats room",
     [("p0", P, 256), ("d-a", D, 64), ("d-b", D, 64)],
     [("report", "d-a", 10), ("report", "d-b", 60), ("route", "r1", 9, [1, 2], 4),
      ("report", "d-a", 100), ("report", "d-b", 50),
      ("route", "r2", 13, [1, 2, 3], 4),    # shares two blocks with r1: d-b, although d-a has more room
      ("route", "r3", 9, [7, 8], 4)],       # shares nothing: the room decides
     ["d-b", "d-b", "d-a"]),
    ("blocks routed since the last figure count against the room",
     [("p0", P, 256), ("d-a", D, 64), ("d-b", D, 64)],
     [("report", "d-a", 40), ("report", "d-b", 38), ("route", "r1", 16, [11, 12, 13, 14], 4),
      ("route", "r2", 16, [21, 22, 23, 24], 4), ("route", "r3", 16, [31, 32, 33, 34], 4)],
     ["d-a", "d-b", "d-a"]),     # each takes 5 blocks (19 tokens): 40 -> 35 < 38; 38 -> 33 < 35
    ("a pool too small is never chosen, however much room it reports",
     [("p0", P, 256), ("d-small", D, 4), ("d-big", D, 64)],
     [("report", "d-small", 4), ("report", "d-big", 2), ("route", "r1", 9, [1, 2], 12),
      ("route", "r2", 2, [], 2)],   # fits both: the small one has more room
     ["d-big", "d-small"]),
    ("equal room: fewer pulls pending, then the name",
     [("p0", P, 256), ("d-b", D, 64), ("d-a", D, 64)],
     [("report", "d-a", 60), ("report", "d-b", 60), ("route", "r1", 5, [], 2),
      ("report", "d-a", 60),                  # room equal again, but r1 is still pulling on d-a
      ("route", "r2", 5, [], 2), ("report", "d-b", 60), ("pulled", "r1"),
      ("route", "r3", 5, [], 2)],             # r2 still pending on d-b: d-a
     ["d-a", "d-b", "d-a"]),
    ("the prefix decode while it has room, then the least loaded one",
     [("p0", P, 256), ("d-a", D, 64), ("d-b", D, 64)],
     [("report", "d-a", 40), ("report", "d-b", 39), ("route", "r1", 9, [1, 2], 4),
      ("report", "d-a", 4),                 # d-a nearly full
      ("route", "r2", 13, [1, 2, 3], 4),    # holds 4 blocks <= 4 free: still d-a, for its cached prefix
      ("route", "r3", 13, [1, 2, 4], 4)],   # 0 left on d-a, 4 needed: falls back to d-b
     ["d-a", "d-a", "d-b"]),
    ("hashes a decode reports evicted are no longer expected there",
     [("p0", P, 256), ("d-a", D, 64), ("d-b", D, 64)],
     [("report", "d-a", 60), ("report", "d-b", 59), ("route", "r1", 9, [1, 2], 4),
      ("report", "d-a", 50), ("report", "d-b", 60), ("route", "r2", 13, [1, 2, 3], 4),   # the prefix beats room
      ("report", "d-a", 50, 1, (1,)),      # d-a evicted the family's first block: the chain is gone
      ("route", "r3", 13, [1, 2, 5], 4)],
     ["d-a", "d-a", "d-b"]),
    ("more evictions than reported hashes: forget all expected there",
     [("p0", P, 256), ("d-a", D, 64), ("d-b", D, 64)],
     [("report", "d-a", 60), ("report", "d-b", 59), ("route", "r1", 9, [1, 2], 4),
      ("report", "d-a", 50, 3, (9, 8)), ("report", "d-b", 60),   # 3 evicted, 2 named: 1 and 2 may be gone
      ("route", "r2", 13, [1, 2, 3], 4)],
     ["d-a", "d-b"]),
    ("prefix-aware routing off: least loaded only",
     [("p0", P, 256), ("d-a", D, 64), ("d-b", D, 64)],
     [("report", "d-a", 60), ("report", "d-b", 59), ("route", "r1", 9, [1, 2], 4),
      ("report", "d-a", 50), ("report", "d-b", 60), ("route", "r2", 13, [1, 2, 3], 4)],
     ["d-a", "d-b"], False),
    ("a restarted decode (a new incarnation) is expected to cache nothing",
     [("p0", P, 256), ("d-a", D, 64), ("d-b", D, 64)],
     [("report", "d-a", 60), ("report", "d-b", 59), ("route", "r1", 9, [1, 2], 4), ("pulled", "r1"),
      ("restart", "d-a"), ("report", "d-a", 50), ("report", "d-b", 60),
      ("route", "r2", 13, [1, 2, 3], 4)],   # d-a's old incarnation cached [1, 2]; the new one has nothing
     ["d-a", "d-b"]),
]


@pytest.mark.parametrize("name, engines, steps, expected, prefix_routing",
                         [(*row, True) if len(row) == 4 else row for row in TABLE], ids=[row[0] for row in TABLE])
def test_coordinator_and_etcd_route_alike(etcd, name, engines, steps, expected, prefix_routing):
    planes = Planes(etcd, engines, prefix_routing)
    try:
        decisions = []
        for step in steps:
            kind, *args = step
            if kind == "report":
                planes.report(*args)
            elif kind == "pulled":
                planes.pulled(*args)
            elif kind == "restart":
                planes.restart(*args)
            else:
                coordinator, on_etcd = planes.route(*args)
                assert coordinator == on_etcd, f"{name}: {step}: coordinator chose {coordinator}, etcd {on_etcd}"
                decisions.append(coordinator)
        assert decisions == expected
    finally:
        planes.close()


def test_admission_refuses_alike_with_the_same_reason(etcd):
    planes = Planes(etcd, [("p0", P, 256), ("d-a", D, 8)])
    try:
        rows = [([1, 2, 3], 2, "prefill:p0"), ([1] * 9, 40, "need 12 KV blocks"), ([], 2, "the prompt is empty"), ([1, 2], 0, "max_new_tokens must be >= 1"),
                ([1, -5, 3], 2, "token ids must be ints in [0, 2147483648)"), ([1, 1 << 31], 2, "token ids must be"),
                ([1, 2], policy.MAX_NEW_TOKENS + 1, "max_new_tokens must be <= "),
                ([5] * 5, 3000, "need 751 KV blocks of 4 tokens on a decode instance; the largest live decode pool has 8")]
        for prompt, max_new, says in rows:
            coordinator, on_etcd = planes.submit(prompt, max_new)
            assert coordinator == on_etcd, (prompt, max_new, coordinator, on_etcd)
            assert (on_etcd == "p0") if says.startswith("prefill:") else (says in on_etcd and "refused at submit" in on_etcd)
    finally:
        planes.close()


def test_prefill_choice_fewest_in_flight_then_name(etcd):
    planes = Planes(etcd, [("p-b", P, 256), ("p-a", P, 256), ("d0", D, 64)])
    try:
        chosen = [planes.submit([1, 2, 3], 2) for _ in range(5)]
        assert [c for c, _ in chosen] == [e for _, e in chosen] == ["p-a", "p-b", "p-a", "p-b", "p-a"]
    finally:
        planes.close()


def test_compatibility_is_refused_by_both_with_the_same_reason(etcd):
    planes = Planes(etcd, [("p0", P, 256), ("d0", D, 64)])
    try:
        other = {**GEOMETRY, "dtype": "bfloat16"}
        planes.sent.clear()
        planes.arrive(b"d-bad", wire.Register(D, "d-bad", "1", os.getpid(), socket.gethostname(), "fp", [other], 8))
        [(_, reply)] = [(z, m) for z, m in planes.sent if isinstance(m, wire.Registered)]
        view = planes.stores["p0"].snapshot()
        from engine_integration.control_plane.etcd.membership import member

        on_etcd = policy.fleet_refusal(policy.Member("d-bad", D, 8, (other,), "fp"), (member(r) for r in view.live()))
        assert not reply.ok and reply.reason == on_etcd and "'dtype' is 'bfloat16' here but 'float32'" in on_etcd
    finally:
        planes.close()
