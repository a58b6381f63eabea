"""Requests, results and load figures kept in the store beside the fleet's records.

With etcd there is no coordinator process to take a client's prompt, so the request's
whole life is in keys (``<root>`` is ``/kvxfer/<cluster>``)::

    <root>requests/<prefill>/<rid>   RequestRecord   the client's lease   written by the client, taken once by the prefill
    <root>results/<client>/<rid>     ResultRecord    the client's lease   decoding -> done / failed (prefill or decode)
    <root>claims/<prefill>/<rid>     a claim mark    the prefill's lease  written with the take, gone with the handoff
    <root>stats/<name>               StatsRecord     the engine's lease   pins, queue, running (tests, ``kvxfer info``)

Requests and results are under the *client's* lease: a client that dies leaves nothing
behind. Records are sealed and signed like every other record (``records.encode_record``),
name their key and the lease they were written under; a request is taken with one
revision-guarded transaction (``EtcdStore.claim``), so it is never run twice nor lost to a
repeated call. ``<rid>`` names one *attempt*: a request the client runs again after an
instance died (``etcd.client``) gets a new one, and each attempt's result is created once
(``EtcdStore.create_record``: by the decode that commits its KV, or by the client that
gives the attempt up), so an abandoned attempt can never answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from engine_integration.control_plane.etcd.records import (KeyLayout, RecordRefused, _field, _lease_matches, _load,
                                                           check_name, refusing)
from engine_integration.control_plane.policy import MAX_EVICTED_REPORT

REQUEST_KIND = "kvxfer/request/1"
RESULT_KIND = "kvxfer/result/1"
STATS_KIND = "kvxfer/stats/1"

DECODING, DONE, FAILED = "decoding", "done", "failed"
RESULT_STATES = (DECODING, DONE, FAILED)


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    client: str
    client_lease: int
    prefill: str
    prefill_incarnation: str        #: only this incarnation may take it (a restart under the name may not)
    prompt: tuple[int, ...]
    max_new_tokens: int

    def body(self) -> dict[str, Any]:
        return {"kind": REQUEST_KIND, "request_id": self.request_id, "client": self.client,
                "lease": str(self.client_lease), "prefill": self.prefill,
                "prefill_incarnation": self.prefill_incarnation, "prompt": list(self.prompt),
                "max_new_tokens": self.max_new_tokens}


@dataclass(frozen=True)
class ResultRecord:
    request_id: str
    client: str
    client_lease: int
    state: str                      #: ``decoding`` (held by ``by``), ``done``, ``failed``
    by: str = ""                    #: the instance that wrote it
    by_incarnation: str = ""
    tokens: Optional[tuple[int, ...]] = None
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)   #: timings, pulled/cached blocks
    #: ``failed`` because an instance died or lost its lease before any token was committed: the client
    #: may run the request again as a new attempt (``etcd.client``); a refusal or a transport error is not
    retryable: bool = False

    def body(self) -> dict[str, Any]:
        return {"kind": RESULT_KIND, "request_id": self.request_id, "client": self.client,
                "lease": str(self.client_lease), "state": self.state, "by": self.by,
                "by_incarnation": self.by_incarnation, "tokens": list(self.tokens) if self.tokens is not None else None,
                "error": self.error[:2048], "info": dict(self.info), "retryable": self.retryable}


@refusing
def decode_request(key: str, value: bytes, lease: int, layout: KeyLayout, cluster_key: Optional[bytes], *,
                   allow_unauthenticated: bool = False) -> RequestRecord:
    view = _load(value, cluster_key, allow_unauthenticated)
    if view.get("kind") != REQUEST_KIND:
        raise RecordRefused(f"kind {view.get('kind')!r} is not {REQUEST_KIND!r}")
    rec = RequestRecord(request_id=_field(view, "request_id", str), client=_field(view, "client", str),
                        client_lease=lease, prefill=_field(view, "prefill", str),
                        prefill_incarnation=_field(view, "prefill_incarnation", str),
                        prompt=tuple(_field(view, "prompt", list)),
                        max_new_tokens=_field(view, "max_new_tokens", int))
    if key != layout.request(rec.prefill, rec.request_id):
        raise RecordRefused(f"request {rec.prefill}/{rec.request_id} stored at {key!r}")
    check_name("client", rec.client)
    _lease_matches(view, lease)
    if not rec.prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in rec.prompt):
        raise RecordRefused("prompt must be a non-empty list of token ids")
    check_name("request id", rec.request_id)
    return rec


@refusing
def decode_result(key: str, value: bytes, lease: int, layout: KeyLayout, cluster_key: Optional[bytes], *,
                  allow_unauthenticated: bool = False) -> ResultRecord:
    view = _load(value, cluster_key, allow_unauthenticated)
    if view.get("kind") != RESULT_KIND:
        raise RecordRefused(f"kind {view.get('kind')!r} is not {RESULT_KIND!r}")
    state = _field(view, "state", str)
    if state not in RESULT_STATES:
        raise RecordRefused(f"unknown result state {state!r}")
    tokens = view.get("tokens")
    if tokens is not None and not (isinstance(tokens, list)
                                   and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
        raise RecordRefused("tokens must be a list of token ids")
    rec = ResultRecord(request_id=_field(view, "request_id", str), client=_field(view, "client", str),
                       client_lease=lease, state=state, by=_field(view, "by", str),
                       by_incarnation=_field(view, "by_incarnation", str),
                       tokens=tuple(tokens) if tokens is not None else None, error=_field(view, "error", str),
                       info=_field(view, "info", dict), retryable=view.get("retryable", False) is True)
    if key != layout.result(rec.client, rec.request_id):
        raise RecordRefused(f"result {rec.client}/{rec.request_id} stored at {key!r}")
    _lease_matches(view, lease)
    return rec


def stats_body(name: str, incarnation: str, lease: int, figures: dict[str, int],
               evicted: Sequence[int] = ()) -> dict[str, Any]:
    """An engine's load record: int figures, and (decodes) the newest hashes its pool evicted."""
    body = {"kind": STATS_KIND, "name": name, "incarnation": incarnation, "lease": str(lease),
            "figures": {k: int(v) for k, v in figures.items()}}
    if evicted:
        body["evicted"] = [int(h) for h in evicted[-MAX_EVICTED_REPORT:]]
    return body


def stats_evicted(value: Mapping[str, Any]) -> list[int]:
    """The evicted hashes of a verified load record's view (bounded; anything else refused)."""
    evicted = value.get("evicted", [])
    if not (isinstance(evicted, list) and len(evicted) <= MAX_EVICTED_REPORT
            and all(isinstance(h, int) and not isinstance(h, bool) and -(1 << 63) <= h < (1 << 63) for h in evicted)):
        raise RecordRefused(f"evicted must be a list of at most {MAX_EVICTED_REPORT} int64 block hashes")
    return evicted


@refusing
def decode_stats(key: str, value: bytes, lease: int, layout: KeyLayout, cluster_key: Optional[bytes], *,
                 allow_unauthenticated: bool = False) -> tuple[str, str, dict[str, Any]]:
    """(name, incarnation, figures) of one engine's load record; a decode's evicted hashes, if it
    reported any, are in ``figures["evicted"]`` (a list)."""
    view = _load(value, cluster_key, allow_unauthenticated)
    if view.get("kind") != STATS_KIND:
        raise RecordRefused(f"kind {view.get('kind')!r} is not {STATS_KIND!r}")
    name = _field(view, "name", str)
    if key != layout.stat(name):
        raise RecordRefused(f"stats of {name!r} stored at {key!r}")
    _lease_matches(view, lease)
    figures = dict(_field(view, "figures", dict))
    evicted = stats_evicted(view)
    if evicted:
        figures["evicted"] = evicted
    return name, _field(view, "incarnation", str), figures
