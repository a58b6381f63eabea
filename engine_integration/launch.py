"""Run generation co-located or disaggregated; the ``kvxfer generate`` command's engine room.

``DisaggCluster`` starts a coordinator and engine host processes on loopback and stops
them (every wait bounded); with the in-process ``local`` transport the prefill and
decode engines share one host process, with any other transport each gets its own.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from engine_integration.client import CoordinatorClient, GenerationResult
from engine_integration.coordinator import CoordinatorConfig, start_coordinator_process, stop_coordinator_process
from engine_integration.reference.config import ModelConfig
from engine_integration.worker import EngineHost, EngineSpec, start_engine_host, start_engine_hosts
from kvxfer.security.auth import SECRET_FILE_ENV, load_secret

#: Transports that only reach registrations in their own process.
IN_PROCESS_BACKENDS = frozenset({"local"})


def default_cluster_secret() -> str:
    """The secret a launched cluster authenticates its control frames with.

    Every process of the cluster is started by the launcher, so a fresh random
    secret shared only with them is enough; a deployment names its own secret
    file in ``$KVXFER_SECRET_FILE``.
    """
    if os.environ.get(SECRET_FILE_ENV):
        return load_secret().decode()
    return secrets.token_hex(32)


@dataclass(frozen=True)
class ClusterConfig:
    backend: str = "local"
    model: ModelConfig = field(default_factory=ModelConfig)
    prefill_blocks: int = 1024
    decode_blocks: int = 512
    heartbeat_timeout_s: float = 3.0
    request_timeout_s: float = 120.0
    transfer_timeout_s: float = 30.0
    #: cluster secret keying every control connection: $KVXFER_SECRET_FILE's, else a fresh one per cluster.
    #: It reaches the processes started here on inherited pipes, never in their argv.
    secret: Optional[str] = field(default_factory=lambda: default_cluster_secret())
    pin_grace_s: Optional[float] = 10.0  #: see ``CoordinatorConfig.pin_grace_s``
    device: Optional[str] = None  #: None: a GPU where present, else the CPU
    #: None: the embedded ZeroMQ coordinator; ``etcd://...``: the etcd fleet control plane
    #: (``engine_integration.etcd_launch``; a private, secured etcd is started in demo mode)
    control_plane: Optional[str] = None
    etcd_password_file: Optional[str] = None  #: else ``$KVXFER_ETCD_PASSWORD_FILE`` (an etcd started here: its own)


class DisaggCluster:
    """Coordinator + prefill + decode on this machine (use as a context manager)."""

    def __init__(self, config: ClusterConfig = ClusterConfig()) -> None:
        from kvxfer.backends import construct_kv_transfer_backend_class

        self.config = config
        self.backend = construct_kv_transfer_backend_class(config.backend).name
        self.coordinator: Any = None
        self.address = ""
        self.hosts: list[EngineHost] = []
        self._client: Optional[CoordinatorClient] = None

    def spec(self, role: str, identity: str, **overrides: Any) -> EngineSpec:
        from engine_integration.reference.model import default_device

        c = self.config
        base = EngineSpec(role=role, identity=identity, backend=c.backend, model=c.model,
                          device=c.device or default_device(),
                          num_blocks=c.prefill_blocks if role == "prefill" else c.decode_blocks,
                          transfer_timeout_s=c.transfer_timeout_s, secret=c.secret)
        return replace(base, **overrides)

    def start(self) -> "DisaggCluster":
        c = self.config
        self.coordinator, self.address = start_coordinator_process(CoordinatorConfig(
            heartbeat_timeout_s=c.heartbeat_timeout_s, request_timeout_s=c.request_timeout_s, secret=c.secret,
            pin_grace_s=c.pin_grace_s))
        prefill, decode = self.spec("prefill", "prefill-0"), self.spec("decode", "decode-0")
        groups = [[prefill, decode]] if self.backend in IN_PROCESS_BACKENDS else [[prefill], [decode]]
        self.hosts.extend(start_engine_hosts(groups, self.address))
        return self

    def start_engine(self, spec: EngineSpec) -> EngineHost:
        """Another engine host (e.g. a restarted decode); raises ``EngineStartError`` if refused."""
        host = start_engine_host([spec], self.address)
        self.hosts.append(host)
        return host

    def host_of(self, identity: str) -> EngineHost:
        return next(h for h in reversed(self.hosts) if identity in h.identities and h.alive())

    @property
    def client(self) -> CoordinatorClient:
        if self._client is None:
            self._client = CoordinatorClient(self.address, secret=self.config.secret)
        return self._client

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 timeout_s: Optional[float] = None) -> list[GenerationResult]:
        return self.client.generate(prompts, max_new_tokens, timeout_s=timeout_s or self.config.request_timeout_s + 5)

    def wait_for_stats(self, predicate: Callable[[Any], bool], timeout_s: float = 20.0) -> Any:
        """Poll the coordinator's stats until ``predicate(stats)``; raises ``TimeoutError``."""
        deadline = time.monotonic() + timeout_s
        stats = None
        while time.monotonic() < deadline:
            stats = self.client.stats()
            if predicate(stats):
                return stats
            time.sleep(0.1)
        raise TimeoutError(f"condition not reached within {timeout_s}s; last stats: {stats}")

    def stop(self) -> None:
        if self._client is not None:
            try:
                self._client.shutdown("cluster stopping")
            finally:
                self._client.close()
                self._client = None
        if self.coordinator is not None:
            stop_coordinator_process(self.coordinator, timeout_s=5)
            self.coordinator = None
        for host in self.hosts:
            host.stop()
        self.hosts = []

    def __enter__(self) -> "DisaggCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def generate_colocated(prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                       model: ModelConfig = ModelConfig(), num_blocks: int = 1024,
                       device: Optional[str] = None) -> list[GenerationResult]:
    """Prefill and decode in one engine, one pool: the reference output."""
    import torch

    from engine_integration.reference import ReferenceDynamicEngine, build_reference_engine
    from engine_integration.reference.model import default_device

    torch.set_num_threads(1)
    engine = build_reference_engine(model, num_blocks, device or default_device(), ReferenceDynamicEngine)
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, max_new_tokens)
    records: dict[int, dict] = {}
    while engine.has_unfinished_requests() or engine.outputs:
        for record in engine.step():
            records[record["request_id"]] = record
    return [GenerationResult(tuple(r["tokens"]) if "tokens" in r else None, r.get("error"))
            for r in (records[i] for i in range(len(prompts)))]


def make_cluster(config: ClusterConfig = ClusterConfig()) -> Any:
    """A ``DisaggCluster`` (coordinator), or an ``EtcdDisaggCluster`` when ``config.control_plane`` is etcd."""
    if config.control_plane:
        from engine_integration.etcd_launch import EtcdDisaggCluster

        return EtcdDisaggCluster(config)
    return DisaggCluster(config)


def generate_disaggregated(prompts: Sequence[Sequence[int]], max_new_tokens: int,
                           config: ClusterConfig = ClusterConfig()) -> list[GenerationResult]:
    with make_cluster(config) as cluster:
        return cluster.generate(prompts, max_new_tokens)


def read_prompts(path: str) -> list[list[int]]:
    """JSON lines, each a list of token ids (blank lines skipped)."""
    prompts = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            value = json.loads(line)
            if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
                raise ValueError(f"{path}:{n}: expected a JSON list of token ids, got {line.strip()[:60]!r}")
            prompts.append(value)
    return prompts


def run_generate_command(prompts_path: str, max_new_tokens: int, *, disagg: bool, backend: str,
                         timings: bool = False, control_plane: Optional[str] = None) -> int:
    """``kvxfer generate``: one JSON line per prompt (token ids, or ``{"error": ...}``); 1 if any failed."""
    prompts = read_prompts(prompts_path)
    if disagg:
        results = generate_disaggregated(prompts, max_new_tokens,
                                         ClusterConfig(backend=backend, control_plane=control_plane))
    else:
        results = generate_colocated(prompts, max_new_tokens)
    failed = 0
    for i, result in enumerate(results):
        if result.ok:
            line: Any = list(result.tokens or ())
            if timings:
                line = {"tokens": line, **result.timings, "pulled_blocks": result.pulled_blocks,
                        "cached_prefix_blocks": result.cached_prefix_blocks}
        else:
            failed += 1
            line = {"error": result.error}
            print(f"prompt {i + 1}: {result.error}", file=sys.stderr)
        print(json.dumps(line), flush=True)
    if failed:
        print(f"{failed} of {len(results)} requests failed", file=sys.stderr)
    return 1 if failed else 0
