"""One exception hierarchy for everything kvxfer raises on purpose.

Every message says what was seen and what to change, so an operator can fix the
configuration without reading kvxfer's source. Callers that want to survive any
kvxfer failure catch ``KVXferError``; nothing else is raised for bad input.
"""

from __future__ import annotations


class KVXferError(Exception):
    """Base class of every error kvxfer raises deliberately."""


class GeometryError(KVXferError, ValueError):
    """A registered buffer (or its topology arguments) cannot be described."""


class LayoutError(GeometryError):
    """Two parallel layouts cannot be resharded into each other."""


class PeerMetadataError(KVXferError, ValueError):
    """A peer's exported metadata is malformed or incompatible with ours."""


class BlockIdError(KVXferError, ValueError):
    """Block-id lists are unequal, out of range, or contain duplicates."""


class BackendUnavailableError(KVXferError, RuntimeError):
    """A backend was asked for whose dependency is missing or unknown."""


class BackendClosedError(KVXferError, RuntimeError):
    """A backend was used after ``close()``."""


class TransferError(KVXferError, RuntimeError):
    """A transfer failed and no byte of it can land any more: its destination may be reused.

    That is the promise of every ``TransferError`` a handle raises *except* a
    ``TransferTimeoutError`` (docs/api.md, "Failures and storage"). Callers such as
    Megatron free the destination on any exception that is not a ``TimeoutError``.
    """


class TransferTimeoutError(TransferError, TimeoutError):
    """The transfer is not known to be over: part of it may still land.

    Raised by a handle that timed out, or failed, while some read could not be
    proven cancelled (``storage_safe`` is False): keep the destination blocks
    quarantined until ``handle.storage_safe`` turns True. Being a ``TimeoutError``
    is the point: callers read it as "a transfer may still be active".
    """


class TransferCancelledError(TransferError):
    """The transfer did not complete within its timeout and was cancelled: no byte can land.

    What a timed-out handle raises once its cancellation is proven (``storage_safe``
    True): not a ``TimeoutError``, so a caller that frees on anything else frees.
    """


class AuthenticationError(KVXferError):
    """A control-plane message failed authentication; it was dropped unparsed."""


class TornReadError(TransferError):
    """The source reused blocks before or while we read them: the bytes are not the request's."""
