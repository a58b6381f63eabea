"""kvxfer's SGLang backend names: the one table of them (``BACKENDS``), apart from the plugin's hooks
(``plugin``) and the classes it names (``conn``), which both read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SGLangBackend:
    """What one of kvxfer's SGLang backend names means: kvxfer's transport (a ``kvxfer.backends`` registry
    name) and the manager class in ``conn`` that SGLang's ``get_kv_class`` answers with (senders, receivers and
    the bootstrap server are the same classes for every transport)."""

    kvxfer_backend: str
    manager: str


#: SGLang backend name (``--disaggregation-transfer-backend``) -> kvxfer's transport and manager class: the one
#: table of kvxfer's SGLang backends (the flag's choices, the enum members, ``get_kv_class``'s answers and each
#: manager's transport all come from it). ``kvxfer`` is ``kvxfer_nixl``.
BACKENDS = {"kvxfer_nixl": SGLangBackend("nixl", "KvxferNixlKVManager"),
            "kvxfer_ucx": SGLangBackend("ucx", "KvxferUcxKVManager"),
            "kvxfer": SGLangBackend("nixl", "KvxferNixlKVManager")}
