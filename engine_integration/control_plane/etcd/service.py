"""The etcd plane's fleet side on one machine: an etcd reached (or started in demo mode) and a client.

``launch.DisaggCluster`` runs one when ``ClusterConfig(control_plane="etcd://...")``.

- An etcd that answers at the URL is used as is (its user's password from
  ``etcd_password_file`` or ``$KVXFER_ETCD_PASSWORD_FILE``; the cluster key from
  ``$KVXFER_SECRET_FILE``, else the cluster's secret written to a fresh 0600 file).
- ``etcd://`` with no endpoint, or a loopback endpoint where nothing answers (demo mode):
  a private etcd is started there, secured at once (``EtcdServer.secure``: a root user
  and a ``kvxfer`` user limited to ``/kvxfer/``, fresh random passwords kept in 0600
  files) and stopped with the cluster.

Engine processes get the URL and the *paths* of the password and key files on their
inherited pipe (``procs``, ``engine_options``), never in argv; no coordinator process runs.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
from typing import Any, Optional
from urllib.parse import urlsplit, urlunsplit

from engine_integration.control_plane.base import PlaneService
from engine_integration.control_plane.etcd.client import EtcdGenerationClient
from engine_integration.control_plane.etcd.gateway import EtcdError, EtcdHttpClient
from engine_integration.control_plane.etcd.server import EtcdServer
from engine_integration.control_plane.etcd.store import EtcdStore, parse_etcd_url

log = logging.getLogger(__name__)

_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def _write_private(folder: str, name: str, text: str) -> str:
    path = os.path.join(folder, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path


def _answers(endpoint: str, tls: Any = None) -> bool:
    probe = EtcdHttpClient([endpoint], timeout_s=0.5, request_timeout_s=0.5, tls=tls)
    try:
        probe.get("/health")
        return True
    except EtcdError:
        return False
    finally:
        probe.close()


class EtcdService(PlaneService):
    """etcd for one cluster: reached at the URL, or started here and secured (demo mode)."""

    def __init__(self, url: str, *, password_file: Optional[str] = None, secret: Optional[str] = None) -> None:
        self.requested_url = url
        self.url = ""
        self.server: Optional[EtcdServer] = None
        self.password_file = password_file       #: the etcd user's password (0600 file); demo mode: ours
        self.secret_file: Optional[str] = None   #: the cluster key: $KVXFER_SECRET_FILE's, else ``secret`` in a 0600 file
        self._secret = secret
        self._private_dir: Optional[str] = None
        self.store: Optional[EtcdStore] = None
        self._client: Optional[EtcdGenerationClient] = None

    def _private(self) -> str:
        if self._private_dir is None:
            self._private_dir = tempfile.mkdtemp(prefix="kvxfer-etcd-cluster-")   # 0700
        return self._private_dir

    def _ensure_etcd(self) -> str:
        """The URL engines use; starts and secures a private etcd in demo mode."""
        url = self.requested_url
        parts = urlsplit(url)
        if parts.scheme != "etcd":
            raise ValueError(f"control plane URL must start with etcd://, got {url!r}")
        _, _, hosts = parts.netloc.rpartition("@")
        endpoints = [h for h in hosts.split(",") if h]
        tls = parse_etcd_url(url).tls_context() if endpoints else None   # an etcd serving TLS answers over TLS
        if endpoints and (any(_answers(e, tls) for e in endpoints)
                          or not all(e.rpartition(":")[0] in _LOOPBACK for e in endpoints)):
            return url   # a real etcd: use it as configured
        port = int(endpoints[0].rpartition(":")[2]) if endpoints else None
        host = endpoints[0].rpartition(":")[0].strip("[]") if endpoints else "127.0.0.1"
        self.server = EtcdServer(host=host, client_port=port or 0).start()
        password = secrets.token_hex(16)
        self.server.secure(root_password=secrets.token_hex(16), user="kvxfer", password=password)
        self.password_file = _write_private(self._private(), "etcd-password", password)
        log.info("started a private etcd on %s (demo mode), auth on, user 'kvxfer'", self.server.endpoint)
        return urlunsplit(("etcd", f"kvxfer@{self.server.endpoint}", parts.path, parts.query, ""))

    def _ensure_secret_file(self) -> str:
        from kvxfer.security.auth import SECRET_FILE_ENV

        if os.environ.get(SECRET_FILE_ENV):
            return os.environ[SECRET_FILE_ENV]
        return _write_private(self._private(), "cluster-secret", self._secret or secrets.token_hex(32))

    def start(self) -> None:
        self.url = self._ensure_etcd()
        self.secret_file = self._ensure_secret_file()
        options = {"password_file": self.password_file} if self.password_file else {}
        self.store = EtcdStore(parse_etcd_url(self.url, secret_file=self.secret_file, **options))

    def engine_options(self) -> dict[str, Any]:
        return {"secret": None, "secret_file": self.secret_file, "etcd_password_file": self.password_file}

    @property
    def client(self) -> EtcdGenerationClient:
        if self._client is None:
            assert self.store is not None, "start() first"
            self._client = EtcdGenerationClient(self.store)
        return self._client

    def stop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()
        store, self.store = self.store, None
        if store is not None:
            store.close()
        server, self.server = self.server, None
        if server is not None:
            server.stop()
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None
