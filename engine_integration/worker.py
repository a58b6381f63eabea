"""An engine host process: builds engines, registers them with their control plane, runs their loop.

One host usually runs one engine. With the in-process ``local`` transport the prefill
and decode engines must share a process, so a host can run several, stepped in turn
by one loop (no threads: the engines never race on the pools or the sockets). The same
code runs on either control plane: an engine is a ``DisaggDynamicInferenceEngine`` given
``open_control_plane(url)``, for a coordinator's ``tcp://`` address or an ``etcd://`` URL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence

from engine_integration.reference.config import ModelConfig
from kvxfer.defaults import TRANSFER_TIMEOUT_S


@dataclass(frozen=True)
class EngineSpec:
    """How to build and connect one engine."""

    role: str
    identity: str
    num_blocks: int
    backend: str = "local"
    model: ModelConfig = field(default_factory=ModelConfig)
    device: str = "cpu"
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S
    queue_timeout_s: float = 120.0
    heartbeat_interval_s: float = 0.2
    coordinator_timeout_s: float = 10.0
    secret: Optional[str] = None       #: travels to the host process on a pipe, never in argv
    secret_file: Optional[str] = None
    insecure: bool = False
    control_plane: Optional[str] = None       #: the plane's URL (else the address the host is given)
    etcd_password_file: Optional[str] = None  #: the etcd user's password (a 0600 file; the path travels on the pipe)
    #: push backends: the ``torch.distributed`` world this engine joins before it builds its backend,
    #: ``kvxfer.backends.process_group.GroupSpec`` fields plus ``rank`` (fixed at launch; see ``launch.DisaggCluster``)
    process_group: Optional[dict[str, Any]] = None
    #: the engine computes nothing while this file exists (``DisaggDynamicInferenceEngine.pause_file``)
    pause_file: Optional[str] = None

    def plane_options(self, url: str) -> dict[str, Any]:
        """What ``open_control_plane(url)`` needs from this spec."""
        if url.startswith("etcd://"):
            return {"password_file": self.etcd_password_file, "secret_file": self.secret_file,
                    "insecure": self.insecure}
        return {"secret": self.secret, "secret_file": self.secret_file, "insecure": self.insecure,
                "heartbeat_interval_s": self.heartbeat_interval_s, "coordinator_timeout_s": self.coordinator_timeout_s}


def build_engine(spec: EngineSpec, plane_url: str) -> Any:
    """A ``DisaggDynamicInferenceEngine`` registered with the control plane at ``spec.control_plane``
    (else ``plane_url``); raises ``RegistrationRefused``.

    A cluster key file (``spec.secret_file``) becomes this process's ``$KVXFER_SECRET_FILE``
    before the transport exports anything: it signs the metas as well as the plane's traffic.
    A secret given as a value (``spec.secret``) is written to a private file of this process
    first: the transports read their meta key only from ``$KVXFER_SECRET_FILE``, and a key that
    reached the plane alone would leave every meta unsigned.
    """
    from engine_integration.control_plane import open_control_plane
    from engine_integration.disagg_engine import DisaggDynamicInferenceEngine
    from engine_integration.reference import build_reference_engine
    from kvxfer.security.auth import SECRET_FILE_ENV

    if spec.secret is not None and not spec.secret_file:
        spec = replace(spec, secret=None, secret_file=_private_secret_file(spec.secret))
    if spec.secret_file:
        os.environ[SECRET_FILE_ENV] = spec.secret_file
    url = spec.control_plane or plane_url
    plane = open_control_plane(url, **spec.plane_options(url))
    engine = build_reference_engine(spec.model, spec.num_blocks, spec.device, DisaggDynamicInferenceEngine)
    try:
        engine.connect(plane, role=spec.role, name=spec.identity, backend=spec.backend,
                       transfer_timeout_s=spec.transfer_timeout_s, queue_timeout_s=spec.queue_timeout_s)
    except BaseException:
        engine.disconnect("registration failed")
        raise
    engine.pause_file = spec.pause_file
    return engine


def _private_secret_file(secret: str) -> str:
    """``secret`` in a file of this process's memory (gone with it, even when killed)."""
    from kvxfer.security.auth import process_secret_file

    return process_secret_file(secret)


def serve(engines: Sequence[Any], *, idle_wait_s: float = 0.05) -> None:
    """Step every engine until each one is told to stop (by its plane, or SIGTERM: a clean goodbye).

    The loop never spins idle: with compute to do it steps at once; with only pulls in
    flight it naps the millisecond ``serve_step`` asks for (the transport progresses on its
    own, and a spinning loop would steal the CPU it needs); otherwise it sleeps until its
    planes need it (a coordinator's message wakes it at once) or ``idle_wait_s`` passes.
    """
    import signal

    import zmq

    def _stop(signum: int, _frame: Any) -> None:
        for engine in engines:
            engine.shutdown_reason = engine.shutdown_reason or f"signal {signum}"

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
    sockets = [engine.socket for engine in engines]
    poller = None
    if all(sock is not None for sock in sockets):
        poller = zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
    while any(e.shutdown_reason is None for e in engines):
        wait = idle_wait_s
        for engine in engines:
            if engine.shutdown_reason is None:
                wait = min(wait, engine.serve_step())
        if wait > 0:
            if poller is not None:
                poller.poll(int(wait * 1000) or 1)
            else:
                time.sleep(wait)


def host_main(specs: Sequence[EngineSpec], plane_url: str, ready_fd: int) -> int:
    """Process body: build and register, report ready (or the refusal) on ``ready_fd``, serve."""
    import torch

    from engine_integration import procs

    torch.set_num_threads(1)  # tiny model; and the same math in every process
    engines: list[Any] = []
    group = next((s.process_group for s in specs if s.process_group), None)
    try:
        if group is not None:  # a push backend: the world must exist before the backend is built
            from kvxfer.backends.process_group import GroupSpec, join_group

            fields = dict(group)
            rank = int(fields.pop("rank"))
            join_group(GroupSpec(**fields), rank)
        for spec in specs:
            engines.append(build_engine(spec, plane_url))
    except Exception as exc:  # reported to the launcher, which raises it with this reason
        procs.report({"refused": f"{type(exc).__name__}: {exc}"}, ready_fd)
        for engine in engines:
            engine.disconnect("startup failed")
        return 3
    procs.report({"ready": [e.identity for e in engines], "pid": os.getpid()}, ready_fd)
    try:
        serve(engines)
    finally:
        for engine in engines:
            engine.disconnect(engine.shutdown_reason or "stopping")
    return 0  # a push backend's process group is not destroyed: a receive still posted would block that


def spec_from_dict(d: dict[str, Any]) -> EngineSpec:
    return EngineSpec(**{**d, "model": ModelConfig(**d["model"])})


class EngineStartError(RuntimeError):
    """An engine host did not come up; the message carries its reason (e.g. the refusal)."""


@dataclass
class EngineHost:
    """A started engine host process (see ``start_engine_host``)."""

    process: subprocess.Popen
    identities: list[str]

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: the crash the coordinator must survive."""
        self.process.kill()
        self.process.wait(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        from engine_integration import procs

        procs.stop(self.process, timeout_s)


def start_engine_host(specs: Sequence[EngineSpec], plane_url: str, *,
                      start_timeout_s: float = 120.0) -> EngineHost:
    """Start a host process and wait until its engines are registered (or refused)."""
    return start_engine_hosts([specs], plane_url, start_timeout_s=start_timeout_s)[0]


def start_engine_hosts(groups: Sequence[Sequence[EngineSpec]], plane_url: str, *,
                       start_timeout_s: float = 120.0) -> list[EngineHost]:
    """One host process per group of specs, started together (their imports overlap)."""
    from engine_integration import procs

    procs_ = [procs.launch("engine_integration.worker",
                           {"address": plane_url, "specs": [asdict(s) for s in specs]})
              for specs in groups]
    hosts, error = [], None
    for proc, specs in zip(procs_, groups):
        try:
            ready = procs.wait_ready(proc, "engine_integration.worker", start_timeout_s)
        except procs.ProcessStartError as exc:
            ready = {"refused": str(exc)}
        if "ready" in ready:
            hosts.append(EngineHost(proc, list(ready["ready"])))
        else:
            procs.stop(proc)
            error = error or EngineStartError(f"engine host {[s.identity for s in specs]}: {ready.get('refused')}")
    if error is not None:
        for host in hosts:
            host.stop()
        raise error
    return hosts


if __name__ == "__main__":
    from engine_integration import procs as _procs

    _payload = _procs.read_payload(int(sys.argv[1]))
    sys.exit(host_main([spec_from_dict(d) for d in _payload["specs"]], _payload["address"], int(sys.argv[2])))
