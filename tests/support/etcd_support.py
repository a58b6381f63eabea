"""Helpers for the etcd control-plane tests: a secured etcd, a cuttable TCP proxy, child instances and clients.

A child is a real process that registers under its own lease and keeps it alive from
its own keepalive thread, driven by JSON lines on stdin (answers on stdout), so a test
can ``kill -9`` it at any point of a handoff. Its configuration, etcd password and
cluster key included, arrives on stdin, never in argv.

Run as a script, this module *is* the child.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from engine_integration.control_plane.etcd.records import HandoffState  # noqa: E402
from engine_integration.control_plane.etcd.store import EtcdConfig, EtcdStore  # noqa: E402


@dataclass(frozen=True)
class Fleet:
    """Where the test etcd is and how to talk to it."""

    endpoint: str
    user: str
    password: str
    cluster_key: Optional[bytes]
    cluster: str = "test"
    ttl_s: int = 2
    poll_interval_s: float = 0.1
    endpoints: tuple[str, ...] = ()   #: every member's endpoint (a cluster); default ``(endpoint,)``

    def config(self, **over: Any) -> EtcdConfig:
        kw: dict[str, Any] = dict(endpoints=self.endpoints or (self.endpoint,), cluster=self.cluster, user=self.user,
                                  password=self.password, cluster_key=self.cluster_key, ttl_s=self.ttl_s,
                                  poll_interval_s=self.poll_interval_s, timeout_s=2.0)
        kw.update(over)
        return EtcdConfig(**kw)

    def plane(self, **over: Any) -> EtcdStore:
        return EtcdStore(self.config(**over))


def secured_etcd():
    """One secured etcd for a test module: (server, the kvxfer user's password). A module makes it
    its ``etcd`` fixture: ``etcd = pytest.fixture(scope="module", name="etcd")(secured_etcd)``."""
    from engine_integration.control_plane.etcd.server import EtcdServer

    server = EtcdServer().start()
    password = "kv-" + os.urandom(8).hex()
    server.secure(root_password=os.urandom(8).hex(), user="kvxfer", password=password)
    try:
        yield server, password
    finally:
        server.stop()


def secured_cluster(size: int = 3):
    """A secured Raft cluster of ``size`` real etcd members on loopback: (``EtcdCluster``, the kvxfer
    user's password). Members can be killed (``members[i].kill()``) and started again (``start()``)
    with their data; ``EtcdCluster.leader`` finds the leader from etcd's status endpoint."""
    from engine_integration.control_plane.etcd.server import EtcdCluster

    cluster = EtcdCluster(size).start()
    try:
        password = "kv-" + os.urandom(8).hex()
        cluster.secure(root_password=os.urandom(8).hex(), user="kvxfer", password=password)
        yield cluster, password
    finally:
        cluster.stop()


def password_file(folder: Path, password: str) -> str:
    """``password`` in a 0600 file (how engines get the etcd password: never in argv or a URL)."""
    path = folder / "etcd-password"
    path.write_text(password)
    path.chmod(0o600)
    return str(path)


_cluster_ids = itertools.count()


def fresh_fleet(etcd: Any, prefix: str, **over: Any) -> Fleet:
    """A ``Fleet`` on the module's secured etcd (``secured_etcd``) with its own cluster prefix and key."""
    server, password = etcd
    return Fleet(endpoint=server.endpoint, user="kvxfer", password=password, cluster_key=os.urandom(32),
                 cluster=f"{prefix}{next(_cluster_ids)}", **over)


def register_stand_in(store: EtcdStore, name: str, role: str, key: Optional[bytes], capacity_blocks: int = 64) -> Any:
    """Register ``store`` as ``name`` with a stand-in transport meta (``sealed_meta``)."""
    return store.register(name=name, role=role, transfer_meta=[sealed_meta(name, "in-proc", key)],
                          capacity_blocks=capacity_blocks)


def sealed_meta(name: str, incarnation_hint: str, key: Optional[bytes]) -> dict[str, Any]:
    """A stand-in for a backend's ``export_meta()``: sealed (and signed) the same way."""
    from kvxfer.meta.seal import HOST_FIELD, host_identity, seal_meta

    return seal_meta({"schema_version": 1, "backend": "local", "agent": name, "pid": os.getpid(),
                      "exported_by": incarnation_hint, HOST_FIELD: host_identity()}, key)


def wait_for(predicate: Any, timeout_s: float, interval_s: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy; that value, or None at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval_s)


def make_certificates(folder: Path, *, client_names: tuple[str, ...] = ("root", "kvxfer")) -> dict[str, Any]:
    """A throwaway PKI for TLS tests, made with ``cryptography``: a CA, etcd's server certificate (for
    127.0.0.1 and localhost), one client certificate per name in ``client_names``, one client certificate
    that carries a Common Name, and a stranger's CA with a client certificate of its own.

    Client certificates carry **no Common Name** (the name goes in a subjectAltName): with auth on,
    etcd's JSON gateway refuses every ``/v3`` request whose client certificate has one (it cannot map a
    CN to a user: ``embed/serve.go``). Returns paths: ``ca``, ``server_cert``, ``server_key``,
    ``client[name] = (cert, key)``, ``client_with_cn``, ``rogue_ca``, ``rogue_client = (cert, key)``,
    ``expired_client`` and ``future_client`` (of the CA, out of their validity dates, no CN), and
    ``tls``, the ``TlsFiles`` an ``EtcdServer`` serves with.
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from engine_integration.control_plane.etcd.server import TlsFiles

    now = datetime.datetime.now(datetime.timezone.utc)

    def write(name: str, key: Any, cert: Any) -> tuple[str, str]:
        cert_path, key_path = folder / f"{name}.pem", folder / f"{name}-key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        key_path.chmod(0o600)
        return str(cert_path), str(key_path)

    def issue(common_name: str, issuer: Any, issuer_key: Any, *, ca: bool = False, server: bool = False,
              with_cn: bool = True, valid_from_days: float = 0.0, valid_days: float = 1.0) -> tuple:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)] if with_cn else [])
        builder = (x509.CertificateBuilder().subject_name(subject)
                   .issuer_name(issuer.subject if issuer is not None else subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now + datetime.timedelta(days=valid_from_days, minutes=-5))
                   .not_valid_after(now + datetime.timedelta(days=valid_from_days + valid_days))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        elif not with_cn:   # an empty subject needs its name here, marked critical
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(common_name)]), critical=True)
        if not ca:
            usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server else \
                [ExtendedKeyUsageOID.CLIENT_AUTH]
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        cert = builder.sign(issuer_key if issuer_key is not None else key, hashes.SHA256())
        return key, cert

    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = issue("kvxfer test CA", None, None, ca=True)
    ca_path, _ = write("ca", ca_key, ca_cert)
    server_cert, server_key = write("server", *issue("etcd", ca_cert, ca_key, server=True))
    clients = {name: write(f"client-{name}", *issue(name, ca_cert, ca_key, with_cn=False)) for name in client_names}
    with_cn = write("client-with-cn", *issue("kvxfer", ca_cert, ca_key))
    rogue_key, rogue_cert = issue("someone else's CA", None, None, ca=True)
    rogue_ca, _ = write("rogue-ca", rogue_key, rogue_cert)
    rogue_client = write("rogue-client", *issue("kvxfer", rogue_cert, rogue_key, with_cn=False))
    expired = write("client-expired", *issue("kvxfer", ca_cert, ca_key, with_cn=False, valid_from_days=-30,
                                             valid_days=29))
    future = write("client-future", *issue("kvxfer", ca_cert, ca_key, with_cn=False, valid_from_days=30))
    tls = TlsFiles(ca_file=ca_path, cert_file=server_cert, key_file=server_key,
                   client_cert_file=clients[client_names[0]][0], client_key_file=clients[client_names[0]][1])
    return {"ca": ca_path, "server_cert": server_cert, "server_key": server_key, "client": clients,
            "client_with_cn": with_cn, "rogue_ca": rogue_ca, "rogue_client": rogue_client,
            "expired_client": expired, "future_client": future, "tls": tls}


class TcpProxy:
    """A loopback TCP forwarder whose connections a test can cut (RST) and refuse for a while, and which
    can lose the answer to a request etcd has applied (``lose_answers``): the real failure behind a
    repeated call."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._down = threading.Event()
        self._closed = False
        self._lose: dict[bytes, int] = {}
        self.lost_answers = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_answers(self, path: bytes, count: int = 1) -> None:
        """The next ``count`` requests to ``path`` reach etcd (which applies them) and their answers are
        dropped: the client's connection is reset instead, as when a link or a member fails mid-call."""
        with self._lock:
            self._lose[path] = self._lose.get(path, 0) + count

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self._down.is_set():
                self._reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                self._reset(client)
                continue
            with self._lock:
                self._socks.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        doomed = False   # the request in flight on this connection is to lose its answer
        try:
            while True:
                ready, _, _ = select.select([a, b], [], [], 0.5)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        raise OSError("closed")
                    if s is a:
                        with self._lock:
                            for path, left in self._lose.items():
                                if left and b"POST " + path + b" " in data:
                                    self._lose[path], doomed = left - 1, True
                    elif doomed:
                        self.lost_answers += 1
                        raise OSError("answer lost")   # etcd answered (so it applied it); the client never hears
                    (b if s is a else a).sendall(data)
        except (OSError, ValueError):
            pass
        finally:
            for s in (a, b):
                self._reset(s)

    @staticmethod
    def _reset(s: socket.socket) -> None:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()
        except OSError:
            pass

    def cut(self) -> None:
        """Reset every open connection and refuse new ones until ``restore``."""
        self._down.set()
        with self._lock:
            socks, self._socks = self._socks, set()
        for s in socks:
            self._reset(s)

    def restore(self) -> None:
        self._down.clear()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self.listener.close()


class Child:
    """A kvxfer instance in its own process, registered in etcd, driven over stdin/stdout."""

    def __init__(self, fleet: Fleet, name: str, role: str, *, endpoint: Optional[str] = None,
                 cluster_key: Any = "fleet") -> None:
        self.name, self.role = name, role
        env = dict(os.environ, PYTHONPATH=str(REPO))
        env.pop("KVXFER_SECRET_FILE", None)
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True, bufsize=1)
        key = fleet.cluster_key if cluster_key == "fleet" else cluster_key
        self._send({"endpoint": endpoint or fleet.endpoint, "user": fleet.user, "password": fleet.password,
                    "key": key.hex() if key else None, "cluster": fleet.cluster, "ttl_s": fleet.ttl_s,
                    "name": name, "role": role})
        self.ready: Optional[dict[str, Any]] = None

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _recv(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"child {self.name} did not answer within {timeout_s}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child {self.name} exited with {self.proc.wait()}")
        return json.loads(line)

    def wait_ready(self, timeout_s: float = 30.0) -> dict[str, Any]:
        if self.ready is None:
            self.ready = self._recv(timeout_s)
        return self.ready

    @property
    def incarnation(self) -> str:
        return str(self.wait_ready()["incarnation"])

    def do(self, op: str, timeout_s: float = 10.0, **args: Any) -> dict[str, Any]:
        self._send({"op": op, **args})
        reply = self._recv(timeout_s)
        if "error" in reply:
            raise RuntimeError(f"child {self.name} {op}: {reply['error']}")
        return reply

    def kill9(self) -> float:
        """SIGKILL; returns the monotonic time of the kill."""
        t = time.monotonic()
        self.proc.kill()
        self.proc.wait()
        return t

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


class ClientChild(Child):
    """An ``EtcdGenerationClient`` in its own process (so that a test can ``SIGSTOP`` it), driven over stdin/stdout.

    It reaches the fleet like an engine does: the plane's URL and the *paths* of the etcd password and
    cluster key files, sent on stdin (never in argv). Ops (``do``): ``submit`` (prompts -> ids), ``poll``
    (one poll), ``collect`` (ids, wait_s -> [tokens, error] each, and
    the client's lease renewals)."""

    def __init__(self, url: str, password_file: str, secret_file: str) -> None:  # noqa: D107 - not Child's
        self.name, self.role = "client-child", "client"
        env = dict(os.environ, PYTHONPATH=str(REPO))
        env.pop("KVXFER_SECRET_FILE", None)
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True, bufsize=1)
        self._send({"client": True, "url": url, "password_file": password_file, "secret_file": secret_file})
        self.ready = self._recv(30.0)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)


def _client_main(cfg: dict[str, Any]) -> None:
    """``ClientChild``'s process: one client, commands from stdin until EOF (then it closes: goodbye)."""
    from engine_integration.control_plane.etcd.client import EtcdGenerationClient
    from engine_integration.control_plane.etcd.store import parse_etcd_url

    store = EtcdStore(parse_etcd_url(cfg["url"], password_file=cfg["password_file"], secret_file=cfg["secret_file"]))
    client = EtcdGenerationClient(store)
    print(json.dumps({"name": client.name, "lease": client.lease, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "submit":
                reply: dict[str, Any] = {"ids": [client.submit(p, cmd["max_new_tokens"]) for p in cmd["prompts"]]}
            elif op == "poll":
                client.poll()
                reply = {"in_flight": client.in_flight, "lease": client.lease}
            elif op == "collect":
                results = client.collect(cmd["ids"], cmd["wait_s"])
                reply = {"results": [[list(r.tokens) if r.tokens is not None else None, r.error] for r in results],
                         "renewals": getattr(client, "lease_renewals", None), "lease": client.lease}
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # report to the driving test; the child stays up
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    client.close()
    store.close()


def _child_main() -> None:
    """Register, answer ``ready``, then run commands from stdin until EOF (then exit without goodbye)."""
    cfg = json.loads(sys.stdin.readline())
    if cfg.get("client"):
        _client_main(cfg)
        return
    key = bytes.fromhex(cfg["key"]) if cfg["key"] else None
    plane = EtcdStore(EtcdConfig(endpoints=(cfg["endpoint"],), cluster=cfg["cluster"], user=cfg["user"],
                                        password=cfg["password"], cluster_key=key, ttl_s=cfg["ttl_s"],
                                        timeout_s=2.0))
    hint = os.urandom(4).hex()
    record = plane.register(name=cfg["name"], role=cfg["role"], transfer_meta=[sealed_meta(cfg["name"], hint, key)],
                            capacity_blocks=64)
    print(json.dumps({"incarnation": record.incarnation, "lease": record.lease, "pid": os.getpid(),
                      "meta_hint": hint}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "publish":
                plane.publish_handoff(cmd["request_id"], reader=cmd["reader"],
                                      reader_incarnation=cmd["reader_incarnation"], descriptor=cmd.get("descriptor", {}))
                reply: dict[str, Any] = {"ok": True}
            elif op == "reader_state":
                plane.set_reader_state(cmd["source"], cmd["request_id"], HandoffState(cmd["state"]),
                                       source_incarnation=cmd["source_incarnation"])
                reply = {"ok": True}
            elif op == "verdicts":
                view = plane.snapshot()
                verdicts = (view.source_verdicts if cfg["role"] == "prefill" else view.reader_verdicts)(
                    record.name, record.incarnation)
                reply = {"verdicts": [[v.source, v.request_id, v.action] for v in verdicts]}
            elif op == "health":
                h = plane.health()
                reply = {"ok": h.ok, "lease_lost": h.lease_lost, "valid": plane.lease_valid()}
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # report to the driving test; the child stays up
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    _child_main()
