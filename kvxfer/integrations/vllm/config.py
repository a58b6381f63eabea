"""The connector's settings, read once from ``KVTransferConfig`` and checked.

Everything kvxfer-specific comes from ``kv_connector_extra_config``; a key kvxfer does not
know is an error naming the known ones (a typo must not silently fall back to a default).
Pure: no vLLM import, so the checks are testable anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Sequence

#: Backends the connector can drive: one-sided reads with a read-done to the source.
SUPPORTED_BACKENDS = ("nixl", "ucx")


class ConnectorConfigError(ValueError):
    """``kv_connector_extra_config`` (or the KV transfer config around it) cannot be used."""


#: Why Mamba/SSM state is refused (docs/vllm.md, "Hybrid and MLA models"), read from vLLM 0.32.
MAMBA_REFUSAL = (
    "KvxferConnector moves attention KV caches (full attention, MLA), not Mamba/SSM state, and does not implement "
    "vLLM's SupportsHMA: without it vLLM turns the hybrid KV cache manager off (config/vllm.py), and a hybrid "
    "attention+Mamba model then fails at engine start in vLLM itself (kv_cache_utils.unify_hybrid_kv_cache_specs: "
    "'Failed to promote local KV cache specs to one unified type.'); use NixlConnector for hybrid and Mamba models"
)


def check_kv_cache_groups(group_specs: Sequence[Sequence[str]]) -> None:
    """Refuse, at start-up, KV cache groups the connector cannot move. ``group_specs``: per group, the
    class names of its ``kv_cache_spec`` and its bases (``type(spec).__mro__``), so this stays pure.

    One group only (vLLM keeps several only with its hybrid KV cache manager, which it turns off for a
    connector without ``SupportsHMA``), and not Mamba state: a pure Mamba model has one group too
    (``MambaSpec``), whose per-layer conv and SSM state tensors are not KV blocks."""
    if len(group_specs) != 1:
        raise ConnectorConfigError(
            f"KvxferConnector moves models with one KV cache group (full attention or MLA); this model has "
            f"{len(group_specs)} (sliding window, hybrid or Mamba layers)")
    names = list(group_specs[0])
    if "MambaSpec" in names:
        raise ConnectorConfigError(f"this model's KV cache is {names[0]} (Mamba/SSM state): {MAMBA_REFUSAL}")


@dataclass(frozen=True)
class KvxferConfig:
    """What ``kv_connector_extra_config`` may set (all optional)."""

    #: kvxfer backend moving the blocks: ``nixl`` or ``ucx``; both sides must use the same.
    backend: str = "nixl"
    #: Address the producer's handshake listener binds, and the host decodes are told to
    #: connect to (``remote_host``). The port is ``KVTransferConfig.kv_port`` (+ the DP index);
    #: ``kv_port`` 0 binds a free port and advertises it.
    kv_ip: str = "127.0.0.1"
    #: Host name put in ``remote_host`` when it differs from the bind address (e.g. kv_ip 0.0.0.0).
    advertise_host: Optional[str] = None
    #: A pull that has not completed in this time is aborted and reported as a load failure
    #: (once no byte can still land).
    transfer_timeout_s: float = 30.0
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
        if not isinstance(self.backend, str) or self.backend.strip().lower() not in SUPPORTED_BACKENDS:
            raise ConnectorConfigError(
                f"kv_connector_extra_config 'backend' is {self.backend!r}; KvxferConnector moves KV with "
                f"one of {list(SUPPORTED_BACKENDS)}"
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
