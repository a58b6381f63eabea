"""A minimal etcd v3 client over etcd's HTTP/JSON gateway, standard library only.

Why not a client package: the gRPC clients on the index are either unmaintained
(``etcd3`` 0.12, last release 2020, pinned to old protobuf/grpcio) or pull a gRPC stack
into every engine process; ``etcd3gw`` (the maintained gateway client) brings
``requests``, ``futurist`` and ``pbr``. kvxfer needs eight unary calls (put, range,
delete, lease grant/keepalive/revoke/list, authenticate) and etcd serves every one of
them as JSON over HTTP on its client port (``/v3/...``, keys and values base64), so a
hundred lines of ``http.client`` do, with nothing to install.

Behaviour that matters to the fleet:

- One persistent connection per thread (the lease keepalive thread never queues behind
  a slow snapshot), re-opened on any socket error, trying each endpoint in turn until
  ``timeout_s`` has passed; then ``EtcdUnavailable``. Every call is safe to repeat (puts
  write the same value, deletes are idempotent, a repeated lease grant only leaves a
  lease that expires unused).
- etcd authentication: with a user, a token is fetched from ``/v3/auth/authenticate`` and
  sent as ``Authorization``; an "invalid auth token" answer (expired simple token, etcd
  restarted) re-authenticates once. Passwords are never logged.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

log = logging.getLogger("kvxfer.engine.control_plane.etcd")

#: gRPC status codes etcd answers with (``code`` in an error body)
CODE_INVALID_ARGUMENT, CODE_NOT_FOUND, CODE_PERMISSION_DENIED, CODE_FAILED_PRECONDITION = 3, 5, 7, 9
CODE_UNAUTHENTICATED = 16


class EtcdError(Exception):
    """etcd answered with an error (``code`` is its gRPC status code)."""

    def __init__(self, code: int, message: str, path: str) -> None:
        super().__init__(f"etcd {path}: {message} (code {code})")
        self.code, self.message, self.path = code, message, path


class EtcdUnavailable(EtcdError):
    """No endpoint answered within the client's timeout."""


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


class EtcdHttpClient:
    """Unary etcd v3 calls over the JSON gateway; thread-safe."""

    def __init__(self, endpoints: Sequence[str], *, user: Optional[str] = None, password: Optional[str] = None,
                 timeout_s: float = 3.0, request_timeout_s: float = 1.0) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint (host:port) is needed")
        self.endpoints = [e.removeprefix("http://") for e in endpoints]
        self.user, self._password = user, password
        self.timeout_s, self.request_timeout_s = timeout_s, request_timeout_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._token: Optional[str] = None
        self._preferred = 0
        self.reconnects = 0

    def __repr__(self) -> str:
        return f"EtcdHttpClient({self.endpoints}, user={self.user!r})"

    # --- transport --------------------------------------------------------------------------
    def _connection(self, endpoint: str) -> http.client.HTTPConnection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(endpoint)
        if conn is None:
            host, _, port = endpoint.rpartition(":")
            conn = conns[endpoint] = http.client.HTTPConnection(host, int(port), timeout=self.request_timeout_s)
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

    def _http(self, method: str, path: str, body: Optional[dict[str, Any]], token: Optional[str]) -> tuple[int, Any]:
        deadline = time.monotonic() + self.timeout_s
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        last: Exception = OSError("no attempt")
        attempt = 0
        while True:
            endpoint = self.endpoints[(self._preferred + attempt) % len(self.endpoints)]
            try:
                conn = self._connection(endpoint)
                conn.request(method, path, body=payload, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self._preferred = (self._preferred + attempt) % len(self.endpoints)
                try:
                    return resp.status, json.loads(data) if data else {}
                except ValueError:
                    return resp.status, {"error": data[:200].decode(errors="replace"), "code": -1}
            except (OSError, http.client.HTTPException) as exc:
                last = exc
                self._drop(endpoint)
            attempt += 1
            if time.monotonic() >= deadline:
                raise EtcdUnavailable(-1, f"no answer from {self.endpoints} within {self.timeout_s}s "
                                          f"(last: {type(last).__name__}: {last})", path)
            if attempt % len(self.endpoints) == 0:
                time.sleep(min(0.05 * attempt, 0.25))

    def _authenticate(self) -> str:
        status, reply = self._http("POST", "/v3/auth/authenticate", {"name": self.user, "password": self._password},
                                   None)
        if "token" not in reply:
            raise EtcdError(int(reply.get("code", -1)), f"authentication as {self.user!r} failed: "
                            f"{reply.get('message') or reply.get('error')}", "/v3/auth/authenticate")
        return str(reply["token"])

    def call(self, path: str, body: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """POST ``body`` to ``path``; the reply, or ``EtcdError``/``EtcdUnavailable``."""
        for retry in (False, True):
            token = None
            if self.user is not None:
                with self._lock:
                    if self._token is None:
                        self._token = self._authenticate()
                    token = self._token
            status, reply = self._http("POST", path, body if body is not None else {}, token)
            if "error" in reply or ("code" in reply and "message" in reply):
                code = int(reply.get("code", -1))
                message = str(reply.get("message") or reply.get("error"))
                if self.user is not None and not retry and (
                        code == CODE_UNAUTHENTICATED or "auth token" in message):
                    with self._lock:
                        if self._token == token:
                            self._token = None
                    continue
                raise EtcdError(code, message, path)
            if "result" in reply and isinstance(reply["result"], dict):   # streaming endpoints wrap their answer
                return reply["result"]
            return reply
        raise AssertionError("unreachable")

    def get(self, path: str) -> dict[str, Any]:
        """GET a non-v3 path (``/health``, ``/version``) without auth."""
        return self._http("GET", path, None, None)[1]

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
        kvs = [KV(unb64(kv.get("key")), unb64(kv.get("value")), int(kv.get("lease", 0)),
                  int(kv.get("mod_revision", 0))) for kv in reply.get("kvs", [])]
        if count_only:
            return int(reply.get("count", 0)), []
        return int(reply["header"]["revision"]), kvs

    def range_prefix(self, prefix: bytes) -> tuple[int, list[KV]]:
        return self.range(prefix, prefix_end(prefix))

    def delete(self, key: bytes, range_end: Optional[bytes] = None) -> int:
        body: dict[str, Any] = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        return int(self.call("/v3/kv/deleterange", body).get("deleted", 0))

    def take(self, key: bytes) -> Optional[KV]:
        """Delete ``key`` and return its value (``prev_kv``), or None if it did not exist.

        etcd applies a delete atomically, so of several concurrent takers at most one gets the value.
        """
        reply = self.call("/v3/kv/deleterange", {"key": b64(key), "prev_kv": True})
        if int(reply.get("deleted", 0)) != 1:
            return None
        prev = (reply.get("prev_kvs") or [{}])[0]
        return KV(unb64(prev.get("key")), unb64(prev.get("value")), int(prev.get("lease", 0)),
                  int(prev.get("mod_revision", 0)))

    def delete_prefix(self, prefix: bytes) -> int:
        return self.delete(prefix, prefix_end(prefix))

    # --- leases -----------------------------------------------------------------------------
    def lease_grant(self, ttl_s: int) -> tuple[int, int]:
        """(lease id, granted TTL): etcd may raise a TTL below its minimum."""
        reply = self.call("/v3/lease/grant", {"TTL": int(ttl_s)})
        return int(reply["ID"]), int(reply["TTL"])

    def lease_keepalive(self, lease: int) -> int:
        """The renewed TTL, or 0 if the lease no longer exists (expired or revoked)."""
        return int(self.call("/v3/lease/keepalive", {"ID": str(lease)}).get("TTL", 0))

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
    def status(self) -> dict[str, Any]:
        return self.call("/v3/maintenance/status", {})
