"""``DisaggCluster`` on the etcd control plane: etcd + prefill + decode on this machine.

``ClusterConfig(control_plane="etcd://...")`` selects it (``launch.make_cluster``).

- An etcd that answers at the URL is used as is (its user's password from
  ``etcd_password_file`` or ``$KVXFER_ETCD_PASSWORD_FILE``; the cluster key from
  ``$KVXFER_SECRET_FILE``, else the cluster's secret written to a fresh 0600 file).
- ``etcd://`` with no endpoint, or a loopback endpoint where nothing answers (demo mode):
  a private etcd is started there, secured at once (``EtcdServer.secure``: a root user
  and a ``kvxfer`` user limited to ``/kvxfer/``, fresh random passwords kept in 0600
  files) and stopped with the cluster.

Engine processes get the URL and the *paths* of the password and key files on their
inherited pipe (``procs``), never in argv; no coordinator process runs.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence
from urllib.parse import urlsplit, urlunsplit

from engine_integration.worker import EngineHost, EngineSpec, start_engine_host, start_engine_hosts

log = logging.getLogger("kvxfer.engine.etcd")

_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def _write_private(folder: str, name: str, text: str) -> str:
    path = os.path.join(folder, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path


def _answers(endpoint: str) -> bool:
    from engine_integration.control_plane.etcd_http import EtcdError, EtcdHttpClient

    probe = EtcdHttpClient([endpoint], timeout_s=0.5, request_timeout_s=0.5)
    try:
        probe.get("/health")
        return True
    except EtcdError:
        return False
    finally:
        probe.close()


class EtcdDisaggCluster:
    """etcd (started here or reached) + prefill + decode processes; use as a context manager."""

    def __init__(self, config: Any) -> None:
        from kvxfer.backends import construct_kv_transfer_backend_class

        self.config = config
        self.backend = construct_kv_transfer_backend_class(config.backend).name
        self.server: Any = None
        self.url = ""
        self.address = ""                  # what engine hosts are given (the URL)
        self.hosts: list[EngineHost] = []
        self.password_file: Optional[str] = config.etcd_password_file
        self.secret_file: Optional[str] = None
        self._private_dir: Optional[str] = None
        self._plane: Any = None
        self._client: Any = None

    # --- etcd -----------------------------------------------------------------------------
    def _private(self) -> str:
        if self._private_dir is None:
            self._private_dir = tempfile.mkdtemp(prefix="kvxfer-etcd-cluster-")   # 0700
        return self._private_dir

    def _ensure_etcd(self) -> str:
        """The URL engines use; starts and secures a private etcd in demo mode."""
        from engine_integration.control_plane.etcd_server import EtcdServer

        url = self.config.control_plane
        parts = urlsplit(url)
        if parts.scheme != "etcd":
            raise ValueError(f"control plane URL must start with etcd://, got {url!r}")
        user, _, hosts = parts.netloc.rpartition("@")
        endpoints = [h for h in hosts.split(",") if h]
        if endpoints and (any(_answers(e) for e in endpoints)
                          or not all(e.rpartition(":")[0] in _LOOPBACK for e in endpoints)):
            return url   # a real etcd: use it as configured
        port = int(endpoints[0].rpartition(":")[2]) if endpoints else None
        host = endpoints[0].rpartition(":")[0].strip("[]") if endpoints else "127.0.0.1"
        self.server = EtcdServer(host=host, client_port=port or 0).start()
        password = secrets.token_hex(16)
        self.server.secure(root_password=secrets.token_hex(16), user="kvxfer", password=password)
        self.password_file = _write_private(self._private(), "etcd-password", password)
        log.info("started a private etcd on %s (demo mode), auth on, user 'kvxfer'", self.server.endpoint)
        netloc = f"kvxfer@{self.server.endpoint}"
        return urlunsplit(("etcd", netloc, parts.path, parts.query, ""))

    def _ensure_secret_file(self) -> str:
        from kvxfer.security.auth import SECRET_FILE_ENV

        if os.environ.get(SECRET_FILE_ENV):
            return os.environ[SECRET_FILE_ENV]
        return _write_private(self._private(), "cluster-secret", self.config.secret or secrets.token_hex(32))

    # --- engines --------------------------------------------------------------------------
    def spec(self, role: str, identity: str, **overrides: Any) -> EngineSpec:
        from engine_integration.reference.model import default_device

        c = self.config
        base = EngineSpec(role=role, identity=identity, backend=c.backend, model=c.model,
                          device=c.device or default_device(),
                          num_blocks=c.prefill_blocks if role == "prefill" else c.decode_blocks,
                          transfer_timeout_s=c.transfer_timeout_s, secret=None, secret_file=self.secret_file,
                          control_plane=self.url, etcd_password_file=self.password_file)
        return replace(base, **overrides)

    def start(self) -> "EtcdDisaggCluster":
        from engine_integration.control_plane import open_control_plane
        from engine_integration.launch import IN_PROCESS_BACKENDS

        self.url = self.address = self._ensure_etcd()
        self.secret_file = self._ensure_secret_file()
        self._plane = open_control_plane(self.url, password_file=self.password_file, secret_file=self.secret_file)
        prefill, decode = self.spec("prefill", "prefill-0"), self.spec("decode", "decode-0")
        groups = [[prefill, decode]] if self.backend in IN_PROCESS_BACKENDS else [[prefill], [decode]]
        self.hosts.extend(start_engine_hosts(groups, self.url))
        return self

    def start_engine(self, spec: EngineSpec) -> EngineHost:
        host = start_engine_host([spec], self.url)
        self.hosts.append(host)
        return host

    def host_of(self, identity: str) -> EngineHost:
        return next(h for h in reversed(self.hosts) if identity in h.identities and h.alive())

    @property
    def plane(self) -> Any:
        return self._plane

    @property
    def client(self) -> Any:
        from engine_integration.etcd_engine import EtcdGenerationClient

        if self._client is None:
            self._client = EtcdGenerationClient(self._plane)
        return self._client

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 timeout_s: Optional[float] = None) -> list[Any]:
        return self.client.generate(prompts, max_new_tokens, timeout_s=timeout_s or self.config.request_timeout_s + 5)

    def stats(self) -> Any:
        """The coordinator's ``Stats`` shape: each engine's published figures, requests in flight."""
        return self.client.stats()

    def wait_for_stats(self, predicate: Callable[[Any], bool], timeout_s: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout_s
        stats = None
        while time.monotonic() < deadline:
            stats = self.stats()
            if predicate(stats):
                return stats
            time.sleep(0.1)
        raise TimeoutError(f"condition not reached within {timeout_s}s; last stats: {stats}")

    def stop(self) -> None:
        from engine_integration import procs

        if self._client is not None:
            try:
                self._client.close()
            finally:
                self._client = None
        for host in self.hosts:   # SIGTERM: each engine says goodbye (revokes its lease) and exits
            procs.stop(host.process, 10.0, terminate_first=True)
        self.hosts = []
        if self._plane is not None:
            self._plane.close()
            self._plane = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    def __enter__(self) -> "EtcdDisaggCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
