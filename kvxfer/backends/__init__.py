"""Backend registry: pick a transport by name, explicitly, from configuration.

The built-in backends are a table of names to ``"module:Class"`` paths
(``BUILTIN_BACKENDS``), imported on the first lookup that needs them, as in
Megatron's ``transfer_backends/base.py``: importing this package imports no
backend, and a backend module never imports the registry (its class is named
here, not registered from there). Third parties register through the
``kvxfer.backends`` entry-point group (``name = "pkg.module:Class"``) or call
``register_backend``. A backend whose dependency is missing stays listed, with
the reason, and raises ``BackendUnavailableError`` (with the fix) when
constructed. A plugin can break only itself: whatever its import, its ``availability()`` or its
``transport_probe()`` raises (or answers in the wrong shape), it is listed as unavailable with that
as the reason, and ``available_backends()``, ``default_backend_name()``, ``transport_probes()`` and
``kvxfer info`` go on. Nothing here reads the environment to choose a backend.

Owns the transports (one package each) and the contract they implement (``base.py``), with what
each can do as class attributes (``is_push``, ``reads_other_processes``, ...) that callers read from
the class returned here rather than keeping lists of names. A backend package never imports
another backend package.
Its imports: its row of ``LAYERS`` in tests/project/test_library_layout.py (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import import_module, metadata
from typing import Any, Mapping, TypeVar

from kvxfer.backends.base import KVTransportBackend, TransferHandle, TransferState, checked_availability
from kvxfer.errors import BackendUnavailableError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvxfer.backends"
#: Preference order for the default backend: the best transport that can run here.
PREFERENCE = ("nixl", "ucx", "local")
#: The built-in backends, resolved on first use. Listing (``available_backends``, ``transport_probes``)
#: resolves them in sorted order, as the eager imports used to: nixl's module is imported (and its
#: ``availability`` probed) before ucx's binding loads. Neither touches the environment on import: the
#: nixl backend sets ``UCX_MODULES`` only when it creates its agent (``nixl.ucx_env``).
BUILTIN_BACKENDS: Mapping[str, str] = {
    "local": "kvxfer.backends.local.backend:LocalBackend",
    "nccl": "kvxfer.backends.nccl.backend:NcclBackend",
    "nixl": "kvxfer.backends.nixl.backend:NixlBackend",
    "ucx": "kvxfer.backends.ucx.backend:UcxBackend",
}

_REGISTRY: dict[str, type[KVTransportBackend]] = {}  # resolved built-ins and registered classes
_BROKEN_PLUGINS: dict[str, str] = {}  # entry points that failed to load -> why
_BROKEN_BUILTINS: dict[str, str] = {}  # built-ins whose module failed to import -> why
_plugins_loaded = False

B = TypeVar("B", bound=type[KVTransportBackend])


def normalize_name(name: str) -> str:
    """Backend names are case-insensitive and treat ``_`` and ``-`` alike."""
    return name.strip().lower().replace("_", "-")


def _path_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def register_backend(cls: B) -> B:
    """Class decorator: register ``cls`` under ``cls.name`` (for third parties; built-ins are in the table)."""
    key = normalize_name(cls.name)
    existing = _REGISTRY.get(key)
    if existing is not None and existing is not cls:
        raise ValueError(f"backend name {cls.name!r} is already registered by {existing.__module__}.{existing.__qualname__}")
    builtin = BUILTIN_BACKENDS.get(key)
    if existing is None and builtin is not None and builtin != _path_of(cls):
        raise ValueError(f"backend name {cls.name!r} is already registered by {builtin.replace(':', '.')}")
    _REGISTRY[key] = cls
    return cls


def _import_class(path: str) -> type:
    module, _, qualname = path.partition(":")
    value: Any = import_module(module)
    for attr in qualname.split("."):
        value = getattr(value, attr)
    return value


def _resolve_builtin(key: str) -> type[KVTransportBackend] | None:
    """The built-in class named ``key``, imported now if it was not yet; None if its module cannot load."""
    cls = _REGISTRY.get(key)
    if cls is not None or key in _BROKEN_BUILTINS:
        return cls
    try:
        cls = _import_class(BUILTIN_BACKENDS[key])
    except Exception as exc:  # e.g. torch missing: the backend stays listed, with the reason
        why = f"{type(exc).__name__}: {exc}"
        _BROKEN_BUILTINS[key] = f"backend module {BUILTIN_BACKENDS[key]!r} failed to import: {why}"
        logger.debug("built-in backend %s unavailable: %s", key, _BROKEN_BUILTINS[key])
        return None
    _REGISTRY[key] = cls
    return cls


def _resolve_all() -> None:
    """Every backend resolved: built-ins imported in sorted order, then the plugins."""
    for key in sorted(BUILTIN_BACKENDS):
        _resolve_builtin(key)
    _load_plugins()


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    try:
        entries = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception as exc:  # an installed distribution's metadata that cannot be read
        logger.warning("kvxfer backend plugins: reading the %r entry points failed (%s: %s); none loaded",
                       ENTRY_POINT_GROUP, type(exc).__name__, exc)
        return
    for entry in entries:
        try:
            cls = entry.load()
            if not (isinstance(cls, type) and issubclass(cls, KVTransportBackend)):
                raise TypeError(f"{entry.value} is not a KVTransportBackend subclass")
            if not isinstance(getattr(cls, "name", None), str) or not cls.name.strip():
                raise TypeError(f"{entry.value} has no backend name (a non-empty str class attribute 'name')")
            key = normalize_name(cls.name)
            if key not in _REGISTRY and key not in BUILTIN_BACKENDS:  # a built-in name is never shadowed
                register_backend(cls)
        # A broken plugin must not break kvxfer; it is reported instead. SystemExit too: a plugin
        # that exits at import (a missing driver, say) must not end the process that listed it.
        except (Exception, SystemExit) as exc:
            key = _entry_key(entry)
            _BROKEN_PLUGINS[key] = f"plugin {getattr(entry, 'value', '?')!r} failed to load: {type(exc).__name__}: {exc}"
            logger.debug("backend plugin %s unavailable: %s", key, _BROKEN_PLUGINS[key])


def _entry_key(entry: Any) -> str:
    name = getattr(entry, "name", None)
    return normalize_name(name) if isinstance(name, str) and name.strip() else f"<entry point {entry!r:.80}>"


def construct_kv_transfer_backend_class(name: str) -> type[KVTransportBackend]:
    """Return the backend class registered under ``name`` (importing its module on first use)."""
    key = normalize_name(name)
    if key in BUILTIN_BACKENDS:
        cls = _resolve_builtin(key)
        if cls is None:
            raise BackendUnavailableError(_BROKEN_BUILTINS[key])
        return cls
    if key in _REGISTRY:
        return _REGISTRY[key]
    _load_plugins()
    if key in _REGISTRY:
        return _REGISTRY[key]
    if key in _BROKEN_PLUGINS:
        raise BackendUnavailableError(_BROKEN_PLUGINS[key])
    known = sorted(set(_REGISTRY) | set(BUILTIN_BACKENDS))
    raise BackendUnavailableError(f"unknown backend {name!r}; known backends: {', '.join(known)}")


@dataclass(frozen=True)
class BackendInfo:
    name: str
    available: bool
    reason: str  # empty when available; otherwise what is missing and how to fix it
    is_push: bool


def available_backends() -> list[BackendInfo]:
    """Every known backend, whether it can run here, and why not. Never raises because of a plugin:
    one whose ``availability()`` raises (or answers in another shape) is listed unavailable, with why."""
    _resolve_all()
    infos = []
    for key, cls in sorted(_REGISTRY.items()):
        ok, why = checked_availability(cls)
        if not ok and key not in BUILTIN_BACKENDS and why.startswith("its availability()"):
            why = f"plugin {_path_of(cls)!r}: {why}"
        infos.append(BackendInfo(key, ok, why, getattr(cls, "is_push", False) is True))  # (a plugin's odd value: False)
    broken = {**_BROKEN_BUILTINS, **_BROKEN_PLUGINS}
    infos.extend(BackendInfo(key, False, why, False) for key, why in sorted(broken.items()))
    return infos


def transport_probes() -> dict[str, dict[str, Any]]:
    """Each backend's ``transport_probe()`` (errors turned into text), for ``kvxfer info`` and the bench."""
    _resolve_all()
    out: dict[str, dict[str, Any]] = {}
    for key, cls in sorted(_REGISTRY.items()):
        try:
            details = cls.transport_probe()
        except Exception as exc:  # a probe failing is information, not a crash
            details = {"error": f"{type(exc).__name__}: {exc}"}
        if details and not isinstance(details, Mapping):
            details = {"error": f"transport_probe() returned {details!r:.200}, not a dict"}
        if details:
            out[key] = {str(name): value for name, value in details.items()}
    return out


def default_backend_name() -> str:
    """The most capable backend that can run on this machine."""
    runnable = {info.name for info in available_backends() if info.available}
    return next(name for name in PREFERENCE if name in runnable)


__all__ = [
    "BUILTIN_BACKENDS", "BackendInfo", "KVTransportBackend", "TransferHandle", "TransferState", "available_backends",
    "construct_kv_transfer_backend_class", "default_backend_name", "normalize_name", "register_backend",
    "transport_probes",
]
