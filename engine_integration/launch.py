"""Run generation co-located or disaggregated; the ``kvxfer generate`` command's engine room.

``DisaggCluster`` is the one launcher for both control planes: it starts the plane's
fleet side (``control_plane.plane_service``: a coordinator process, or an etcd reached
or started in demo mode for ``ClusterConfig(control_plane="etcd://...")``) and engine
host processes on loopback, and stops them (every wait bounded); with the in-process
``local`` transport the prefill and decode engines share one host process, with any
other transport each gets its own.

A push backend (``is_push``: ``nccl``) needs every engine in one ``torch.distributed``
world. The launcher hosts its TCP store (a port of 127.0.0.1 the OS picks), fixes the
ranks at launch (prefill 0, decode 1; world size = number of engines) and each engine
host joins before it builds its backend: Gloo for host pools, ``cpu:gloo,cuda:nccl`` for
GPU pools. The world cannot grow or heal, so restarting an engine (``start_engine``) is
refused for push backends: restart the whole cluster instead.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from engine_integration.control_plane import (GenerationClient, GenerationResult, PlaneService, plane_service,
                                              push_refusal)
from engine_integration.prompts import read_prompts
from engine_integration.reference.config import ModelConfig
from engine_integration.worker import EngineHost, EngineSpec, start_engine_host, start_engine_hosts
from kvxfer.defaults import MAX_TIMEOUT_S, MIN_TIMEOUT_S, TRANSFER_TIMEOUT_S, bounded_float, bounded_int
from kvxfer.security.auth import SECRET_FILE_ENV, load_secret


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
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S
    #: cluster secret keying every control connection: $KVXFER_SECRET_FILE's, else a fresh one per cluster.
    #: It reaches the processes started here on inherited pipes, never in their argv.
    secret: Optional[str] = field(default_factory=lambda: default_cluster_secret())
    pin_grace_s: Optional[float] = 10.0  #: see ``CoordinatorConfig.pin_grace_s``
    device: Optional[str] = None  #: None: a GPU where present, else the CPU
    #: None: the embedded ZeroMQ coordinator; ``etcd://...``: the etcd fleet control plane
    #: (``control_plane.etcd.service``; a private, secured etcd is started in demo mode)
    control_plane: Optional[str] = None
    etcd_password_file: Optional[str] = None  #: else ``$KVXFER_ETCD_PASSWORD_FILE`` (an etcd started here: its own)
    #: decode choice by expected cached prefix (``policy.pick_decode``); False: least loaded only
    prefix_routing: bool = True
    #: a folder where a file named after an engine pauses its compute (``EngineSpec.pause_file``): a
    #: test holds a state (a decode's pool full of a running request) until it has observed it
    pause_dir: Optional[str] = None

    def __post_init__(self) -> None:
        """The numbers the engines take from here, finite and in range (``kvxfer.defaults.bounded_float``);
        the coordinator's own (``heartbeat_timeout_s``, ``request_timeout_s``, ``pin_grace_s``) are
        checked by ``CoordinatorConfig``, which they become."""
        bounded_float("ClusterConfig.transfer_timeout_s", self.transfer_timeout_s, MIN_TIMEOUT_S, MAX_TIMEOUT_S,
                      unit="seconds")
        for name in ("prefill_blocks", "decode_blocks"):
            bounded_int(f"ClusterConfig.{name}", getattr(self, name), 1, 1 << 24)


def _with_prefix_routing(url: str, on: bool) -> str:
    """An etcd URL whose prefills route least loaded only when ``on`` is False (its ``prefix_routing=0``)."""
    if on or "prefix_routing=" in url:
        return url
    return url + ("&" if "?" in url else "?") + "prefix_routing=0"


class DisaggCluster:
    """A control plane + prefill + decode on this machine (use as a context manager)."""

    def __init__(self, config: ClusterConfig = ClusterConfig()) -> None:
        from kvxfer.backends import construct_kv_transfer_backend_class
        from kvxfer.errors import BackendUnavailableError

        self.config = config
        cls = construct_kv_transfer_backend_class(config.backend)
        self.backend = cls.name
        self.is_push = bool(cls.is_push)
        #: False (``local``): both engines must run in one host process, where the transport reaches.
        self.reads_other_processes = bool(cls.reads_other_processes)
        refused = push_refusal(config.control_plane, config.backend)
        if refused:
            raise BackendUnavailableError(f"{refused} (choose a pull backend, or leave control_plane unset for the "
                                          "embedded coordinator)")
        self._store: Any = None  # push backends: the process group's TCP store, hosted here
        self.service: PlaneService = (
            plane_service(_with_prefix_routing(config.control_plane, config.prefix_routing),
                          password_file=config.etcd_password_file, secret=config.secret)
            if config.control_plane else
            plane_service(None, heartbeat_timeout_s=config.heartbeat_timeout_s,
                          request_timeout_s=config.request_timeout_s, secret=config.secret,
                          pin_grace_s=config.pin_grace_s, prefix_routing=config.prefix_routing))
        self.hosts: list[EngineHost] = []

    @property
    def address(self) -> str:
        """The plane's URL engines connect to (a coordinator's ``tcp://`` address, or ``etcd://...``)."""
        return self.service.url

    def spec(self, role: str, identity: str, **overrides: Any) -> EngineSpec:
        from engine_integration.reference.model import default_device

        c = self.config
        base = EngineSpec(role=role, identity=identity, backend=c.backend, model=c.model,
                          device=c.device or default_device(),
                          num_blocks=c.prefill_blocks if role == "prefill" else c.decode_blocks,
                          transfer_timeout_s=c.transfer_timeout_s, control_plane=self.service.url,
                          pause_file=os.path.join(c.pause_dir, identity) if c.pause_dir else None,
                          **self.service.engine_options())
        return replace(base, **overrides)

    def start(self) -> "DisaggCluster":
        self.service.start()
        prefill, decode = self.spec("prefill", "prefill-0"), self.spec("decode", "decode-0")
        if self.is_push:
            prefill, decode = self._join_world([prefill, decode])
        groups = [[prefill], [decode]] if self.reads_other_processes else [[prefill, decode]]
        self.hosts.extend(start_engine_hosts(groups, self.service.url))
        return self

    def _join_world(self, specs: list[EngineSpec]) -> list[EngineSpec]:
        """Push backends: host the world's TCP store; each spec gets its rank (fixed: the list's order)."""
        import datetime

        import torch.distributed as dist

        c = self.config
        join_timeout_s = 60.0
        self._store = dist.TCPStore("127.0.0.1", 0, len(specs), is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=join_timeout_s))
        on_gpu = [s for s in specs if not s.device.startswith("cpu")]
        group_backend = "cpu:gloo,cuda:nccl" if on_gpu else "gloo"
        if on_gpu:  # NCCL refuses two ranks on one GPU: rank r's pool goes on cuda:r
            import torch

            from kvxfer.errors import BackendUnavailableError

            if torch.cuda.device_count() < len(specs):
                raise BackendUnavailableError(
                    f"the {self.backend} backend puts each of the {len(specs)} engines on its own GPU (NCCL refuses "
                    f"two ranks on one device), and this machine has {torch.cuda.device_count()}; run the pools in "
                    "host memory over Gloo instead (ClusterConfig(device='cpu'), or CUDA_VISIBLE_DEVICES= for "
                    "'kvxfer generate')")
            specs = [replace(s, device=f"cuda:{rank}") for rank, s in enumerate(specs)]
        world = {"host": "127.0.0.1", "port": int(self._store.port), "world_size": len(specs),
                 "backend": group_backend, "join_timeout_s": join_timeout_s,
                 "timeout_s": max(300.0, 2 * c.transfer_timeout_s)}
        return [replace(s, process_group={**world, "rank": rank}) for rank, s in enumerate(specs)]

    def start_engine(self, spec: EngineSpec) -> EngineHost:
        """Another engine host (e.g. a restarted decode); raises ``EngineStartError`` if refused.

        Refused for push backends: their process group's world is fixed at launch."""
        if self.is_push:
            from engine_integration.worker import EngineStartError

            raise EngineStartError(f"the {self.backend} backend's process group is fixed at launch: an engine "
                                   "cannot join or rejoin it; restart the whole cluster")
        host = start_engine_host([spec], self.service.url)
        self.hosts.append(host)
        return host

    def host_of(self, identity: str) -> EngineHost:
        return next(h for h in reversed(self.hosts) if identity in h.identities and h.alive())

    @property
    def client(self) -> GenerationClient:
        return self.service.client

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 timeout_s: Optional[float] = None) -> list[GenerationResult]:
        return self.client.generate(prompts, max_new_tokens, timeout_s=timeout_s or self.config.request_timeout_s + 5)

    def stats(self) -> Any:
        return self.client.stats()

    def wait_for_stats(self, predicate: Callable[[Any], bool], timeout_s: float = 20.0) -> Any:
        """Poll the plane's stats until ``predicate(stats)``; raises ``TimeoutError``."""
        deadline = time.monotonic() + timeout_s
        stats = None
        while time.monotonic() < deadline:
            stats = self.stats()
            if predicate(stats):
                return stats
            time.sleep(0.1)
        raise TimeoutError(f"condition not reached within {timeout_s}s; last stats: {stats}")

    def stop(self) -> None:
        """Every engine host first (SIGTERM: each says goodbye to its plane and exits), then the plane."""
        from engine_integration import procs

        try:
            for host in self.hosts:
                procs.stop(host.process, 10.0, terminate_first=True)
        finally:
            self.hosts = []
            self._store = None
            self.service.stop()

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


def generate_disaggregated(prompts: Sequence[Sequence[int]], max_new_tokens: int,
                           config: ClusterConfig = ClusterConfig()) -> list[GenerationResult]:
    with DisaggCluster(config) as cluster:
        return cluster.generate(prompts, max_new_tokens)


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
