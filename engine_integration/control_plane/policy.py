"""Fleet policy, written once: who may exchange KV, what a fleet can hold, where a request goes.

Both control planes call these pure functions: the ZeroMQ coordinator with the engines it
has registered (``zmq.coordinator``), the etcd engines and clients with the instances of
one snapshot (``etcd.plane``, ``etcd.client``). Each plane turns what it knows into the
plain inputs below (``Member``, ``DecodeCandidate``), so the same fleet and the same
request give the same decision on either plane (``tests/engine/test_plane_policy.py`` checks
that on a table of fleets and requests, against the real coordinator and the etcd plane).

The rules:

- **Compatibility**: two engines exchange KV only if every rank's meta agrees on the
  geometry fields (``kvxfer.meta.agreement.AGREED_FIELDS``) and the model fingerprints match; the reason names
  the first field that differs. A prefill's generation-counter meta (nested under
  ``generations``) is not KV and is not compared.
- **Admission**: a request is refused at submit, with the reason, when it is malformed
  (empty prompt, token ids outside ``[0, 2**31)``, ``max_new_tokens`` outside
  ``[1, MAX_NEW_TOKENS]``, a prompt over ``MAX_PROMPT_TOKENS``) or when no live pool of a
  role could ever hold it (prompt on a prefill; prompt plus all new tokens on a decode).
- **Prefill choice**: fewest requests in flight there, then name.
- **Decode choice**: among the live decodes whose pool can hold the request, those with
  room for it now first (free blocks >= all the blocks it will hold there: ``reserved_blocks``),
  then, with prefix-aware routing on (the default), the longest expected cached prefix (``RoutedPrefixes``: hashes routed there before, minus those
  it reported evicted), then the most free blocks (the last figure reported, minus blocks
  routed there since), then the fewest handoffs whose pull has not completed, then name. So a
  request follows its prefix while that decode has room and falls back to the least loaded
  one when it has not. No live decode: wait; live decodes but none can hold it: refuse now.

Nothing here does I/O or imports zmq, etcd or torch.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

from kvxfer.meta.agreement import AGREED_FIELDS


#: Request limits every plane enforces at submit (the ZeroMQ wire's schema uses the same ones).
MAX_PROMPT_TOKENS = 1 << 20
MAX_NEW_TOKENS = 1 << 20
TOKEN_ID_LIMIT = 1 << 31     #: token ids are ints in [0, TOKEN_ID_LIMIT); an engine's vocabulary is smaller


@dataclass(frozen=True)
class Member:
    """One live engine as the policy sees it."""

    name: str
    role: str
    capacity_blocks: int
    transfer_meta: tuple[Mapping[str, Any], ...]
    fingerprint: Optional[str] = None      #: model fingerprint; None: not known (not compared)

    @property
    def tokens_per_block(self) -> Optional[int]:
        return tokens_per_block(self.transfer_meta)


def tokens_per_block(transfer_meta: Sequence[Mapping[str, Any]]) -> Optional[int]:
    """The block size from an engine's first meta (``None`` if it does not say)."""
    value = transfer_meta[0].get("tokens_per_block") if transfer_meta else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def blocks_for(tokens: int, tpb: int) -> int:
    return -(-tokens // tpb)


# --- compatibility --------------------------------------------------------------------------
def compatibility_problem(new: Member, ref: Member) -> Optional[str]:
    """Why ``new`` cannot exchange KV with ``ref`` (``None`` if it can)."""
    where = f"{ref.role} {ref.name!r}"
    if len(new.transfer_meta) != len(ref.transfer_meta):
        return f"{len(new.transfer_meta)} transfer metas (ranks) here, {len(ref.transfer_meta)} on {where}"
    for i, (a, b) in enumerate(zip(new.transfer_meta, ref.transfer_meta)):
        for name in AGREED_FIELDS:
            if a.get(name) != b.get(name):
                return (f"transfer meta [{i}] field {name!r} is {a.get(name)!r} here but {b.get(name)!r} on {where}; "
                        "prefill and decode must use the same transport and KV geometry")
    if new.fingerprint is not None and ref.fingerprint is not None and new.fingerprint != ref.fingerprint:
        return (f"model fingerprint {new.fingerprint} differs from {ref.fingerprint} on {where}: "
                "the engines run different models or model configs")
    return None


def fleet_refusal(new: Member, fleet: Iterable[Member]) -> Optional[str]:
    """The first reason a live engine of ``fleet`` (other than one of ``new``'s name, in name order) gives
    to refuse ``new``."""
    for ref in sorted(fleet, key=lambda m: m.name):
        if ref.name != new.name:
            why = compatibility_problem(new, ref)
            if why is not None:
                return why
    return None


# --- admission ------------------------------------------------------------------------------
def request_problem(prompt: Sequence[Any], max_new_tokens: Any) -> Optional[str]:
    """Why a request is malformed whatever the fleet (``None`` if it is well formed)."""
    if not prompt:
        return "the prompt is empty"
    if len(prompt) > MAX_PROMPT_TOKENS:
        return f"the prompt has {len(prompt)} tokens; at most {MAX_PROMPT_TOKENS} are accepted"
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        return f"max_new_tokens must be >= 1, got {max_new_tokens!r}"
    if max_new_tokens > MAX_NEW_TOKENS:
        return f"max_new_tokens must be <= {MAX_NEW_TOKENS}, got {max_new_tokens}"
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < TOKEN_ID_LIMIT]
    if bad:
        return f"token ids must be ints in [0, {TOKEN_ID_LIMIT}); got {bad[:5]}"
    return None


def admission_problem(prompt: Sequence[Any], max_new_tokens: Any, fleet: Iterable[Member]) -> Optional[str]:
    """Why the fleet must refuse this request at submit (``None``: it fits a pool, or no pool is known yet).

    A request no decode can hold would otherwise be routed anyway and sit at the head of a
    decode's FIFO until it timed out, blocking everything behind it.
    """
    why = request_problem(prompt, max_new_tokens)
    if why is not None:
        return why
    members = list(fleet)
    tokens = len(prompt) + max_new_tokens - 1  # the decode holds the prompt and all outputs but the last
    for role, need in (("prefill", len(prompt)), ("decode", tokens)):
        pools = [(m.capacity_blocks, m.tokens_per_block) for m in members if m.role == role]
        if not pools or any(tpb is None for _, tpb in pools):
            continue
        if all(blocks_for(need, tpb) > cap for cap, tpb in pools):  # type: ignore[arg-type]
            cap, tpb = max(pools)  # type: ignore[type-var]
            return (f"{len(prompt)} prompt tokens + {max_new_tokens} new tokens need {blocks_for(need, tpb)} KV "
                    f"blocks of {tpb} tokens on a {role} instance; the largest live {role} pool has {cap} blocks")
    return None


# --- routing --------------------------------------------------------------------------------
def pick_prefill(in_flight: Mapping[str, int]) -> Optional[str]:
    """The prefill (by name) with the fewest requests in flight, then the first name; None if none."""
    return min(in_flight, key=lambda name: (in_flight[name], name)) if in_flight else None


@dataclass(frozen=True)
class DecodeCandidate:
    """One live decode, as a plane knows it when routing one request."""

    name: str
    capacity_blocks: int
    tokens_per_block: Optional[int]
    free_blocks: Optional[int] = None      #: last reported free blocks minus blocks routed there since (None: unknown)
    cached_prefix_blocks: int = 0          #: this request's leading full blocks expected cached there
    in_flight: int = 0                     #: handoffs routed there whose pull has not completed

    def holds(self, tokens: int) -> bool:
        return self.tokens_per_block is None or blocks_for(tokens, self.tokens_per_block) <= self.capacity_blocks

    def reserves(self, tokens: int) -> int:
        return reserved_blocks(tokens, self.tokens_per_block)

    def has_room(self, tokens: int) -> bool:
        """Its last figure says it can reserve the request now (unknown figure: assume it can)."""
        return self.free_blocks is None or self.free_blocks >= self.reserves(tokens)


def reserved_blocks(tokens: int, tpb: Optional[int]) -> int:
    """Blocks a request holding ``tokens`` tokens may take from a decode's free pool: all it holds.

    Its cached prefix is not subtracted: a decode counts its cached blocks that no running
    request uses among its free ones (they are evicted on demand), and reusing them takes them
    off that count too. Only when a request running there shares the prefix is this an
    overestimate (by the prefix); it errs toward sending the request to the other decode (a
    pull) rather than queueing it behind a full one.
    """
    return blocks_for(tokens, tpb) if tpb is not None else 0


def pick_decode(candidates: Iterable[DecodeCandidate], tokens: int, *,
                prefix_aware: bool = True) -> Optional[DecodeCandidate]:
    """Where a request holding ``tokens`` tokens on its decode goes (``None``: no live decode can hold it).

    ``prefix_aware=False`` ignores the expected cached prefix (least loaded only): the baseline
    ``kvxfer.bench.fleet_prefix`` measures prefix-aware routing against.
    """
    fits = [c for c in candidates if c.holds(tokens)]
    if not fits:
        return None
    return min(fits, key=lambda c: (not c.has_room(tokens),
                                    -c.cached_prefix_blocks if prefix_aware else 0,
                                    -(c.free_blocks if c.free_blocks is not None else c.capacity_blocks),
                                    c.in_flight, c.name))


#: Evicted hashes a decode reports with its load figures (the newest; ``RoutedPrefixes.evicted``).
MAX_EVICTED_REPORT = 256


class RoutedPrefixes:
    """Block hashes expected cached on one decode incarnation, newest last, at most ``limit``.

    The router adds a request's hashes when it routes the request there, and drops the hashes
    the decode reports it evicted (``evicted``); a new incarnation starts empty (the planes key
    this by incarnation), so a restarted decode is expected to cache nothing. Bounded so a
    long-running router does not grow with every prompt it ever routed; a wrong guess costs
    only the pull of blocks the decode does not have, never a wrong byte (the decode looks its
    prefix up by hash itself).
    """

    def __init__(self, limit: int = 1 << 16) -> None:
        self.limit = limit
        self._hashes: OrderedDict[int, None] = OrderedDict()
        self._evictions_seen = 0

    def add(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.limit:
            self._hashes.popitem(last=False)

    def evicted(self, total: int, recent: Sequence[int]) -> None:
        """The decode's eviction report: ``total`` blocks evicted by this incarnation so far, the
        newest ``recent`` of them. Forget those hashes; when more were evicted since the last report
        than ``recent`` shows, forget everything (the next requests re-learn it)."""
        new = total - self._evictions_seen
        if new <= 0:
            return
        self._evictions_seen = total
        if new > len(recent):
            self._hashes.clear()
            return
        for h in recent[len(recent) - new:]:
            self._hashes.pop(h, None)

    def expected_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are expected cached here."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._hashes)


# --- death ----------------------------------------------------------------------------------
def process_gone(pid: int) -> bool:
    """True when ``pid`` (on this host) has exited; a zombie counts as exited: it runs nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False
