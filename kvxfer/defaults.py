"""Defaults that several parts of kvxfer (and ``engine_integration``) share, each written once, and the one
rule every number a user hands kvxfer obeys (``bounded_float`` / ``bounded_int``).

Imports nothing of kvxfer but its errors, so the command line can show them in its help without importing
torch (which every backend module does), and any part may import it.
"""

from __future__ import annotations

import math
from typing import Union

from kvxfer.errors import KVXferError

#: Seconds a transfer handle may take before ``wait()`` raises ``TransferTimeoutError``, when the
#: caller names no timeout: the backends' own default (``KVXFER_TRANSFER_TIMEOUT_S`` overrides it
#: there), the engines' ``transfer_timeout_s`` and ``kvxfer soak --timeout``.
TRANSFER_TIMEOUT_S = 30.0

#: The range of every timeout and grace period a user sets (seconds): a day at most, since no wait of
#: kvxfer's is meant to last longer and a larger figure is a typo or an attack (``inf``, ``1e308``) that
#: turns a stalled peer into a hang; a millisecond at least, so that no figure rounds to "already late".
MIN_TIMEOUT_S = 0.001
MAX_TIMEOUT_S = 86400.0

#: The etcd control plane's URL numbers (``etcd://...?ttl=5&poll=0.25&handoff_timeout=120``): a lease
#: TTL below 2 s expires between two keep-alives, above an hour a dead engine holds its records that
#: long; a poll interval longer than a minute leaves the fleet's picture a minute stale.
ETCD_TTL_S = (2, 3600)
ETCD_POLL_S = (MIN_TIMEOUT_S, 60.0)

Number = Union[int, float, str]


class SettingError(KVXferError, ValueError):
    """A setting's value is not a finite number in its range. The message names the setting, the value and
    the range (``NAME='inf' is not a finite number (give seconds from 0.001 to 86400)``), ready for the
    caller to raise as its own error type (a usage error, ``BackendUnavailableError``...)."""


def bounded_float(name: str, value: Number, low: float, high: float, *, unit: str = "a number") -> float:
    """``value`` (a number, or the text a command line, a URL, a config file or the environment gave) as a
    float in ``[low, high]``; anything else raises ``SettingError`` naming ``name`` and the range.

    The one statement of the rule "every number kvxfer reads is finite and bounded": ``float()`` takes
    ``inf``, ``nan`` and ``1e999`` (infinity), and a timeout of ``1e308`` is as good as none. Every
    reader of a setting calls this or ``bounded_int`` -- the command line, the environment, the
    control-plane URL, and the engine integrations' configs (vLLM's ``kv_connector_extra_config``,
    SGLang's environment) -- so the same mistake gets the same answer everywhere. ``name`` is how the
    user spells the setting (``--timeout``, ``KVXFER_TRANSFER_TIMEOUT_S``); empty when the caller's own
    message names it (argparse prefixes ``argument --timeout:``).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _refused(name, value, "is not a number", low, high, unit)
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (ValueError, OverflowError):
        raise _refused(name, value, "is not a number", low, high, unit) from None
    if not math.isfinite(number):
        raise _refused(name, value, "is not a finite number", low, high, unit)
    if not low <= number <= high:
        raise _refused(name, value, "is out of range", low, high, unit)
    return number


def bounded_int(name: str, value: Number, low: int, high: int, *, unit: str = "a whole number") -> int:
    """``value`` as an integer in ``[low, high]`` (sizes, counts, ports, seeds); text must be an integer
    (``"1e3"`` is refused rather than guessed), a float only a whole one (JSON's ``4096.0``). Anything
    else raises ``SettingError`` as ``bounded_float`` does: ``int()`` takes numbers of any size, and a
    count of ``10**30`` is a hang or an allocation that cannot succeed."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _refused(name, value, "is not a whole number", low, high, unit)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _refused(name, value, "is not a finite number", low, high, unit)
        if not value.is_integer():
            raise _refused(name, value, "is not a whole number", low, high, unit)
        number = int(value)
    else:
        try:
            number = int(value.strip()) if isinstance(value, str) else int(value)
        except ValueError:  # not an integer, or more digits than int() reads (4300)
            raise _refused(name, value, "is not a whole number", low, high, unit) from None
    if not low <= number <= high:
        raise _refused(name, value, "is out of range", low, high, unit)
    return number


def _refused(name: str, value: object, why: str, low: float, high: float, unit: str) -> SettingError:
    shown = repr(value) if isinstance(value, str) else str(value)
    if len(shown) > 40:  # a 4,000-digit number is not worth echoing whole
        shown = shown[:37] + "..."
    subject = f"{name}={shown}" if name else shown
    return SettingError(f"{subject} {why} (give {unit} from {figure(low)} to {figure(high)})")


def figure(number: float) -> str:
    """``86400`` rather than ``86400.0``, ``0.001`` as written."""
    return str(int(number)) if float(number).is_integer() else repr(number)
