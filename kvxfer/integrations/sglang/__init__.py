"""kvxfer as an SGLang PD transfer backend (``docs/sglang.md``).

SGLang finds it through its plugin entry point (group ``sglang.srt.plugins``, name ``kvxfer``,
object ``kvxfer.integrations.sglang:register``); after ``load_plugins()`` both roles accept
``--disaggregation-transfer-backend kvxfer_nixl`` (or ``kvxfer``, the same) and ``kvxfer_ucx``.

Modules: ``names`` (``BACKENDS``, the one table of kvxfer's SGLang backend names), ``plugin`` (the hooks),
``regions`` (``KVArgs`` raw pointers -> registrable tensors, the layout both sides compare), ``pool`` (one
kvxfer registration per manager), ``wire`` (messages on SGLang's ZMQ sockets), ``hellos`` (the prefill's
paced answers to registrations), ``source`` (prefill: rooms, leases, read-done), ``puller`` (decode: the
reads), ``tp`` (the layouts compared, the plans for other attention TP sizes and pipeline stages), ``conn``
(the ``Common*`` subclasses SGLang instantiates; the only module importing SGLang besides ``plugin``'s
lookups). A map with a reading order and common changes: ``README.md`` in this folder.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """SGLang's plugin entry point: add kvxfer's transfer backends (``plugin.register``)."""
    from kvxfer.integrations.sglang.plugin import register as _register

    _register()
