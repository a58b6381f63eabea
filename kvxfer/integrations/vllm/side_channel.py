"""A producer's handshake listener on ``kv_ip:kv_port``, and the decode's fetch from it.

The decode needs each prefill rank's ``export_meta()`` (its registered KV pool and lease
table, with transport keys) once per producer instance, not per request: a meta is a few KB
and would bloat every ``kv_transfer_params`` that a proxy carries. So, like NixlConnector's
side channel, the producer's scheduler serves one sealed handshake document over ZeroMQ and
decodes cache it per ``(engine_id, instance)``.

The document is sealed (and with a cluster secret signed) by ``kvxfer.security.meta_seal``;
without a secret it also carries the instance's ticket key, so the listener answers only
peers on its own host then (loopback), matching kvxfer's rule that unsigned metas are
same-host only. Requests and replies are bounded in size; a malformed request gets an error
reply, never a crash.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
from typing import Any, Callable, Optional

import zmq

from kvxfer.errors import PeerMetadataError

logger = logging.getLogger("kvxfer.integrations.vllm")

MAX_HANDSHAKE_BYTES = 16 << 20
_MAX_REQUEST_BYTES = 4096
GET_HANDSHAKE = "kvxfer-vllm/get-handshake/1"


class HandshakeListener:
    """ROUTER socket on a background thread, answering ``GET_HANDSHAKE`` with ``document()``."""

    def __init__(self, host: str, port: int, document: Callable[[], bytes], *, local_peers_only: bool) -> None:
        self._document = document
        self._local_only = local_peers_only
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError as exc:
            self._sock.close()
            raise OSError(
                f"KvxferConnector cannot listen on {host}:{port} ({exc}); another vLLM instance on this host may "
                "use it: give each producer its own kv_port (KVTransferConfig.kv_port, or 0 for a free port) "
                "or kv_connector_extra_config 'kv_ip'"
            ) from None
        self.host = host
        self.served = 0
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvxfer-vllm-handshake", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart(copy=False)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return
            try:
                self._answer(frames)
            except Exception:  # a peer's bytes must never stop the listener
                logger.exception("kvxfer vllm: handshake request failed")

    def _answer(self, frames: list) -> None:
        if len(frames) != 3:
            return
        identity, request = frames[0].bytes, frames[2].bytes
        peer = frames[2].get("Peer-Address") or ""
        if self._local_only and not _is_loopback(peer):
            self.refused += 1
            reply = json.dumps({"error": f"peer {peer} is not on this host: without KVXFER_SECRET_FILE this producer "
                                          "serves its metas to same-host decodes only; configure the cluster secret "
                                          "on both sides"}).encode()
        elif request != GET_HANDSHAKE.encode():
            self.refused += 1
            reply = json.dumps({"error": "unknown request (run the same kvxfer on both sides)"}).encode()
        else:
            self.served += 1
            reply = self._document()
        self._sock.send_multipart([identity, b"", reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close()


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def fetch_handshake(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    """The producer's handshake document; ``PeerMetadataError`` when it cannot be had in time."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_HANDSHAKE_BYTES)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(GET_HANDSHAKE.encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise PeerMetadataError(
                f"no handshake from the prefill instance at {host}:{port} within {timeout_s}s (dead, unreachable, "
                "or not a KvxferConnector producer)"
            )
        raw = sock.recv()
    except zmq.ZMQError as exc:
        raise PeerMetadataError(f"handshake with the prefill instance at {host}:{port} failed: {exc}") from None
    finally:
        sock.close()
    try:
        document = json.loads(raw)
    except ValueError:
        raise PeerMetadataError(f"the prefill instance at {host}:{port} answered with a malformed handshake") from None
    if not isinstance(document, dict):
        raise PeerMetadataError(f"the prefill instance at {host}:{port} answered with a malformed handshake")
    if "error" in document:
        raise PeerMetadataError(f"the prefill instance at {host}:{port} refused the handshake: {document['error']!s:.300}")
    return document


def local_only_policy(cluster_secret: Optional[bytes]) -> bool:
    return cluster_secret is None
