"""The prefill's answers to decode registrations (``KVXFER_REG`` -> ``KVXFER_HELLO``): owed only to decodes with a
room in flight here, paced.

SGLang's decode registers with a prefill rank once per bootstrap address (``CommonKVReceiver`` caches the
registration in its connection pool, and registers again only after that entry was invalidated, a failure),
so a genuine decode sends a handful of REGs in its life, and a room's metadata follows its decode's first REG
on the same connection. A decode needs the HELLO only to read a room's chunks (it keeps chunks that come before
the HELLO, and asks again, ``puller``). So a REG is *kept* (the latest per endpoint, oldest first, bounded in
count and bytes) and answered when its endpoint has a room in flight on this rank (``busy``: the room's first
chunk is about to be offered to it; the HELLO goes first, on the same socket). A REG from an endpoint with no
room costs the prefill one table entry and nothing else: no HELLO, no layout comparison, no socket.

Why: answering every REG at once let replayed REGs flood a decode with HELLOs (issue 38), and answering
strangers' REGs within an overall budget let a flood of REGs naming new endpoints starve genuine decodes (the
waiting REG was queued at the front, so every newer stranger's went first: 0 of 3 genuine REGs answered during a
14 s flood of 500 REG/s) and leak a socket per endpoint (issue 49). A stranger (keyless, the default) cannot
make an endpoint busy: that takes a room SGLang's prefill has a sender for, whose 63-bit id it does not know.

A decode whose layout this prefill cannot serve is told at once, without waiting for a room (a room may never
start: a decode of larger attention TP whose other ranks never come): ``conn`` compares the layouts of at most
``REFUSALS_PER_S`` REGs a second (``Budget``) and answers a refused one with a HELLO that carries the reason and
no metas. Over that budget a REG is only kept (a flood of strangers' REGs spends it; a mismatched decode then
learns at its first room, or by its timeout).

Per busy endpoint at most one HELLO per ``pace_s``: a REG inside that window is answered once, when it ends, with
the latest REG's content (a decode that restarted on the same endpoint still gets its HELLO). ``pace_s`` 0 turns
all of this off: every REG is answered at once (for tests that need HELLOs queued for a decode).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

#: Seconds between two HELLOs to one decode endpoint; 0: every REG answered at once.
PACE_ENV = "KVXFER_SGLANG_HELLO_PACE_S"
DEFAULT_PACE_S = 1.0
#: REGs kept for endpoints with no room yet, and their bytes (a REG's body as it came).
MAX_ENDPOINTS = 4096
MAX_BYTES = 32 << 20
#: A REG larger than this is not kept (a real layout is a few KiB).
MAX_REG_BYTES = 256 << 10
#: REGs whose layouts are compared on arrival, per second (a refused one is answered at once).
REFUSALS_PER_S = 8


class HelloPacer:
    """Answers REGs through ``answer(reg_body)`` (which sends the HELLO), as the module says. Thread-safe: ``reg``
    runs on the prefill's listener thread, ``busy`` under ``SourceRooms``' lock (``answer`` is called outside this
    class's lock), ``flush`` on the service loop (often: it is cheap when nothing is due)."""

    def __init__(self, answer: Callable[[dict[str, Any]], None], *, pace_s: float = DEFAULT_PACE_S,
                 max_endpoints: int = MAX_ENDPOINTS, max_bytes: int = MAX_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._answer, self._pace, self._clock = answer, pace_s, clock
        self._max, self._max_bytes = max_endpoints, max_bytes
        self._lock = threading.Lock()
        self._kept: "OrderedDict[str, tuple[dict[str, Any], int]]" = OrderedDict()  # endpoint -> (REG, bytes)
        self._bytes = 0
        self._busy: dict[str, float] = {}  # endpoints with a room in flight -> when their last HELLO went
        self._due: set[str] = set()  # busy endpoints with a kept REG waiting for their window to end
        self.counters = {"hellos": 0, "coalesced": 0, "dropped": 0}

    def reg(self, body: dict[str, Any], size: int = 0) -> bool:
        """A REG came (``size``: its body's bytes): answered now if its endpoint is busy and its window allows
        (True), else kept, the latest per endpoint."""
        if self._pace <= 0:
            self._send(body)
            return True
        endpoint = body["endpoint"]
        with self._lock:
            if size > MAX_REG_BYTES:
                self.counters["dropped"] += 1
                return False
            old = self._kept.pop(endpoint, None)
            if old is not None:
                self._bytes -= old[1]
                self.counters["coalesced"] += 1  # one answer for both
            now = self._clock()
            if endpoint in self._busy and now - self._busy[endpoint] >= self._pace:
                self._busy[endpoint] = now
                self._due.discard(endpoint)
            else:
                self._kept[endpoint] = (body, size)  # newest last: the oldest goes first when full
                self._bytes += size
                if endpoint in self._busy:
                    self._due.add(endpoint)
                self._bound_locked()
                return False
        self._send(body)
        return True

    def busy(self, endpoint: str, busy: bool) -> None:
        """``endpoint`` has its first room in flight here (``busy``): its kept REG is answered now; or its last
        room ended."""
        if self._pace <= 0:
            return
        with self._lock:
            if not busy:
                self._busy.pop(endpoint, None)
                self._due.discard(endpoint)
                return
            self._busy.setdefault(endpoint, float("-inf"))
            body = self._take_locked(endpoint, self._clock())
        if body is not None:
            self._send(body)

    def flush(self) -> None:
        """Answer the kept REGs of busy endpoints whose window has ended."""
        if not self._due:
            return
        with self._lock:
            now = self._clock()
            due = [body for body in (self._take_locked(endpoint, now) for endpoint in list(self._due))
                   if body is not None]
        for body in due:
            self._send(body)

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {"hello_endpoints": len(self._kept), "hello_bytes": self._bytes, "hello_busy": len(self._busy),
                    "hello_waiting": len(self._due)}

    def _take_locked(self, endpoint: str, now: float) -> Optional[dict[str, Any]]:
        """The kept REG of busy ``endpoint`` if its window allows an answer now (taken out), else None."""
        if endpoint not in self._kept:
            self._due.discard(endpoint)
            return None
        if now - self._busy[endpoint] < self._pace:
            self._due.add(endpoint)
            return None
        body, size = self._kept.pop(endpoint)
        self._bytes -= size
        self._busy[endpoint] = now
        self._due.discard(endpoint)
        return body

    def _bound_locked(self) -> None:
        while self._kept and (len(self._kept) > self._max or self._bytes > self._max_bytes):
            endpoint, (_, size) = self._kept.popitem(last=False)
            self._bytes -= size
            self._due.discard(endpoint)
            self.counters["dropped"] += 1

    def _send(self, body: dict[str, Any]) -> None:
        self.counters["hellos"] += 1
        self._answer(body)


def pace_from_env(environ: Optional[dict[str, str]] = None) -> float:
    """``KVXFER_SGLANG_HELLO_PACE_S`` (seconds, 0 for no pacing), default 1 s."""
    import os

    text = (environ if environ is not None else os.environ).get(PACE_ENV)
    if text is None or text == "":
        return DEFAULT_PACE_S
    value = float(text)
    if not 0 <= value <= 3600:
        raise ValueError(f"{PACE_ENV}={text!r}: give seconds, 0 to 3600")
    return value


class Budget:
    """At most ``rate`` events per second, in bursts of up to ``rate`` (a token bucket); what is over is refused,
    never queued: a flood spends the budget, and nothing waits behind it."""

    def __init__(self, rate: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate, self._clock = rate, clock
        self._tokens, self._at = float(rate), clock()
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self._rate, self._tokens + (now - self._at) * self._rate)
            self._at = now
            if self._tokens < 1:
                return False
            self._tokens -= 1
            return True
