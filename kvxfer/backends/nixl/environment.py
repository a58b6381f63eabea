"""What this machine and environment let NIXL do: the settings kvxfer reads and the probe ``kvxfer info`` shows.

Nothing here creates an agent; ``agent.py`` does, with these settings.
"""

from __future__ import annotations

import os
from typing import Any

from kvxfer.backends.nixl.ucx_env import NixlTransportInfo, nixl_transport_info
from kvxfer.defaults import SettingError, bounded_int
from kvxfer.errors import BackendUnavailableError

INSTALL_HINT = (
    "pip install 'kvxfer[nixl]' (on a CPU-only machine run `pip install torch==2.13.0` first: "
    "otherwise pip resolves nixl's torch dependency to a multi-GB CUDA build)"
)


def nixl_transport_probe() -> dict[str, Any]:
    """For ``kvxfer info``: what UCX under NIXL will use here (no agent is created)."""
    info = nixl_transport_info()
    return {
        "package": info.nixl_package or "not installed",
        "UCX_TLS": info.ucx_tls if info.ucx_tls is not None else "unset (all UCX can load)",
        "UCX_NET_DEVICES": info.ucx_net_devices or "unset",
        "UCX_MODULES": os.environ.get("UCX_MODULES", "unset (kvxfer sets ^ib when no RDMA device exists)"),
        "transports": ",".join(info.transports),
        "rdma_devices": ",".join(info.rdma_devices) or "none",
        "ucx_error_handling": "none (same-host mode, KVXFER_NIXL_SAME_HOST=1)" if same_host_or_none() else "peer",
        "DRAM": info.usable_for("DRAM")[1] or "ok",
        "VRAM": _vram_status(info),
        "tcp_reads": _tcp_reads_status(info),
        "progress_delay_us": _progress_delay_status(),
    }


def _progress_delay_status() -> str:
    """The progress thread's pause in force, or why the environment's is refused (every agent will be)."""
    try:
        return str(progress_delay_us())
    except BackendUnavailableError as exc:
        return f"REFUSED: {exc}"


def other_hosts_refused(meta_key: Any, allow_unauthenticated: bool) -> bool:
    """Whether a nixl backend here reads only from sources of its own host: same-host mode, or no
    cluster key (metas sealed on another host are then refused, unless opted in)."""
    return same_host_or_none() or (meta_key is None and not allow_unauthenticated)


def _tcp_reads_status(info: NixlTransportInfo) -> str:
    """``RISK: <the setup warning>`` where a nixl backend of host memory here would read over TCP, else
    ``no: <why>``; from the environment the backend would be built in (cluster key included)."""
    from kvxfer.meta.seal import meta_key_from_env, unauthenticated_metas_allowed_by_env  # noqa: PLC0415

    if not info.nixl_package:
        return "nixl not installed"
    try:
        key = meta_key_from_env()
    except Exception:  # a broken secret file is kvxfer info's metas line to report: judge as keyed
        key = b"?"
    risk, text = info.tcp_reads("DRAM", same_host_only=other_hosts_refused(key, unauthenticated_metas_allowed_by_env()))
    return f"RISK: {text}" if risk else text


def _vram_status(info: NixlTransportInfo) -> str:
    """"ok" only when NIXL is installed, a CUDA device exists and UCX can move its memory."""
    if not info.nixl_package:
        return "nixl not installed"
    try:
        import torch  # noqa: PLC0415

        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA runtime is information, not a crash
        devices = 0
    if devices == 0:
        return "no CUDA device here"
    return info.usable_for("VRAM")[1] or "ok"


def nixl_api() -> Any:
    """Import nixl only when a backend is built: ``import kvxfer`` must work without it."""
    import nixl._api as api  # noqa: PLC0415

    return api


#: Pause of NIXL's progress thread between rounds, in microseconds. NIXL's Python wrapper
#: hard-codes 0, a busy loop that burns a whole core in every idle process holding an agent.
#: Measured idle over 10 s: 1 ms -> 2.6% of a core, 2 ms -> 1.35%, 5 ms -> 0.6%. 2 ms keeps
#: an idle process under 2% and bounds the extra latency of the progress a peer's one-sided
#: reads need from us (TCP; shared-memory and RDMA reads need none). 0 restores NIXL's default.
#: At most a second: every round of progress a peer's TCP read needs from us waits this long.
PROGRESS_DELAY_ENV = "KVXFER_NIXL_PROGRESS_DELAY_US"
DEFAULT_PROGRESS_DELAY_US = 2000
MAX_PROGRESS_DELAY_US = 1_000_000


#: ``1``: a same-host deployment (docs/environment.md). The agent's UCX runs without peer
#: failure handling, so reads between processes of this host go over CMA/shared memory
#: (measured, 0.5 MB pulls between two processes: p50 0.67 -> 0.35 ms, p90 2.5 -> 0.39 ms),
#: and metas from other hosts are refused: without that mode a dead remote peer could hang a
#: read or abort the process inside UCX. A dead same-host source still fails its reads at once.
SAME_HOST_ENV = "KVXFER_NIXL_SAME_HOST"


def same_host_or_none() -> bool:
    try:
        return same_host_mode()
    except BackendUnavailableError:
        return False


def same_host_mode() -> bool:
    raw = os.environ.get(SAME_HOST_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise BackendUnavailableError(f"{SAME_HOST_ENV}={raw!r}: use 1 (same-host deployment) or 0")


def progress_delay_us() -> int:
    """``KVXFER_NIXL_PROGRESS_DELAY_US``, else the default; a value that is not a whole number of microseconds
    in 0..``MAX_PROGRESS_DELAY_US`` raises ``BackendUnavailableError`` naming the variable and the range (a
    negative one used to be taken as 0, and a huge one reached NIXL's native config)."""
    raw = os.environ.get(PROGRESS_DELAY_ENV, "")
    if not raw.strip():
        return DEFAULT_PROGRESS_DELAY_US
    try:
        return bounded_int(PROGRESS_DELAY_ENV, raw, 0, MAX_PROGRESS_DELAY_US, unit="microseconds")
    except SettingError as exc:
        raise BackendUnavailableError(str(exc)) from None
