"""The prefill's answers to decode registrations (``KVXFER_REG`` -> ``KVXFER_HELLO``), paced.

SGLang's decode registers with a prefill rank once per bootstrap address (``CommonKVReceiver`` caches the
registration in its connection pool, and registers again only after that entry was invalidated, a failure),
so a genuine decode sends a handful of REGs in its life. A REG costs the prefill a layout comparison and the
decode a HELLO to take apart (every registered buffer's meta); replayed REGs (a captured signed one, or an
unsigned one without the cluster key) once queued a HELLO each, and 1,500 of them kept a decode busy for
1.5 s and filled zmq's queue to it (issue 38). So, per decode endpoint, at most one HELLO per ``pace_s``: a REG
inside that window is answered once, when the window ends, with the latest REG's content (a decode that
restarted on the same endpoint still gets its HELLO, within ``pace_s``); and over all endpoints at most
``burst`` HELLOs per ``pace_s`` (a stranger naming a new endpoint in every REG), the rest waiting their turn.
The table of endpoints is bounded (``max_endpoints``; when full, the oldest entry goes, a waiting one counted
as ``dropped``): a peer's frames cannot grow it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

#: Seconds between two HELLOs to one decode endpoint, and the window of the overall budget; 0 turns pacing off.
PACE_ENV = "KVXFER_SGLANG_HELLO_PACE_S"
DEFAULT_PACE_S = 1.0
#: HELLOs to all endpoints together per ``pace_s``.
DEFAULT_BURST = 64
#: Decode endpoints remembered at once.
MAX_ENDPOINTS = 4096


class HelloPacer:
    """Answers REGs through ``answer(reg_body)`` (which sends the HELLO), paced as the module says. Thread-safe:
    ``reg`` runs on the prefill's listener thread, ``flush`` on its service loop (often: it is cheap when nothing
    waits)."""

    def __init__(self, answer: Callable[[dict[str, Any]], None], *, pace_s: float = DEFAULT_PACE_S,
                 burst: int = DEFAULT_BURST, max_endpoints: int = MAX_ENDPOINTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._answer, self._pace, self._burst, self._max, self._clock = answer, pace_s, burst, max_endpoints, clock
        self._lock = threading.Lock()
        # endpoint -> [when its last HELLO went, the REG waiting for an answer or None]; oldest HELLO first
        self._endpoints: "OrderedDict[str, list]" = OrderedDict()
        self._tokens, self._refilled = float(burst), clock()
        self._waiting = 0
        self.counters = {"hellos": 0, "coalesced": 0, "dropped": 0}

    def reg(self, body: dict[str, Any]) -> bool:
        """A REG came: answer it now if its endpoint's window and the overall budget allow (True), else keep it
        (the latest per endpoint) for ``flush``."""
        if self._pace <= 0:
            self._send(body)
            return True
        endpoint = body["endpoint"]
        with self._lock:
            now = self._clock()
            entry = self._endpoints.get(endpoint)
            if entry is not None and (entry[1] is not None or now - entry[0] < self._pace):
                if entry[1] is None:
                    self._waiting += 1
                else:
                    self.counters["coalesced"] += 1  # one answer for both
                entry[1] = body
                return False
            if not self._take_token(now):
                self._remember(endpoint, [float("-inf"), body])
                self._waiting += 1
                return False
            self._remember(endpoint, [now, None])
        self._send(body)
        return True

    def flush(self) -> None:
        """Answer the REGs whose endpoint's window has ended, as far as the overall budget allows; forget
        endpoints idle for a whole window."""
        if self._pace <= 0 or not self._endpoints:
            return
        due: list[dict[str, Any]] = []
        with self._lock:
            now = self._clock()
            for endpoint in list(self._endpoints):
                sent_at, waiting = self._endpoints[endpoint]
                if now - sent_at < self._pace:
                    break  # oldest first: the rest are newer
                if waiting is None:
                    del self._endpoints[endpoint]
                    continue
                if not self._take_token(now):
                    break
                self._waiting -= 1
                del self._endpoints[endpoint]
                self._endpoints[endpoint] = [now, None]
                due.append(waiting)
        for body in due:
            self._send(body)

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {"hello_endpoints": len(self._endpoints), "hello_waiting": self._waiting}

    def _take_token(self, now: float) -> bool:
        self._tokens = min(float(self._burst), self._tokens + (now - self._refilled) * self._burst / self._pace)
        self._refilled = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def _remember(self, endpoint: str, entry: list) -> None:
        self._endpoints.pop(endpoint, None)
        self._endpoints[endpoint] = entry
        if entry[0] == float("-inf"):
            self._endpoints.move_to_end(endpoint, last=False)  # waiting for the budget: due at once
        while len(self._endpoints) > self._max:
            _, old = self._endpoints.popitem(last=False)
            if old[1] is not None:
                self._waiting -= 1
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
    if not value >= 0:
        raise ValueError(f"{PACE_ENV}={text!r}: give seconds, 0 or more")
    return value
