"""Which UCX transports the NIXL backend will use here, and whether they fit the memory.

NIXL moves bytes with UCX, and UCX picks its transports from ``UCX_TLS`` (unset:
every transport it can load). A user's shell often carries a ``UCX_TLS`` tuned
for something else (``tcp`` only, or no ``cuda_copy``); with it, a VRAM pool
either fails deep inside the first transfer or silently crawls through host
staging. kvxfer does not change the environment behind the user's back: it reads
it, shows it (``kvxfer info``), and refuses at construction a configuration that
cannot move the registered memory type at all.

Nothing here imports nixl: the facts come from the environment and from the UCX
modules shipped next to the installed nixl wheel.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from kvxfer.backends.ucx_tls import CUDA_TRANSPORTS, HOST_TRANSPORTS, UcxTls, parse_ucx_tls

# Built into libuct itself; everything else is a loadable module (libuct_<name>.so).
_BUILTIN_TRANSPORTS = ("self", "tcp", "posix", "sysv")
#: Transports whose GET is a hardware RDMA READ (no CPU of the source), and the module shipping them.
RDMA_GET_TRANSPORTS = frozenset({"rc_verbs", "rc_mlx5", "dc_mlx5"})
_RDMA_MODULE = "ib"
#: Transports that read another process's memory on this host with no CPU of it, per memory type, and
#: their modules. Measured here (``UCX_PROTO_INFO=y``, nixl 1.5.1's UCX 1.22, NIXL's default peer failure
#: mode): a nixl READ between two processes of one host is "zero-copy cma/memory" with ``UCX_TLS`` unset,
#: "software emulation tcp/lo" with ``UCX_TLS=tcp``.
SAME_HOST_GET_TRANSPORTS = {"DRAM": {"cma": "cma", "knem": "knem", "xpmem": "xpmem"},
                            "VRAM": {"cuda_ipc": "cuda"}}


@dataclass(frozen=True)
class NixlTransportInfo:
    """What UCX underneath NIXL is configured to use on this machine.

    ``ucx_tls`` is the raw ``UCX_TLS`` (None: unset, UCX picks from everything it
    can load). ``allowed`` is that setting expanded (``{"*"}`` for everything),
    ``excluded`` the ``^``-list when UCX_TLS is a negation. ``ucx_modules`` are
    the optional UCX modules shipped with the nixl wheel (``cma``, ``ib``,
    ``cuda``...), ``rdma_devices`` the RDMA NICs the kernel shows.
    """

    nixl_package: Optional[str]
    ucx_tls: Optional[str]
    allowed: frozenset[str]
    excluded: frozenset[str]
    ucx_net_devices: Optional[str]
    ucx_modules: tuple[str, ...]
    rdma_devices: tuple[str, ...]

    def permits(self, transport: str) -> bool:
        """Whether UCX_TLS lets UCX use ``transport``."""
        return UcxTls(self.ucx_tls, self.allowed, self.excluded).permits(transport)

    def usable_for(self, mem_type: str) -> tuple[bool, str]:
        """``(True, "")`` if some permitted transport can move ``mem_type`` ("DRAM"/"VRAM"), else why not."""
        if not self.allowed:
            return False, "UCX_TLS is set but empty, which leaves UCX no transport at all; unset it"
        if mem_type == "VRAM":
            if not any(self.permits(t) for t in CUDA_TRANSPORTS):
                return False, (
                    f"UCX_TLS={self.ucx_tls!r} allows no CUDA transport ({', '.join(sorted(CUDA_TRANSPORTS))}); "
                    "UCX cannot move GPU memory with it. Add cuda_copy,cuda_ipc (and rc or tcp for the "
                    "network) to UCX_TLS, or unset it"
                )
            return True, ""
        if not any(self.permits(t) for t in HOST_TRANSPORTS):
            return False, (
                f"UCX_TLS={self.ucx_tls!r} allows no transport that reaches another process "
                f"({', '.join(sorted(HOST_TRANSPORTS))}); add e.g. tcp,sm (or rc for RDMA) or unset it"
            )
        return True, ""

    @property
    def transports(self) -> tuple[str, ...]:
        """Transports this UCX can load: the built-in ones plus the shipped modules."""
        return _BUILTIN_TRANSPORTS + self.ucx_modules

    def tcp_reads(self, mem_type: str = "DRAM", *, same_host_only: bool = False) -> tuple[bool, str]:
        """Whether UCX under NIXL would serve reads of ``mem_type`` over TCP here, and which: ``(True,
        the warning)`` or ``(False, why not)``.

        Over TCP UCX emulates the GET: the *source's* UCX answers it (``ucp_get_req_handler``), and
        when its reader is gone by then (SIGKILLed while the source was stalled) that answer fails
        and UCX aborts the source (``ucs_fatal``; measured, docs/nixl.md). Reads avoid TCP with an
        RDMA transport and device (hardware GET), or between processes of one host where UCX may
        read the memory directly (cma for host memory, cuda_ipc for GPU memory). ``same_host_only``:
        metas of other hosts are refused here (``KVXFER_NIXL_SAME_HOST=1``, or no cluster key and no
        ``KVXFER_ALLOW_UNAUTHENTICATED_METAS``), so only the same-host path matters.
        """
        if not self.permits("tcp"):
            return False, "no: UCX_TLS allows no tcp"
        rdma = [t for t in sorted(RDMA_GET_TRANSPORTS) if self.permits(t)]
        if rdma and self.rdma_devices and _RDMA_MODULE in self.ucx_modules:
            return False, f"no: RDMA (hardware GET: {', '.join(rdma)}) on {', '.join(self.rdma_devices)}"
        direct = [t for t, module in sorted(SAME_HOST_GET_TRANSPORTS.get(mem_type, {}).items())
                  if self.permits(t) and module in self.transports]
        if direct and same_host_only:
            return False, (f"no: reads on this host by {', '.join(direct)}; metas of other hosts are refused "
                           "(no cluster key, or KVXFER_NIXL_SAME_HOST=1)")
        no_rdma = ("no RDMA device here" if not self.rdma_devices else
                   f"UCX_TLS={self.ucx_tls!r} allows no RDMA transport" if not rdma else
                   "the nixl wheel ships no UCX ib module")
        if direct:
            which, why = "reads from other hosts", f"{no_rdma}; reads on this host use {', '.join(direct)}"
            also = "; or, if every reader runs on its source's host, set KVXFER_NIXL_SAME_HOST=1"
        else:
            shipped = [t for t, module in sorted(SAME_HOST_GET_TRANSPORTS.get(mem_type, {}).items())
                       if module in self.transports] or sorted(SAME_HOST_GET_TRANSPORTS.get(mem_type, {}))
            which, why = "every read", f"{no_rdma}; UCX_TLS={self.ucx_tls!r} allows no {' or '.join(shipped)}"
            also = ""
        return True, (f"UCX under NIXL serves {which} over TCP ({why}): a reader SIGKILLed while its source is "
                      "stalled makes the source abort inside NIXL's UCX (ucp_get_req_handler -> ucs_fatal; "
                      "docs/nixl.md). The ucx backend fails such reads instead: use backend 'ucx' for reads "
                      "over TCP" + also)

    def summary(self) -> str:
        """One line for ``kvxfer info``."""
        tls = "unset (UCX chooses among all it can load)" if self.ucx_tls is None else repr(self.ucx_tls)
        modules = ", ".join(self.transports)
        rdma = ", ".join(self.rdma_devices) or "none"
        return f"UCX_TLS={tls}; UCX transports available: {modules}; RDMA devices: {rdma}"


def _nixl_libs_dir() -> tuple[Optional[str], Optional[Path]]:
    """The installed nixl flavour (nixl_cu13, nixl_cu12...) and its bundled-libraries folder."""
    for flavour in ("nixl_cu13", "nixl_cu12", "nixl_rocm"):
        spec = importlib.util.find_spec(flavour)
        if spec is not None and spec.origin:
            libs = Path(spec.origin).parent.parent / f"{flavour}.libs"
            return flavour, libs if libs.is_dir() else None
    return None, None


def nixl_transport_info(environ: Optional[Mapping[str, str]] = None) -> NixlTransportInfo:
    """What UCX under NIXL will use here (reads the environment; imports nothing heavy)."""
    env = os.environ if environ is None else environ
    flavour, libs = _nixl_libs_dir()
    modules: tuple[str, ...] = ()
    if libs is not None and (libs / "ucx").is_dir():
        modules = tuple(sorted({
            p.name.split(".so")[0].removeprefix("libuct_")
            for p in (libs / "ucx").glob("libuct_*.so*")
        }))
    rdma_root = Path("/sys/class/infiniband")
    rdma = tuple(sorted(p.name for p in rdma_root.iterdir())) if rdma_root.is_dir() else ()
    tls = env.get("UCX_TLS")
    parsed = parse_ucx_tls(tls)
    allowed, excluded = parsed.allowed, parsed.excluded
    return NixlTransportInfo(
        nixl_package=flavour, ucx_tls=tls, allowed=allowed, excluded=excluded,
        ucx_net_devices=env.get("UCX_NET_DEVICES"), ucx_modules=modules, rdma_devices=rdma,
    )


def keep_idle_ib_module_out(environ: Optional[dict[str, str]] = None) -> bool:
    """Set ``UCX_MODULES=^ib`` when this machine has no RDMA device; True if it did.

    The one change kvxfer makes to the environment, and only where it cannot cost a
    byte of bandwidth: the nixl wheel bundles its own libnl, and when UCX's ib
    module also pulls in the system's rdma-core (so its libnl), both copies
    unregister the same tables at exit and the process dies with SIGSEGV (exit
    139) after its work is done. Seen here with Debian's libibverbs1 installed.
    With no RDMA device the ib module has nothing to drive, so it is not loaded.
    A user's own ``UCX_MODULES`` is left alone; ``kvxfer info`` shows the value.
    """
    env = os.environ if environ is None else environ
    rdma_root = Path("/sys/class/infiniband")
    if "UCX_MODULES" in env or (rdma_root.is_dir() and any(rdma_root.iterdir())):
        return False
    env["UCX_MODULES"] = "^ib"
    return True
