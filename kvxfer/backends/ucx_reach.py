"""Why a live peer can be unreachable through UCX: said once, for both UCX-based backends (nixl, ucx).

A UCX worker's address lists every TCP interface that had an IPv4 address when the worker started.
A peer made after one of them was removed can pick that address (its default route makes any address
look routable) and be refused, and since it picks the same address each time, every retry fails too.
UCX then reports the endpoint unreachable. docs/nixl.md tells how this was found;
``tests/backends/test_gone_interface.py`` makes it happen for real.
"""

from __future__ import annotations

#: ``UCS_ERR_UNREACHABLE``: the ``ucs_status_t`` UCX returns when no lane reaches the peer.
UCS_ERR_UNREACHABLE = -6

#: What to tell the user when a peer that may be alive cannot be reached.
UNREACHABLE_HINT = ("UCX could not reach the address it chose among those the peer's worker published (an "
                    "interface removed since the peer started?): set UCX_NET_DEVICES on both sides to "
                    "interfaces that stay")
