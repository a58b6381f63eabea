"""The connector's settings, read once from ``KVTransferConfig`` and checked.

Everything kvxfer-specific comes from ``kv_connector_extra_config``; a key kvxfer does not
know is an error naming the known ones (a typo must not silently fall back to a default).
Pure: no vLLM import, so the checks are testable anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Sequence

from kvxfer.defaults import TRANSFER_TIMEOUT_S
from kvxfer.integrations.vllm.specs import ATTENTION, MAMBA



def backend_problem(name: str) -> Optional[str]:
    """Why kvxfer backend ``name`` cannot move this connector's blocks, or None. The connector reads the
    prefill's pool from the decode's process, one-sided, with a read-done to the source, so it asks the
    backend class the registry returns (``kvxfer.backends``): ``is_push`` False and ``reads_other_processes``
    True. No list of names: a backend added to the registry with those answers qualifies."""
    from kvxfer.backends import construct_kv_transfer_backend_class
    from kvxfer.errors import BackendUnavailableError

    try:
        cls = construct_kv_transfer_backend_class(name)
    except BackendUnavailableError as exc:
        return str(exc)
    if getattr(cls, "is_push", False) is not False:
        return f"backend {name!r} pushes blocks from the prefill; KvxferConnector's decode reads them (one-sided)"
    if getattr(cls, "reads_other_processes", True) is not True:
        return f"backend {name!r} reads only its own process's memory; a prefill and a decode are two processes"
    return None


def connector_backends() -> list[str]:
    """The registered backends that qualify (``backend_problem`` None), for an error message."""
    from kvxfer.backends import available_backends

    return sorted(info.name for info in available_backends() if backend_problem(info.name) is None)


class ConnectorConfigError(ValueError):
    """``kv_connector_extra_config`` (or the KV transfer config around it) cannot be used."""


#: The fix for a KV cache group kind this connector does not move (``--disable-hybrid-kv-cache-manager``
#: makes vLLM allocate sliding-window and chunked-local layers as full attention: one group).
DISABLE_HMA_HINT = ("start vLLM with --disable-hybrid-kv-cache-manager (disable_hybrid_kv_cache_manager=True), "
                    "which allocates sliding-window and chunked-local layers as full attention, one group")

#: Why a model whose only KV cache group is Mamba/SSM state is refused (docs/vllm.md, "Hybrid and MLA models").
MAMBA_ONLY_REFUSAL = (
    "KvxferConnector moves Mamba/SSM state only beside attention (hybrid attention+Mamba models, as vLLM's "
    "SupportsHMA hands them over); a pure Mamba model has no attention group: use NixlConnector for it"
)


def group_kind(spec_names: Sequence[str]) -> str:
    """``attention`` (full attention, MLA) or ``mamba`` from a group's spec classes (``type(spec).__mro__``
    names), else ``ConnectorConfigError``: the kinds whose blocks mean the same thing on both sides."""
    names = list(spec_names)
    if "MambaSpec" in names:
        return MAMBA
    if names and names[0] in ("FullAttentionSpec", "MLAAttentionSpec"):
        return ATTENTION
    raise ConnectorConfigError(
        f"this model has a KV cache group of {names[0] if names else '?'} beside others; KvxferConnector moves "
        "full-attention, MLA and Mamba groups only (a sliding-window group keeps only the blocks in its window, "
        f"the others are freed as it computes): {DISABLE_HMA_HINT}"
    )


def check_kv_cache_groups(group_specs: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """Refuse, at start-up, KV cache groups the connector cannot move; return each group's kind.
    ``group_specs``: per transfer group, the class names of its ``kv_cache_spec`` and its bases
    (``type(spec).__mro__``), so this stays pure.

    One group (vLLM merges a model's layers into one unless its hybrid KV cache manager keeps
    several): any attention kind but Mamba, as before hybrid support (``attention``). Several groups
    (the hybrid manager, which vLLM keeps on because KvxferConnector implements ``SupportsHMA``):
    full attention, MLA or Mamba each, at least one attention group among them."""
    if not group_specs:
        raise ConnectorConfigError("this model has no KV cache group to transfer")
    if len(group_specs) == 1:
        names = list(group_specs[0])
        if "MambaSpec" in names:
            raise ConnectorConfigError(f"this model's KV cache is {names[0]} (Mamba/SSM state) only: "
                                       f"{MAMBA_ONLY_REFUSAL}")
        return (ATTENTION,)
    kinds = tuple(group_kind(names) for names in group_specs)
    if ATTENTION not in kinds:
        raise ConnectorConfigError(f"this model's {len(kinds)} KV cache groups are all Mamba/SSM state: "
                                   f"{MAMBA_ONLY_REFUSAL}")
    return kinds


@dataclass(frozen=True)
class KvxferConfig:
    """What ``kv_connector_extra_config`` may set (all optional)."""

    #: kvxfer backend moving the blocks (``backend_problem`` says which qualify: ``nixl``, ``ucx``); both sides
    #: must use the same.
    backend: str = "nixl"
    #: Address the producer's handshake listener binds, and the host decodes are told to
    #: connect to (``remote_host``). The port is ``KVTransferConfig.kv_port`` (+ the DP index);
    #: ``kv_port`` 0 binds a free port and advertises it.
    kv_ip: str = "127.0.0.1"
    #: Host name put in ``remote_host`` when it differs from the bind address (e.g. kv_ip 0.0.0.0).
    advertise_host: Optional[str] = None
    #: A pull that has not completed in this time is aborted and reported as a load failure
    #: (once no byte can still land).
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S
    #: Fetching a producer's metas over its side channel gives up after this.
    handshake_timeout_s: float = 10.0
    #: A producer frees an exported request's blocks without a read-done after this: safe,
    #: because every read re-checks the request's lease after the data (``leases``), so a
    #: late reader fails instead of admitting reused blocks.
    pin_grace_s: float = 120.0
    #: Exported requests a producer can hold pinned at once (one 8-byte lease slot each).
    lease_slots: int = 16384
    #: Per engine step, how long the decode worker polls reads in flight before returning, so a
    #: read that lands in microseconds (shared memory, RDMA) finishes in the step that posted it
    #: instead of the next one. 0 turns it off.
    completion_spin_us: int = 200

    @classmethod
    def from_extra_config(cls, extra: Optional[Mapping[str, Any]]) -> "KvxferConfig":
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConnectorConfigError(
                f"kv_connector_extra_config has keys KvxferConnector does not know: {unknown}; "
                f"known keys: {sorted(known)}"
            )
        cfg = cls(**extra)
        cfg.check()
        return cfg

    def check(self) -> None:
        problem = backend_problem(self.backend) if isinstance(self.backend, str) and self.backend.strip() \
            else "not a backend name"
        if problem is not None:
            raise ConnectorConfigError(
                f"kv_connector_extra_config 'backend' is {self.backend!r} ({problem}); KvxferConnector moves KV "
                f"with one of {connector_backends()}"
            )
        for name in ("transfer_timeout_s", "handshake_timeout_s", "pin_grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConnectorConfigError(f"kv_connector_extra_config {name!r} must be a positive number of seconds, "
                                           f"got {value!r}")
        if isinstance(self.lease_slots, bool) or not isinstance(self.lease_slots, int) or not 16 <= self.lease_slots <= 1 << 24:
            raise ConnectorConfigError(f"kv_connector_extra_config 'lease_slots' must be an int in [16, 2**24], "
                                       f"got {self.lease_slots!r}")
        if isinstance(self.completion_spin_us, bool) or not isinstance(self.completion_spin_us, int) \
                or not 0 <= self.completion_spin_us <= 100_000:
            raise ConnectorConfigError(f"kv_connector_extra_config 'completion_spin_us' must be an int in [0, 100000], "
                                       f"got {self.completion_spin_us!r}")
        for name in ("kv_ip", "advertise_host"):
            value = getattr(self, name)
            if value is None and name == "advertise_host":
                continue
            if not isinstance(value, str) or not value or len(value) > 255:
                raise ConnectorConfigError(f"kv_connector_extra_config {name!r} must be a host name or address, got {value!r}")

    @property
    def backend_name(self) -> str:
        return self.backend.strip().lower()

    @property
    def remote_host(self) -> str:
        """The host a decode connects to for this producer's handshake."""
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.kv_ip in ("0.0.0.0", "::", "") else self.kv_ip
