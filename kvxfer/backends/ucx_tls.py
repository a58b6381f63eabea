"""What ``UCX_TLS`` lets UCX use: the one parser both UCX-based backends (nixl, ucx) read it with.

kvxfer never changes ``UCX_TLS`` behind the user's back; it reads it to say what will
happen (``kvxfer info``), to refuse a setting that cannot move the registered memory,
and to choose paths (the ucx backend takes its same-host zero-copy path only where UCX
may use shared memory or CMA at all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# UCX_TLS aliases, expanded to the transport names they stand for (UCX docs, "UCX_TLS").
_ALIASES: dict[str, frozenset[str]] = {
    "all": frozenset({"*"}),
    "sm": frozenset({"posix", "sysv", "cma", "knem", "xpmem"}),
    "shm": frozenset({"posix", "sysv", "cma", "knem", "xpmem"}),
    "mm": frozenset({"posix", "sysv", "xpmem"}),
    "ib": frozenset({"rc_verbs", "rc_mlx5", "ud_verbs", "ud_mlx5", "dc_mlx5"}),
    "rc": frozenset({"rc_verbs", "rc_mlx5", "ud_verbs", "ud_mlx5"}),
    "rc_x": frozenset({"rc_mlx5", "ud_mlx5"}),
    "rc_v": frozenset({"rc_verbs", "ud_verbs"}),
    "ud": frozenset({"ud_verbs", "ud_mlx5"}),
    "ud_x": frozenset({"ud_mlx5"}),
    "ud_v": frozenset({"ud_verbs"}),
    "dc": frozenset({"dc_mlx5"}),
    "dc_x": frozenset({"dc_mlx5"}),
    "cuda": frozenset({"cuda_copy", "cuda_ipc", "gdr_copy"}),
}
#: Transports that can reach host memory in another process (``self`` cannot).
HOST_TRANSPORTS = frozenset({"tcp", "posix", "sysv", "cma", "knem", "xpmem", "rc_verbs", "rc_mlx5",
                             "ud_verbs", "ud_mlx5", "dc_mlx5", "srd", "efa"})
#: Without one of these UCX cannot even recognise a CUDA pointer, let alone move it.
CUDA_TRANSPORTS = frozenset({"cuda_copy", "cuda_ipc", "gdr_copy"})
#: Transports that move bytes between processes of one host without the network stack.
SHARED_MEMORY_TRANSPORTS = frozenset({"posix", "sysv", "cma", "knem", "xpmem"})


@dataclass(frozen=True)
class UcxTls:
    """``UCX_TLS`` expanded: ``allowed`` (``{"*"}`` for everything) minus ``excluded`` (a ``^``-list)."""

    raw: Optional[str]
    allowed: frozenset[str]
    excluded: frozenset[str]

    def permits(self, transport: str) -> bool:
        """Whether UCX_TLS lets UCX use ``transport``."""
        if transport in self.excluded:
            return False
        return "*" in self.allowed or transport in self.allowed


def parse_ucx_tls(value: Optional[str]) -> UcxTls:
    """``UCX_TLS`` -> what it permits. ``^a,b`` means everything except a and b; unset means everything."""
    allowed, excluded = _parse(value)
    return UcxTls(value, allowed, excluded)


def _expand(names: list[str]) -> frozenset[str]:
    out: set[str] = set()
    for name in names:
        out |= _ALIASES.get(name, frozenset({name}))
    return frozenset(out)


def _parse(value: Optional[str]) -> tuple[frozenset[str], frozenset[str]]:
    """UCX_TLS -> (allowed, excluded). ``^a,b`` means everything except a and b."""
    if value is None:
        return frozenset({"*"}), frozenset()
    if not value.strip():
        return frozenset(), frozenset()  # set but empty: UCX then fails to create any transport
    value = value.strip()
    negate = value.startswith("^")
    names = [n.strip().lower() for n in value.lstrip("^").split(",") if n.strip()]
    names = [n.removeprefix("\\") for n in names]  # "\rc" means "exactly rc", no alias expansion
    if negate:
        return frozenset({"*"}), _expand(names)
    return _expand(names), frozenset()
