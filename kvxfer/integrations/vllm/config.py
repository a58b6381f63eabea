"""The connector's settings, read once from ``KVTransferConfig`` and checked.

Everything kvxfer-specific comes from ``kv_connector_extra_config``; a key kvxfer does not
know is an error naming the known ones (a typo must not silently fall back to a default).
Pure: no vLLM import, so the checks are testable anywhere.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence

from kvxfer.errors import KVXferError
from kvxfer.defaults import TRANSFER_TIMEOUT_S, SettingError, bounded_float, bounded_int
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


class ConnectorConfigError(KVXferError, ValueError):
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


#: The longest a connector timeout may be set to: past an hour a stalled peer is no longer told from a slow
#: one, and a wait that long holds the request (and a load's blocks) for nothing.
MAX_TIMEOUT_S = 3600.0
#: The longest a producer may keep an exported request's blocks without a read-done (a day).
MAX_PIN_GRACE_S = 86400.0


def _bounded(default: Any, low: float, high: float) -> Any:
    """A numeric setting and its closed range ``[low, high]``, kept on the field (``numeric_settings``), so the
    check and its test cover every number the connector reads, a new one included."""
    return field(default=default, metadata={"range": (low, high)})


def numeric_settings() -> list[Field]:
    """The settings whose value is a number (annotated ``int`` or ``float``), each of which must carry a range."""
    return [f for f in fields(KvxferConfig) if f.type in ("int", "float", int, float)]


def bounded_setting(value: Any, setting: Field) -> Any:
    """``value`` as ``setting`` (an ``int`` setting given JSON's ``4096.0`` becomes ``4096``), else
    ``ConnectorConfigError`` naming the setting and its range. The library's rule for every number a user hands
    kvxfer (``kvxfer.defaults.bounded_float`` / ``bounded_int``: finite, in range) on a JSON value: vLLM's JSON
    parser reads ``Infinity``, ``NaN`` and ``1e999`` as floats, and a non-finite timeout never fires (a load
    against a stopped producer stayed pending, no error). Text is refused, not parsed: in a JSON config a
    quoted number is a mistake (``"30s"`` is the next one)."""
    name = f"kv_connector_extra_config {setting.name!r}"
    if "range" not in setting.metadata:
        raise ConnectorConfigError(f"{name} is a number without a range (a setting added without _bounded)")
    low, high = setting.metadata["range"]
    integral = setting.type in ("int", int)
    unit = "seconds" if setting.name.endswith("_s") else "microseconds" if setting.name.endswith("_us") else ""
    unit = f"{'a whole number' if integral else 'a number'}{' of ' + unit if unit else ''}"
    if isinstance(value, str):
        figure = str if integral else "{:g}".format
        raise ConnectorConfigError(f"{name}={value[:40]!r} is text, not a JSON number (give {unit} from "
                                   f"{figure(low)} to {figure(high)})")
    try:
        return (bounded_int if integral else bounded_float)(name, value, low, high, unit=unit)
    except SettingError as exc:
        raise ConnectorConfigError(str(exc)) from None


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
    transfer_timeout_s: float = _bounded(TRANSFER_TIMEOUT_S, 0.01, MAX_TIMEOUT_S)
    #: Fetching a producer's metas over its side channel gives up after this.
    handshake_timeout_s: float = _bounded(10.0, 0.01, MAX_TIMEOUT_S)
    #: A producer frees an exported request's blocks without a read-done after this: safe,
    #: because every read re-checks the request's lease after the data (``leases``), so a
    #: late reader fails instead of admitting reused blocks.
    pin_grace_s: float = _bounded(120.0, 0.01, MAX_PIN_GRACE_S)
    #: Exported requests a producer can hold pinned at once (one 8-byte lease slot each).
    lease_slots: int = _bounded(16384, 16, 1 << 24)
    #: Per engine step, how long the decode worker polls reads in flight before returning, so a
    #: read that lands in microseconds (shared memory, RDMA) finishes in the step that posted it
    #: instead of the next one. 0 turns it off.
    completion_spin_us: int = _bounded(200, 0, 100_000)

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
        for setting in numeric_settings():  # frozen: the checked number replaces what was given (4096.0 -> 4096)
            object.__setattr__(self, setting.name, bounded_setting(getattr(self, setting.name), setting))
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
