"""Backend registry: pick a transport by name, explicitly, from configuration.

Built-in backends register themselves on import; third parties register through
the ``kvxfer.backends`` entry-point group (``name = "pkg.module:Class"``). A
backend whose dependency is missing stays listed, with the reason, and raises
``BackendUnavailableError`` (with the fix) when constructed. Nothing here reads
the environment to choose a backend.

Owns the transports (one package each) and the contract they implement (``base.py``). May import:
``kvxfer.meta``, ``kvxfer.plan``, ``kvxfer.security``, ``kvxfer.errors``; a backend package never
imports another backend package.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar

from kvxfer.backends.base import KVTransportBackend, TransferHandle, TransferState
from kvxfer.errors import BackendUnavailableError

ENTRY_POINT_GROUP = "kvxfer.backends"
#: Preference order for the default backend: the best transport that can run here.
PREFERENCE = ("nixl", "ucx", "local")

_REGISTRY: dict[str, type[KVTransportBackend]] = {}
_BROKEN_PLUGINS: dict[str, str] = {}  # entry points that failed to load -> why
_plugins_loaded = False

B = TypeVar("B", bound=type[KVTransportBackend])


def normalize_name(name: str) -> str:
    """Backend names are case-insensitive and treat ``_`` and ``-`` alike."""
    return name.strip().lower().replace("_", "-")


def register_backend(cls: B) -> B:
    """Class decorator: register ``cls`` under ``cls.name``."""
    key = normalize_name(cls.name)
    existing = _REGISTRY.get(key)
    if existing is not None and existing is not cls:
        raise ValueError(f"backend name {cls.name!r} is already registered by {existing.__module__}.{existing.__qualname__}")
    _REGISTRY[key] = cls
    return cls


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = entry.load()
            if not (isinstance(cls, type) and issubclass(cls, KVTransportBackend)):
                raise TypeError(f"{entry.value} is not a KVTransportBackend subclass")
            if normalize_name(cls.name) not in _REGISTRY:
                register_backend(cls)
        except Exception as exc:  # a broken plugin must not break kvxfer; it is reported instead
            _BROKEN_PLUGINS[normalize_name(entry.name)] = f"plugin {entry.value!r} failed to load: {exc}"


def construct_kv_transfer_backend_class(name: str) -> type[KVTransportBackend]:
    """Return the backend class registered under ``name``."""
    _load_plugins()
    key = normalize_name(name)
    if key in _REGISTRY:
        return _REGISTRY[key]
    if key in _BROKEN_PLUGINS:
        raise BackendUnavailableError(_BROKEN_PLUGINS[key])
    raise BackendUnavailableError(f"unknown backend {name!r}; known backends: {', '.join(sorted(_REGISTRY))}")


@dataclass(frozen=True)
class BackendInfo:
    name: str
    available: bool
    reason: str  # empty when available; otherwise what is missing and how to fix it
    is_push: bool


def available_backends() -> list[BackendInfo]:
    """Every known backend, whether it can run here, and why not."""
    _load_plugins()
    infos = []
    for key, cls in sorted(_REGISTRY.items()):
        ok, why = cls.availability()
        infos.append(BackendInfo(key, ok, why, cls.is_push))
    infos.extend(BackendInfo(key, False, why, False) for key, why in sorted(_BROKEN_PLUGINS.items()))
    return infos


def transport_probes() -> dict[str, dict[str, Any]]:
    """Each backend's ``transport_probe()`` (errors turned into text), for ``kvxfer info`` and the bench."""
    _load_plugins()
    out: dict[str, dict[str, Any]] = {}
    for key, cls in sorted(_REGISTRY.items()):
        try:
            details = cls.transport_probe()
        except Exception as exc:  # a probe failing is information, not a crash
            details = {"error": f"{type(exc).__name__}: {exc}"}
        if details:
            out[key] = details
    return out


def default_backend_name() -> str:
    """The most capable backend that can run on this machine."""
    runnable = {info.name for info in available_backends() if info.available}
    return next(name for name in PREFERENCE if name in runnable)


# Built-in backends register themselves on import; their heavy dependencies load lazily.
from kvxfer.backends import local  # noqa: E402,F401
from kvxfer.backends import nccl  # noqa: E402,F401
from kvxfer.backends import nixl  # noqa: E402,F401
from kvxfer.backends import ucx  # noqa: E402,F401

__all__ = [
    "BackendInfo", "KVTransportBackend", "TransferHandle", "TransferState", "available_backends",
    "construct_kv_transfer_backend_class", "default_backend_name", "normalize_name", "register_backend",
    "transport_probes",
]
