"""A decode worker's producers' handshakes: fetched once per address, checked, prepared, bounded.

Whatever a ticket names is fetched only after the ticket verified where it can (a cluster
key: ``receiver``), but without a key the ticket key comes *in* the handshake, so an
unsigned ticket naming any address of this host still causes a fetch. What keeps such junk
from delaying genuine loads, and from growing the process:

- one entry, and at most one fetch, per address ``(host, port)``: 200 made-up engine ids
  naming one address cost one fetch; an entry whose handshake names another engine than
  the ticket refuses that ticket, nothing more;
- fetches run concurrently on one thread (``side_channel.HandshakeFetcher``), each with its
  own deadline, so a closed port (refused at once) or a silent address delays only itself;
  at most ``MAX_FETCHES`` run at once, more is refused at once (a bounded queue);
- at most ``max_entries`` addresses are kept, least recently used evicted first;
- a failure is remembered for ``FAILED_KEPT_S``: the loads naming a dead or stalled
  producer in that time are refused at once, without asking again.

``prepare(handshake)`` runs after the handshake checked, off the engine's thread, before any load
uses it: the worker confirms the handshake's metas with the backend there (ucx without a cluster
key asks each source process whether it exported its meta: up to its limit for a stopped one, up to
``LIVE_SOURCE_WAIT_S`` (120 s) for one that lives but does not answer, ``ucx/confirm.py``), so no
such wait ever happens on the engine's step thread. A confirmation can wait that long on whatever a
ticket names, so it must not hold what another producer's confirmation needs (issue 49: keyless, four
tickets naming a producer that stopped its confirmation child held a pool of 4 threads, and a genuine
producer's first load waited 25 s behind them):

- each confirmation runs on a thread of its own (``_Confirmations``), up to ``MAX_CONFIRMING`` at
  once: another producer's stall costs a genuine one nothing until that many stall together;
- one confirmation per producer at a time: the producer is the address the ticket names (one entry
  per address); the source pids its metas name are the sender's to choose without a key, so they key
  no bound (a bound per claimed pid would let a stranger queue a genuine producer behind its stalls);
- a producer whose confirmation failed (stalled, gone, or refused) backs off: its loads are refused at
  once, with no fetch and no thread, for ``FAILED_KEPT_S``, doubled with each failure in a row up to
  ``BACKOFF_MAX_S``; a confirmation that succeeds ends the backoff.

The decode rank's verdict on the handshake (``set_decider``: the compatibility check and the reads it
then makes) is worked out on the same thread, before the confirmation, and kept with the entry
(``verdict``): whatever a peer's handshake claims, the step thread only looks the answer up (issue 39).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kvxfer.errors import KVXferError, TransferError
from kvxfer.integrations.vllm.handshake import Handshake, check_compatible, parse_handshake
from kvxfer.integrations.vllm.side_channel import MAX_FETCHES, HandshakeFetcher
from kvxfer.integrations.vllm.tp_reads import notify_ranks, rank_reads

logger = logging.getLogger(__name__)

#: A failed fetch (or confirmation) is not retried for this long.
FAILED_KEPT_S = 3.0
#: Producer addresses whose handshakes a decode worker keeps.
MAX_ENTRIES = 64
#: Confirmations running at once, each on a thread of its own (a thread waiting on a socket costs a stack and a
#: wake-up every 0.25 s); more wait, without a thread, for one to end.
MAX_CONFIRMING = MAX_ENTRIES
#: The longest a producer whose confirmations keep failing is refused without being asked again.
BACKOFF_MAX_S = 60.0
#: Producer addresses whose failures in a row are remembered (least recently failed forgotten first).
_BACKOFF_KEPT = 1024


#: The youngest handshake a ticket naming another producer instance may have refetched (seconds).
REFETCH_AFTER_S = 2.0


@dataclass
class _Entry:
    started: float
    handshake: Optional[Handshake] = None
    error: Optional[BaseException] = None
    verdict: Any = None  # the decider's answer (or the KVXferError it raised), if there is a decider
    preparing: bool = False  # the document arrived and passed its checks; ``prepare`` (confirmation) runs
    kept_s: float = FAILED_KEPT_S  # how long a failure is remembered: longer for a producer that failed again
    finished: Optional[float] = None  # set last, once the entry is final


class _Confirmations:
    """Runs each submitted call on a thread of its own, at most ``limit`` at once; the rest wait in order, without a
    thread, and run on a thread that finished its call. Threads are daemons: one still waiting on a stalled source
    (up to ``LIVE_SOURCE_WAIT_S``) never holds up the process's exit."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._waiting: deque[Callable[[], None]] = deque()
        self._lock = threading.Lock()
        self.running = 0
        self.closed = False

    def submit(self, call: Callable[[], None]) -> None:
        with self._lock:
            if self.closed:
                raise RuntimeError("the handshake cache is closed")
            if self.running >= self._limit:
                self._waiting.append(call)
                return
            self.running += 1
        threading.Thread(target=self._run, args=(call,), name="kvxfer-vllm-confirm", daemon=True).start()

    def _run(self, call: Optional[Callable[[], None]]) -> None:
        while call is not None:
            try:
                call()
            except Exception:  # noqa: BLE001 - the call reports its own failures; this keeps the thread count right
                logger.exception("kvxfer vllm: a handshake confirmation raised")
            with self._lock:
                call = self._waiting.popleft() if self._waiting and not self.closed else None
                if call is None:
                    self.running -= 1

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._waiting.clear()


class HandshakeCache:
    def __init__(self, timeout_s: float, cluster_key: Optional[bytes], allow_unauthenticated: bool,
                 prepare: Optional[Callable[[Handshake], None]] = None, *, max_entries: int = MAX_ENTRIES,
                 max_fetches: int = MAX_FETCHES, max_confirming: int = MAX_CONFIRMING,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout_s = timeout_s
        self._key = cluster_key
        self._allow = allow_unauthenticated
        self._prepare = prepare
        self._max_entries = max_entries
        self._clock = clock
        self._fetcher = HandshakeFetcher(max_fetches)
        self._preparing = _Confirmations(max_confirming)
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
        self._failures: OrderedDict[tuple[str, int], int] = OrderedDict()  # per address: confirmations failed in a row
        self._failures_lock = threading.Lock()  # confirmations end on their own threads
        self._decide: Optional[Callable[[Handshake], Any]] = None
        self.fetches = 0
        self.confirmations = 0  # confirmations started (``prepare`` calls)

    def set_decider(self, decide: Callable[[Handshake], Any]) -> None:
        """``decide(handshake)`` runs once per handshake fetched from now on, off the engine's thread,
        before it is final; its result (or the ``KVXferError`` it raised) is ``verdict``'s answer."""
        self._decide = decide

    def verdict(self, host: str, port: int, handshake: Handshake) -> Any:
        """The decider's answer for ``handshake`` as fetched from ``host:port``, None if none was worked out."""
        entry = self._entries.get((host, port))
        if entry is None or entry.handshake is not handshake or entry.finished is None:
            return None
        return entry.verdict

    def preparing(self, host: str, port: int) -> bool:
        """Whether the handshake of ``host:port`` was fetched and is being confirmed (``prepare`` runs): the
        producer answered; what is left is bounded by ``prepare`` itself (ucx: a source that provably lives
        is waited for up to ``LIVE_SOURCE_WAIT_S`` past the limit, one that died fails at once)."""
        entry = self._entries.get((host, port))
        return entry is not None and entry.preparing and entry.finished is None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def confirming(self) -> int:
        """Confirmations running now, each on its own thread (``_Confirmations``)."""
        return self._preparing.running

    def get(self, engine_id: str, host: str, port: int) -> Optional[Handshake]:
        """The handshake of the producer at ``host:port``, None while it is being fetched;
        raises what the fetch, its checks or ``prepare`` raised, or when it names another engine."""
        target = (host, port)
        entry = self._entries.get(target)
        if entry is not None and entry.finished is not None and entry.error is not None \
                and self._clock() - entry.finished > entry.kept_s:
            entry = None  # a failure is remembered for a while (a producer that failed again: longer), then asked again
        if entry is None:
            entry = self._start(target)
        self._entries.move_to_end(target)
        if entry.finished is None:
            return None
        if entry.error is not None:
            raise entry.error
        assert entry.handshake is not None
        if entry.handshake.engine_id != engine_id:
            raise KVXferError(f"{host}:{port} serves prefill engine {entry.handshake.engine_id!r}, the ticket names "
                              f"{engine_id!r}: the proxy paired the ticket with the wrong address")
        return entry.handshake

    def _start(self, target: tuple[str, int]) -> _Entry:
        self._evict()
        entry = _Entry(self._clock())
        self.fetches += 1
        self._fetcher.fetch(target[0], target[1], self._timeout_s,
                            lambda document, error: self._fetched(entry, target, document, error))
        self._entries[target] = entry
        return entry

    def _evict(self) -> None:
        """Least recently used finished entries go first; pending ones are bounded by the fetcher."""
        while len(self._entries) >= self._max_entries:
            victim = next((t for t, e in self._entries.items() if e.finished is not None), None)
            if victim is None:
                return
            del self._entries[victim]

    def _fetched(self, entry: _Entry, target: tuple[str, int], document: Optional[dict],
                 error: Optional[BaseException]) -> None:
        """On the fetcher's thread: check the document (fast), then prepare it on the pool."""
        if error is None:
            try:
                handshake = parse_handshake(document, self._key, allow_unauthenticated=self._allow)
            except Exception as exc:
                error = exc
        if error is not None:
            return self._final(entry, None, error)
        if self._prepare is None and self._decide is None:
            return self._final(entry, handshake, None)
        entry.preparing = True
        try:
            self._preparing.submit(lambda: self._prepared(entry, target, handshake))
        except RuntimeError as exc:  # closed
            self._final(entry, None, exc)

    def _prepared(self, entry: _Entry, target: tuple[str, int], handshake: Handshake) -> None:
        if self._decide is not None:
            try:
                entry.verdict = self._decide(handshake)
            except KVXferError as exc:  # refused: every load through it is refused with this reason
                entry.verdict = exc
            except Exception as exc:  # noqa: BLE001 - outside the contract: the fetch fails with it
                logger.exception("kvxfer vllm: deciding on the handshake of %s:%d failed", *target)
                return self._final(entry, None, exc)
        if self._prepare is None:
            return self._final(entry, handshake, None)
        with self._failures_lock:
            self.confirmations += 1
        try:
            self._prepare(handshake)
        except Exception as exc:
            entry.kept_s = self._failed_again(target)
            logger.warning("kvxfer vllm: prefill engine %s at %s:%d: its metas could not be confirmed (its loads are "
                           "refused for %gs without asking it again): %s", handshake.engine_id, target[0], target[1],
                           entry.kept_s, exc)
            return self._final(entry, None, exc)
        with self._failures_lock:
            self._failures.pop(target, None)
        self._final(entry, handshake, None)

    def _failed_again(self, target: tuple[str, int]) -> float:
        """Count a failed confirmation of ``target``; how long its loads are now refused without asking it."""
        with self._failures_lock:
            failures = self._failures.pop(target, 0) + 1
            self._failures[target] = failures
            while len(self._failures) > _BACKOFF_KEPT:
                self._failures.popitem(last=False)
        return min(FAILED_KEPT_S * 2 ** min(failures - 1, 16), BACKOFF_MAX_S)

    def _final(self, entry: _Entry, handshake: Optional[Handshake], error: Optional[BaseException]) -> None:
        entry.handshake, entry.error = handshake, error
        entry.finished = self._clock()

    def invalidate(self, host: str, port: int) -> bool:
        """Forget the handshake of ``host:port`` so the next ``get`` fetches it again (a ticket names
        another instance: the producer restarted); True if it was forgotten. Not within
        ``REFETCH_AFTER_S`` of its fetch: a producer does not restart that fast, and without a cluster
        key a ticket is checked only after the handshake, so forged tickets naming made-up instances
        would otherwise make every real load to that producer wait for a fetch."""
        entry = self._entries.get((host, port))
        if entry is None or entry.finished is None or self._clock() - entry.finished < REFETCH_AFTER_S:
            return False
        del self._entries[(host, port)]
        return True

    def close(self) -> None:
        self._fetcher.close()
        self._preparing.close()


def confirm_sources(handshake: Handshake, tp_rank: int, kv: list[tuple[Any, dict[str, Any]]], lease_backend: Any,
                    timeout_s: float) -> None:
    """Check each ``(backend, meta)`` the way its reads will, so that they find it remembered:
    the backend's ``confirm_peer`` where it has one, else ``parse_peer_meta`` (which runs the
    backend's source check once per meta and caches the result)."""
    pairs = list(kv)
    if lease_backend is not None and tp_rank < len(handshake.rank_lease_metas):
        pairs.append((lease_backend, handshake.rank_lease_metas[tp_rank]))
    for backend, meta in pairs:
        confirm = getattr(backend, "confirm_peer", None)
        if confirm is not None:
            if confirm(meta, timeout_s) is False:  # stalled or gone: the loads fail here, off the step thread,
                # instead of each pull asking again on it (the failure is kept with the handshake)
                raise TransferError("a source named by the handshake could not confirm its meta in time "
                                    "(stalled or gone); nothing was read")
        else:
            backend.parse_peer_meta(meta)


def confirm_rank_sources(handshake: Handshake, tp_rank: int, local: Any, backends: list[Any], lease_backend: Any,
                         timeout_s: float) -> None:
    """``confirm_sources`` for every prefill rank decode rank ``tp_rank`` will read or notify
    (``tp_reads``: its own rank with equal TP, NixlConnector's ranks with different TP);
    for a refused pair (``check_compatible`` says why, at the load) only the lease metas of the ranks a refusal
    tells to free at once, so that telling them loads nothing on the step thread (and a load NIXL's UCX failed
    once is tried again here, ``confirm_peer``); their failure leaves the refusal's reason as it is."""
    try:
        check_compatible(local, handshake.backend, handshake)
        reads = rank_reads(tp_rank, local, handshake.layout)
    except KVXferError:
        for target in notify_ranks(tp_rank, local.tp_size, handshake.layout.tp_size):
            try:
                confirm_sources(handshake, target.rank, [], lease_backend, timeout_s)
            except KVXferError as exc:
                logger.info("kvxfer vllm: a refused prefill's rank %d could not be loaded ahead of its release: %s",
                            target.rank, exc)
        return
    read_from = {read.src_rank for read in reads.reads}
    for target in reads.notify:
        metas = handshake.rank_kv_metas[target.rank] if target.rank in read_from else ()
        # a pipeline stage's regions are not the decode's one for one (``pp_stages``): any region loads its agent
        kv = [(backends[0], m) for m in metas] if handshake.layout.stages and backends else list(zip(backends, metas))
        confirm_sources(handshake, target.rank, kv, lease_backend, timeout_s)
