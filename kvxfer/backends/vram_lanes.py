"""Which UCX lanes a VRAM pool will move through, for ``kvxfer info``.

A pool in GPU memory is only worth registering if the read between two processes stays on
the GPU side: ``cuda_ipc`` maps the source's allocation into the reader's CUDA context and
copies device to device (NVLink or PCIe peer-to-peer) on one host; across hosts an RDMA NIC
with GPUDirect reads VRAM directly. Everything else is a *host bounce*: ``cuda_copy`` copies
the bytes to host memory and a host transport (shared memory, TCP) carries them, at a
fraction of the bandwidth and with the CPU in the path. kvxfer treats that as a defect of
the deployment and says so loudly, instead of letting a benchmark discover it.

The verdict is a pure function of facts read once: which CUDA modules the UCX build loads
(``libuct_cuda`` provides ``cuda_copy`` and ``cuda_ipc``; ``libuct_cuda_gdrcopy`` provides
``gdr_copy``), what ``UCX_TLS`` permits, whether a CUDA device and an RDMA NIC exist. UCX's
own choice for a given pair of endpoints is visible at run time with ``UCX_PROTO_INFO=y``
(the GPU kit records it) and, for the ucx backend, ``transports_in_use()``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from kvxfer.backends.ucx_tls import SHARED_MEMORY_TRANSPORTS, UcxTls, parse_ucx_tls

#: UCX module (``libuct_<name>.so``) -> the transports it provides for CUDA memory
_CUDA_MODULES = {"cuda": ("cuda_copy", "cuda_ipc"), "cuda_gdrcopy": ("gdr_copy",)}
_RDMA_TRANSPORTS = frozenset({"rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs", "ud_mlx5"})


@dataclass(frozen=True)
class VramLanes:
    """The verdict for one UCX build: the lanes a VRAM read takes. ``defect``: a read between two processes
    of one host would leave the GPU (a host bounce, or no lane at all); a bounce across hosts (no RDMA
    NIC) is shown in capitals in ``other_host`` but is the network's limit, not a misconfiguration."""

    same_host: str
    other_host: str
    defect: bool

    def line(self, backend: str) -> str:
        flag = "DEFECT: " if self.defect else ""
        return f"{backend}: VRAM pools {flag}same host -> {self.same_host}; other hosts -> {self.other_host}"


def judge_vram_lanes(modules: tuple[str, ...], tls: UcxTls, cuda_device: bool, rdma_devices: tuple[str, ...]) -> VramLanes:
    """What a VRAM read will use, from the UCX modules present, ``UCX_TLS``, and the hardware."""
    present = {t for m in modules for t in _CUDA_MODULES.get(m, ())}
    usable = {t for t in present if tls.permits(t)}
    if not cuda_device:
        return VramLanes("no CUDA device here", "no CUDA device here", defect=False)
    if not usable:
        why = ("this UCX build has no CUDA module (libuct_cuda)" if not present
               else f"UCX_TLS={tls.raw!r} allows none of {', '.join(sorted(present))}")
        return VramLanes(f"none: registering VRAM fails ({why})", "none", defect=True)

    def bounce(lanes: list[str]) -> str:
        if "cuda_copy" not in usable:
            return "none (no cuda_copy to bounce through)"
        return f"HOST BOUNCE (cuda_copy to host memory, then {'/'.join(lanes) or 'no host transport'})"

    if "cuda_ipc" in usable:
        same_host, same_defect = "cuda_ipc (device to device)", False
    else:
        same_host, same_defect = bounce(sorted(t for t in SHARED_MEMORY_TRANSPORTS | {"tcp"} if tls.permits(t))), True
    network = ["tcp"] if tls.permits("tcp") else []
    rdma_ok = bool(rdma_devices) and any(tls.permits(t) for t in _RDMA_TRANSPORTS)
    if rdma_ok:
        other_host = (f"RDMA ({', '.join(rdma_devices)}) with GPUDirect where the driver has it (nvidia-peermem), "
                      f"else {bounce(network)}")
    else:
        other_host = f"{bounce(network)}: no RDMA NIC"
    return VramLanes(same_host, other_host, defect=same_defect)


def _ucx_modules_of(package: str, subdir: str) -> tuple[str, ...]:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin:
        return ()
    folder = Path(spec.origin).parent / subdir
    return tuple(sorted({p.name.split(".so")[0].removeprefix("libuct_") for p in folder.glob("libuct_*.so*")}))


def vram_lane_lines(environ: Optional[Mapping[str, str]] = None, cuda_device: Optional[bool] = None) -> list[str]:
    """One line per UCX build kvxfer loads (nixl's bundled UCX, the ucx backend's libucx)."""
    import os

    env = os.environ if environ is None else environ
    if cuda_device is None:
        import torch

        cuda_device = torch.cuda.is_available()
    tls = parse_ucx_tls(env.get("UCX_TLS"))
    rdma_root = Path("/sys/class/infiniband")
    rdma = tuple(sorted(p.name for p in rdma_root.iterdir())) if rdma_root.is_dir() else ()
    try:
        from kvxfer.backends.nixl.ucx_env import nixl_transport_info

        builds = {"nixl": nixl_transport_info(env).ucx_modules}
    except ImportError:
        builds = {}
    builds["ucx"] = _ucx_modules_of("libucx", "lib/ucx")
    builds = {name: modules for name, modules in builds.items() if modules}
    if not cuda_device:
        built = ", ".join(f"{name} ({'/'.join(sorted(t for m in mods for t in _CUDA_MODULES.get(m, ()))) or 'none'})"
                          for name, mods in builds.items())
        return [f"VRAM pools: no CUDA device here; CUDA lanes in the UCX builds: {built or 'no UCX build found'}"]
    return [judge_vram_lanes(modules, tls, cuda_device, rdma).line(name) for name, modules in builds.items()]
