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
    """A transfer failed; the handle's ``storage_safe`` says if its blocks may be reused."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer did not complete within its timeout."""


class AuthenticationError(KVXferError):
    """A control-plane message failed authentication; it was dropped unparsed."""


class TornReadError(TransferError):
    """The source reused blocks before or while we read them: the bytes are not the request's."""
