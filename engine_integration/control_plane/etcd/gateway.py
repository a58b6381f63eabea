"""A minimal etcd v3 client over etcd's HTTP/JSON gateway, standard library only.

Why not a client package: the gRPC clients on the index are either unmaintained
(``etcd3`` 0.12, last release 2020, pinned to old protobuf/grpcio) or pull a gRPC stack
into every engine process; ``etcd3gw`` (the maintained gateway client) brings
``requests``, ``futurist`` and ``pbr``. kvxfer needs a dozen unary calls (put, range,
delete, txn, lease grant/keepalive/revoke/list, authenticate) and etcd serves every one
of them as JSON over HTTP on its client port (``/v3/...``, keys and values base64), so a
few hundred lines of ``http.client`` do, with nothing to install.

Behaviour that matters to the fleet:

- One persistent connection per thread (the lease keepalive thread never queues behind
  a slow snapshot), re-opened on any socket error, trying each endpoint in turn (a
  member that is down costs one attempt) until ``timeout_s`` has passed; then
  ``EtcdUnavailable``. A member that answers but cannot serve (gRPC code 14: its leader
  died mid-call, an election is on, it lost its quorum) is asked again the same way,
  next member first: a cluster that loses a member, or its leader, is a pause, not an error. TLS (``tls``: an ``ssl.SSLContext``, with a client
  certificate where etcd asks for one) on every connection when given.
- **A retried call may already have been applied**: the server can apply a request and
  lose the connection before the answer arrives. Every call is therefore written to be
  safe to repeat, and the repeats that answer differently are resolved here or by the
  caller, never taken at face value: puts write the same value; deletes are idempotent;
  a lease is granted under an ID chosen here, so a repeat answers "lease already exists"
  for the very lease the first attempt made; "already exists" from a repeated user or
  role creation is the first attempt's success; a transaction (``txn``) reports
  ``retried`` so that its caller, seeing it not succeed, reads back whether its own
  first attempt did (``store`` does that for every guarded write and for the claim of
  a request).
- etcd authentication: with a user, a token is fetched from ``/v3/auth/authenticate`` and
  sent as ``Authorization``; an "invalid auth token" answer (expired simple token, etcd
  restarted) re-authenticates once. Passwords are never logged. With a client
  certificate and no user, etcd takes the certificate's common name as the user.
- **A request that times out drops the token when etcd is behind it**, and the next attempt
  logs in again. etcd's simple token ends in the Raft index at which it was issued, and etcd
  *holds* a request whose token index is ahead of its own until the request is cancelled: an
  etcd restored from an older snapshot (or wiped and secured again) never answers a client
  that keeps its old token, while a fresh login answers in 0.09 s (round 6). etcd's status
  (``/v3/maintenance/status``, answered without a token) says how far it has applied its log,
  so a token ahead of it is told apart from a slow etcd. A token that is not ahead is kept: a
  login is a bcrypt check and a Raft write, and an etcd that is merely slow or overloaded must
  not get one per timed-out request (seen once here, with a rule that dropped the token on
  every timeout: under a load of 15 on 2 cores the logins themselves timed out for 30 s, and
  leases expired waiting behind them).
- **An etcd that went back in time is detected** (``Rewind``, ``epoch``): every key-value
  answer carries the store's revision, which in one etcd cluster never decreases, and a
  linearizable answer is never older than one received before the request was sent. An
  answer below that (a restore, a wipe, an older snapshot), or from another ``cluster_id``,
  bumps ``epoch`` and records why; the store and the client compare ``epoch`` with the
  one they registered under and start again as new incarnations (``store``, ``client``).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import secrets
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

log = logging.getLogger(__name__)

#: gRPC status codes etcd answers with (``code`` in an error body)
CODE_INVALID_ARGUMENT, CODE_NOT_FOUND, CODE_PERMISSION_DENIED, CODE_FAILED_PRECONDITION = 3, 5, 7, 9
CODE_UNAVAILABLE, CODE_UNAUTHENTICATED = 14, 16


class EtcdError(Exception):
    """etcd answered with an error (``code`` is its gRPC status code)."""

    def __init__(self, code: int, message: str, path: str) -> None:
        super().__init__(f"etcd {path}: {message} (code {code})")
        self.code, self.message, self.path = code, message, path


class EtcdUnavailable(EtcdError):
    """No endpoint answered within the client's timeout."""


class _TimedOutWithToken(Exception):
    """An attempt that sent an auth token timed out: the token may be one etcd holds (see the module docstring)."""


@dataclass(frozen=True)
class Rewind:
    """etcd was seen going back in time: what was seen, and when (wall clock)."""

    epoch: int
    why: str
    at: float


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: Optional[str]) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix``."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


@dataclass(frozen=True)
class KV:
    key: bytes
    value: bytes
    lease: int
    mod_revision: int
    create_revision: int = 0


def _kv(raw: dict[str, Any]) -> KV:
    return KV(unb64(raw.get("key")), unb64(raw.get("value")), int(raw.get("lease", 0)),
              int(raw.get("mod_revision", 0)), int(raw.get("create_revision", 0)))


# --- transaction parts (``EtcdHttpClient.txn``) -------------------------------------------------
def if_mod_revision(key: bytes, revision: int) -> dict[str, Any]:
    """Compare: ``key`` was last written at ``revision`` (0: it does not exist)."""
    return {"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(revision)}


def if_absent(key: bytes) -> dict[str, Any]:
    """Compare: ``key`` does not exist."""
    return {"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}


def put_op(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = str(lease)
    return {"request_put": body}


def delete_op(key: bytes, range_end: Optional[bytes] = None, *, prev_kv: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key)}
    if range_end is not None:
        body["range_end"] = b64(range_end)
    if prev_kv:
        body["prev_kv"] = True
    return {"request_delete_range": body}


def range_op(key: bytes) -> dict[str, Any]:
    return {"request_range": {"key": b64(key)}}


@dataclass(frozen=True)
class TxnResult:
    """What a transaction answered. ``retried``: an earlier attempt of this very call may have been
    applied (the connection broke after the request left), so a ``succeeded=False`` can be the
    answer to our own first attempt; the caller reads back what it wrote to tell."""

    succeeded: bool
    revision: int
    responses: list[dict[str, Any]] = field(default_factory=list)
    retried: bool = False

    def kvs(self, index: int) -> list[KV]:
        """The key-values of response ``index`` (a range's ``kvs``, a delete's ``prev_kvs``)."""
        if index >= len(self.responses):
            return []
        (reply,) = self.responses[index].values()
        return [_kv(kv) for kv in (reply.get("kvs") or reply.get("prev_kvs") or [])]


def _set_timeout(conn: http.client.HTTPConnection, seconds: float) -> None:
    """The socket timeout of ``conn``'s next connect and of its open socket, if any."""
    conn.timeout = seconds
    if conn.sock is not None:
        conn.sock.settimeout(seconds)


def _never_sent(exc: BaseException) -> bool:
    """The request cannot have reached a server: the connection itself was refused or unresolvable."""
    return isinstance(exc, (ConnectionRefusedError, socket.gaierror))


class EtcdHttpClient:
    """Unary etcd v3 calls over the JSON gateway; thread-safe."""

    def __init__(self, endpoints: Sequence[str], *, user: Optional[str] = None, password: Optional[str] = None,
                 timeout_s: float = 3.0, request_timeout_s: float = 1.0, tls: Optional[ssl.SSLContext] = None) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint (host:port) is needed")
        self.endpoints = [e.removeprefix("http://").removeprefix("https://") for e in endpoints]
        self.user, self._password = user, password
        self.timeout_s, self.request_timeout_s = timeout_s, request_timeout_s
        self.tls = tls
        self._local = threading.local()
        self._lock = threading.Lock()
        self._token: Optional[str] = None
        self._preferred = 0
        self.reconnects = 0
        self.failovers = 0          #: calls answered by another endpoint than the one tried first
        self.retried_calls = 0      #: calls repeated after an attempt that may have been applied
        self.unavailable_answers = 0   #: "unavailable" answers (leader lost, election) asked again
        self.calls: dict[str, int] = {}   #: answered calls by path (the plane's per-handoff cost)
        self.token_drops = 0        #: auth tokens dropped after a request that sent one timed out
        #: etcd seen going back in time (``Rewind``): bumped once per rewind; users compare it with theirs
        self.epoch = 0
        self.rewinds: list[Rewind] = []
        self._high_revision = 0     # the highest key-value revision answered so far
        self._cluster_id = ""       # the cluster that answered first
        self._history_lock = threading.Lock()   # not ``_lock``: a login (bcrypt) holds that one

    def __repr__(self) -> str:
        return f"EtcdHttpClient({self.endpoints}, user={self.user!r}, tls={self.tls is not None})"

    # --- transport --------------------------------------------------------------------------
    def _connection(self, endpoint: str) -> http.client.HTTPConnection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(endpoint)
        if conn is None:
            host, _, port = endpoint.rpartition(":")
            host = host.strip("[]")
            if self.tls is not None:
                conn = http.client.HTTPSConnection(host, int(port), timeout=self.request_timeout_s, context=self.tls)
            else:
                conn = http.client.HTTPConnection(host, int(port), timeout=self.request_timeout_s)
            conns[endpoint] = conn
        return conn

    def _drop(self, endpoint: str) -> None:
        conn = getattr(self._local, "conns", {}).pop(endpoint, None)
        if conn is not None:
            conn.close()
            self.reconnects += 1

    def close(self) -> None:
        """Close this thread's connections (others close when their threads end)."""
        for endpoint in list(getattr(self._local, "conns", {})):
            self._drop(endpoint)

    def _http(self, method: str, path: str, body: Optional[dict[str, Any]], token: Optional[str],
              timeout_s: Optional[float] = None, *, patient: bool = False) -> tuple[int, Any, bool]:
        """(status, reply, retried): ``retried`` when an earlier attempt may have reached a server.

        Each attempt waits ``request_timeout_s``; a ``patient`` call (authentication) waits for the
        whole remaining timeout instead: etcd checks a password with bcrypt (60-90 ms each here),
        so a crowd logging in at once queues for seconds, and re-sending a queued login after 1 s
        only makes etcd hash every copy (measured: 16 clients took up to 11 s, or never got in)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        last: Exception = OSError("no attempt")
        attempt, retried = 0, False
        while True:
            endpoint = self.endpoints[(self._preferred + attempt) % len(self.endpoints)]
            try:
                conn = self._connection(endpoint)
                if patient:
                    _set_timeout(conn, max(self.request_timeout_s, deadline - time.monotonic()))
                conn.request(method, path, body=payload, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if patient:
                    _set_timeout(conn, self.request_timeout_s)
                if attempt % len(self.endpoints):
                    self.failovers += 1
                self._preferred = (self._preferred + attempt) % len(self.endpoints)
                if retried:
                    self.retried_calls += 1
                try:
                    return resp.status, json.loads(data) if data else {}, retried
                except ValueError:
                    return resp.status, {"error": data[:200].decode(errors="replace"), "code": -1}, retried
            except ssl.SSLCertVerificationError as exc:   # never a transient error: say so at once
                self._drop(endpoint)
                raise EtcdUnavailable(-1, f"TLS: {endpoint} presented a certificate this client does not trust: "
                                          f"{exc.verify_message}", path) from None
            except (OSError, http.client.HTTPException) as exc:
                last = exc
                retried = retried or not _never_sent(exc)
                self._drop(endpoint)
                if token and isinstance(exc, TimeoutError):   # etcd may hold it for its token: _call logs in again
                    self._preferred = (self._preferred + attempt + 1) % len(self.endpoints)
                    raise _TimedOutWithToken(str(exc)) from None
            attempt += 1
            if time.monotonic() >= deadline:
                raise EtcdUnavailable(-1, f"no answer from {self.endpoints} within {timeout_s}s "
                                          f"(last: {type(last).__name__}: {last})", path)
            if attempt % len(self.endpoints) == 0:
                time.sleep(min(0.05 * attempt, 0.25))

    def _token_ahead(self, token: str, timeout_s: float) -> bool:
        """``token`` (etcd's simple token, ``<random>.<Raft index it was issued at>``) is ahead of what the
        member we call has applied: etcd holds every request that carries it (restored from an older
        snapshot, wiped). False when that cannot be told within one attempt (etcd slow: keep the token)."""
        try:
            issued = int(token.rpartition(".")[2])
        except ValueError:
            return False   # not a simple token (JWT): etcd does not wait on it
        try:
            _, reply, _ = self._http("POST", "/v3/maintenance/status", {}, None,
                                     min(self.request_timeout_s, timeout_s))
            applied = int(reply.get("raftAppliedIndex") or reply.get("raftIndex") or 0)
        except (EtcdError, TypeError, ValueError):
            return False
        return 0 < applied < issued

    def _authenticate(self, timeout_s: Optional[float] = None) -> str:
        status, reply, _ = self._http("POST", "/v3/auth/authenticate",
                                      {"name": self.user, "password": self._password}, None, timeout_s,
                                      patient=True)
        if "token" not in reply:
            raise EtcdError(int(reply.get("code", -1)), f"authentication as {self.user!r} failed: "
                            f"{reply.get('message') or reply.get('error')}", "/v3/auth/authenticate")
        return str(reply["token"])

    def call(self, path: str, body: Optional[dict[str, Any]] = None, *,
             timeout_s: Optional[float] = None) -> dict[str, Any]:
        """POST ``body`` to ``path``; the reply, or ``EtcdError``/``EtcdUnavailable`` (after ``timeout_s``,
        default the client's, of attempts on every endpoint)."""
        return self._call(path, body, timeout_s=timeout_s)[0]

    def _call(self, path: str, body: Optional[dict[str, Any]] = None, *,
              timeout_s: Optional[float] = None) -> tuple[dict[str, Any], bool]:
        """(reply, retried). A repeated call answered "already exists" (a user, a role, a lease
        under our own ID) is the first attempt's success: ``({}, True)``.

        A member that answers "unavailable" (gRPC code 14: "leader changed", "request timed out",
        "no leader": the leader died mid-call, an election is on, the member lost its quorum) is
        asked again, next member first, until ``timeout_s``. Such a request may have been applied
        (a proposal committed just before the leader went), so the call counts as ``retried``,
        and once the time is up it ends in ``EtcdUnavailable`` ("may or may not be applied"),
        never in a plain ``EtcdError`` ("not applied")."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        retried, reauthenticated, unavailable, token_dropped = False, False, 0, False
        with self._history_lock:   # no linearizable answer to this call is older than what came before it
            floor = (self._high_revision, self.epoch)
        while True:
            token = None
            try:
                if self.user is not None:
                    with self._lock:
                        if self._token is None:
                            self._token = self._authenticate(max(0.0, deadline - time.monotonic()))
                        token = self._token
                status, reply, retried_now = self._http("POST", path, body if body is not None else {}, token,
                                                        max(0.0, deadline - time.monotonic()))
            except _TimedOutWithToken as exc:
                retried = True   # it may have been applied
                if not token_dropped:   # once per call: one status look, one login at most
                    token_dropped = True
                    dropped = self._token_ahead(token, max(0.0, deadline - time.monotonic()))
                    with self._lock:
                        dropped = dropped and self._token == token
                        if dropped:
                            self._token = None
                            self.token_drops += 1
                    if dropped:
                        log.warning("etcd %s timed out with our auth token: logging in again (an etcd restored from "
                                    "an older snapshot holds requests whose token is ahead of it)", path)
                if time.monotonic() >= deadline:
                    raise EtcdUnavailable(-1, f"no answer from {self.endpoints} within {timeout_s}s (last: {exc})",
                                          path) from None
                continue
            except EtcdUnavailable:
                raise
            except EtcdError as exc:   # the authentication itself was answered "unavailable"
                if exc.code != CODE_UNAVAILABLE:
                    raise
                reply, retried_now = {"code": exc.code, "message": exc.message}, False
            retried = retried or retried_now
            if "error" in reply or ("code" in reply and "message" in reply):
                code = int(reply.get("code", -1))
                message = str(reply.get("message") or reply.get("error"))
                if self.user is not None and not reauthenticated and (
                        code == CODE_UNAUTHENTICATED or "auth token" in message):
                    reauthenticated = True
                    with self._lock:
                        if self._token == token:
                            self._token = None
                    continue
                if code == CODE_UNAVAILABLE:
                    retried, unavailable = True, unavailable + 1
                    self.unavailable_answers += 1
                    if time.monotonic() >= deadline:
                        raise EtcdUnavailable(code, f"{message}, still after {timeout_s}s on {self.endpoints}", path)
                    self._preferred = (self._preferred + 1) % len(self.endpoints)
                    time.sleep(min(0.05 * unavailable, 0.25, max(0.0, deadline - time.monotonic())))
                    continue
                if retried and code == CODE_FAILED_PRECONDITION and "already exists" in message:
                    log.info("etcd %s: a repeated call answered %r: its first attempt was applied", path, message)
                    return {}, True
                raise EtcdError(code, message, path)
            if unavailable:
                self.retried_calls += 1
            self.calls[path] = self.calls.get(path, 0) + 1
            self._watch_history(path, reply, floor)
            if "result" in reply and isinstance(reply["result"], dict):   # streaming endpoints wrap their answer
                return reply["result"], retried
            return reply, retried

    def _watch_history(self, path: str, reply: dict[str, Any], floor: tuple[int, int]) -> None:
        """Record a rewind when a key-value answer is older than ``floor`` or comes from another cluster.

        Only ``/v3/kv/`` answers count: they are linearizable (ranges are never serializable here),
        so in one cluster their revision is at least that of any answer received before the call
        was sent. Lease and maintenance answers may come from a lagging member and are not used.
        A member replaced within the same cluster keeps the cluster's data (Raft): not a rewind.
        ``floor`` is (the highest revision, ``epoch``) when the call was sent: a call sent before a
        rewind another thread saw is not counted as a second one."""
        header = reply.get("header") if isinstance(reply.get("header"), dict) else None
        if header is None or not path.startswith("/v3/kv/"):
            return
        try:
            revision = int(header.get("revision", 0))
        except (TypeError, ValueError):
            return
        cluster_id = str(header.get("cluster_id", ""))
        why = ""
        high, epoch = floor
        with self._history_lock:
            if epoch != self.epoch:
                pass   # sent before a rewind that another call saw: that one counted it
            elif cluster_id and self._cluster_id and cluster_id != self._cluster_id:
                why = (f"etcd answers as cluster {cluster_id}, not {self._cluster_id} (a different or re-created "
                       "cluster)")
            elif revision and revision < high:
                why = (f"etcd's revision went back from {high} to {revision} (restored from an older snapshot, "
                       "or its data was lost)")
            if why:
                self.epoch += 1
                self.rewinds.append(Rewind(self.epoch, why, time.time()))
                del self.rewinds[:-16]
                self._high_revision = revision
            else:
                self._high_revision = max(self._high_revision, revision)
            if cluster_id:
                self._cluster_id = cluster_id
        if why:
            log.error("%s: every lease, record and handoff state of this fleet written since may be gone", why)

    @property
    def last_rewind(self) -> str:
        """Why etcd was last seen going back in time ("" if never)."""
        return self.rewinds[-1].why if self.rewinds else ""

    def get(self, path: str) -> dict[str, Any]:
        """GET a non-v3 path (``/health``, ``/version``) without auth."""
        return self._http("GET", path, None, None)[1]

    def metrics(self, endpoint: Optional[str] = None) -> dict[str, float]:
        """etcd's Prometheus counters at ``endpoint`` (default: the first), summed over their labels.

        The server side of the per-handoff cost (``etcd_mvcc_put_total``, ``..._txn_total``,
        ``..._range_total``, ``..._delete_total``, ``grpc_server_handled_total``): what every
        client together asked of this member."""
        host, _, port = (endpoint or self.endpoints[0]).rpartition(":")
        conn = (http.client.HTTPSConnection(host.strip("[]"), int(port), timeout=self.timeout_s, context=self.tls)
                if self.tls is not None else http.client.HTTPConnection(host.strip("[]"), int(port),
                                                                        timeout=self.timeout_s))
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode(errors="replace")
        except (OSError, http.client.HTTPException) as exc:
            raise EtcdUnavailable(-1, f"no metrics from {host}:{port}: {exc}", "/metrics") from None
        finally:
            conn.close()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            try:
                number = float(value)
            except ValueError:
                continue
            base = name.split("{", 1)[0]
            out[base] = out.get(base, 0.0) + number
        return out

    # --- KV ---------------------------------------------------------------------------------
    def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.call("/v3/kv/put", body)["header"]["revision"])

    def range(self, key: bytes, range_end: Optional[bytes] = None, *, count_only: bool = False) -> tuple[int, list[KV]]:
        body: dict[str, Any] = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        if count_only:
            body["count_only"] = True
        reply = self.call("/v3/kv/range", body)
        if count_only:
            return int(reply.get("count", 0)), []
        return int(reply["header"]["revision"]), [_kv(kv) for kv in reply.get("kvs", [])]

    def range_prefix(self, prefix: bytes) -> tuple[int, list[KV]]:
        return self.range(prefix, prefix_end(prefix))

    def delete(self, key: bytes, range_end: Optional[bytes] = None) -> int:
        body: dict[str, Any] = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        return int(self.call("/v3/kv/deleterange", body).get("deleted", 0))

    def delete_prefix(self, prefix: bytes) -> int:
        return self.delete(prefix, prefix_end(prefix))

    def txn(self, compare: Sequence[dict[str, Any]], success: Sequence[dict[str, Any]],
            failure: Sequence[dict[str, Any]] = ()) -> TxnResult:
        """One atomic transaction: if every ``compare`` holds, ``success`` is applied, else ``failure``.

        Built from ``if_mod_revision`` / ``if_absent`` and ``put_op`` / ``delete_op`` / ``range_op``.
        ``TxnResult.retried`` says an earlier attempt may have been applied (see the module docstring).
        """
        reply, retried = self._call("/v3/kv/txn", {"compare": list(compare), "success": list(success),
                                                   "failure": list(failure)})
        return TxnResult(bool(reply.get("succeeded", False)), int(reply.get("header", {}).get("revision", 0)),
                         list(reply.get("responses") or []), retried)

    # --- leases -----------------------------------------------------------------------------
    def lease_grant(self, ttl_s: int) -> tuple[int, int]:
        """(lease id, granted TTL): etcd may raise a TTL below its minimum.

        The ID is chosen here, so a grant repeated after a lost answer finds the lease its first
        attempt made ("lease already exists") instead of granting a second one that would
        outlive its purpose for a TTL."""
        for _ in range(3):
            lease = secrets.randbits(62) + 1
            try:
                reply, retried = self._call("/v3/lease/grant", {"TTL": int(ttl_s), "ID": str(lease)})
            except EtcdError as exc:
                if exc.code == CODE_FAILED_PRECONDITION and "already exists" in exc.message:
                    continue   # another client's lease has this ID (2^-62): pick another
                raise
            if not reply:   # our repeated grant: the first attempt made it
                return lease, max(int(ttl_s), self.lease_ttl(lease))
            return int(reply["ID"]), int(reply["TTL"])
        raise EtcdError(CODE_FAILED_PRECONDITION, "three random lease IDs already existed", "/v3/lease/grant")

    def lease_keepalive(self, lease: int, *, timeout_s: Optional[float] = None) -> int:
        """The renewed TTL, or 0 if the lease no longer exists (expired or revoked)."""
        return int(self.call("/v3/lease/keepalive", {"ID": str(lease)}, timeout_s=timeout_s).get("TTL", 0))

    def lease_revoke(self, lease: int) -> None:
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if exc.code != CODE_NOT_FOUND and "not found" not in exc.message:
                raise

    def lease_ttl(self, lease: int) -> int:
        """Seconds left on ``lease`` (-1 when it does not exist)."""
        return int(self.call("/v3/lease/timetolive", {"ID": str(lease)}).get("TTL", -1))

    def leases(self) -> list[int]:
        return [int(item["ID"]) for item in self.call("/v3/lease/leases", {}).get("leases", [])]

    # --- cluster ----------------------------------------------------------------------------
    def status(self, endpoint: Optional[str] = None) -> dict[str, Any]:
        """``/v3/maintenance/status`` of the preferred member, or of ``endpoint`` only."""
        if endpoint is None:
            return self.call("/v3/maintenance/status", {})
        one = EtcdHttpClient([endpoint], user=self.user, password=self._password, timeout_s=self.timeout_s,
                             request_timeout_s=self.request_timeout_s, tls=self.tls)
        try:
            return one.call("/v3/maintenance/status", {})
        finally:
            one.close()

    def members(self) -> list[dict[str, Any]]:
        """The cluster's members (``name``, ``ID``, ``clientURLs``)."""
        return list(self.call("/v3/cluster/member/list", {}).get("members", []))
