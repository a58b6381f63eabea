"""SGLang's plugin hook: make ``kvxfer_nixl``, ``kvxfer_ucx`` and ``kvxfer`` transfer backends without
patching SGLang.

SGLang (0.5.23) runs every ``sglang.srt.plugins`` entry point in ``load_plugins()`` (server,
``Engine``, scheduler subprocesses), then applies the hooks registered with ``HookRegistry``.
Three things name a transfer backend there, and each gets kvxfer's names:

* ``--disaggregation-transfer-backend``'s choice list (``arg_groups.choices``, extended through
  its ``add_disagg_transfer_backend_choices``);
* the ``TransferBackend`` enum (``TransferBackend("kvxfer_ucx")`` must resolve: the scheduler
  and ``disagg_service`` build it from the flag); a member is added in place, so every module
  holding the enum sees it;
* ``get_kv_class``, wrapped with an ``AROUND`` hook: kvxfer's backends get kvxfer's classes,
  every other backend the original's answer. ``HookRegistry`` rebinds every module that
  imported the function by name (``utils``, ``prefill``, ``decode``, ``managers.disagg_service``).

If SGLang moved any of these, ``register`` raises at load, naming the version it was tested with.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kvxfer.integrations.sglang.names import BACKENDS, SGLangBackend

logger = logging.getLogger(__name__)

TESTED_SGLANG = "0.5.23"
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"


class SGLangHooksChanged(RuntimeError):
    """SGLang no longer has the hooks this plugin uses."""


def _sglang_version() -> str:
    try:
        import sglang

        return str(getattr(sglang, "__version__", "unknown"))
    except Exception:  # pragma: no cover - sglang not importable at all
        return "not importable"


def _need(module: str, name: str) -> Any:
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise SGLangHooksChanged(
            f"kvxfer's SGLang plugin was tested with sglang {TESTED_SGLANG}; sglang {_sglang_version()} has no "
            f"{module}.{name} ({exc}). Install sglang=={TESTED_SGLANG} or a kvxfer release made for this one"
        ) from exc


def _add_enum_member(enum_cls: Any, name: str, value: str) -> None:
    """Add ``name = value`` to an existing ``Enum`` (Python offers no API for it)."""
    if value in enum_cls._value2member_map_:
        return
    member = object.__new__(enum_cls)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    member.__init__(value)
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)


def kv_classes(backend: SGLangBackend) -> dict[Any, type]:
    """kvxfer's classes for one of its SGLang backends (``BACKENDS``), keyed by SGLang's ``KVClassType``."""
    from sglang.srt.disaggregation.utils import KVClassType

    from kvxfer.integrations.sglang import conn

    return {KVClassType.MANAGER: getattr(conn, backend.manager), KVClassType.SENDER: conn.KvxferKVSender,
            KVClassType.RECEIVER: conn.KvxferKVReceiver, KVClassType.BOOTSTRAP_SERVER: conn.KvxferKVBootstrapServer}


def _around_get_kv_class(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    backend = BACKENDS.get(getattr(transfer_backend, "value", None))
    if backend is None:
        return original(transfer_backend, class_type)
    classes = kv_classes(backend)
    if class_type in classes:
        return classes[class_type]
    return original(transfer_backend, class_type)  # KVARGS: SGLang's one container


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (see the module docstring)."""
    add_choices = _need("sglang.srt.arg_groups.choices", "add_disagg_transfer_backend_choices")
    choices = _need("sglang.srt.arg_groups.choices", "DISAGG_TRANSFER_BACKEND_CHOICES")
    transfer_backend = _need("sglang.srt.disaggregation.utils", "TransferBackend")
    _need("sglang.srt.disaggregation.utils", "get_kv_class")
    _need("sglang.srt.disaggregation.utils", "KVClassType")
    registry = _need("sglang.srt.plugins.hook_registry", "HookRegistry")
    hook_type = _need("sglang.srt.plugins.hook_registry", "HookType")
    for name in ("CommonKVManager", "CommonKVSender", "CommonKVReceiver", "CommonKVBootstrapServer"):
        _need("sglang.srt.disaggregation.common.conn", name)
    add_choices([name for name in BACKENDS if name not in choices])
    for name in BACKENDS:
        _add_enum_member(transfer_backend, name.upper(), name)
    if not any(hook is _around_get_kv_class for _, hook, _src in registry._hooks.get(GET_KV_CLASS, [])):
        registry.register(GET_KV_CLASS, _around_get_kv_class, hook_type.AROUND)
    logger.info("kvxfer: SGLang transfer backends %s registered", ", ".join(BACKENDS))
