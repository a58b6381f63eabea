"""Where kvxfer's helper processes run, so that the scheduler cannot leave them behind a busy engine.

kvxfer starts small helper processes from engine processes so that a busy engine cannot starve an
answer: the ucx meta confirmation (``ucx/confirm_server.py``) and the vLLM producer's handshake
(``integrations/vllm/handshake_server.py``). Two things a child inherits from the engine defeated that
on this repository's 2-core machine (Linux 6.18, ``sched_autogroup_enabled`` 1; real vLLM TP 2 -> TP 1,
issue 40), each seen with the answering child runnable and unscheduled for the whole 120 s a decode waited:

- **its session.** With autogroups, every session shares one scheduling group, and a group's weight on
  a core is its share of the group's load there: the TP 2 instance's load sat on core 0, so its group
  weighed next to nothing on core 1, where the TP 1 instance's worker spun. Every process of the TP 2
  instance on core 1 (its rank 1 and that rank's confirmation child) waited behind it. A helper is
  started in a session of its own (``start_new_session``): a group whose whole load is the helper.
- **its CPU mask.** Engines pin their threads (vLLM's CPU worker binds each rank to its cores,
  ``VLLM_CPU_OMP_THREADS_BIND``), and a child takes the mask of the thread that started it, so the
  helper could not leave a crowded core. ``unpin`` gives it every core the cpuset allows.

The helpers do little work and need no cache locality. A helper that dies while its engine lives is
started again (``RestartBudget`` says how often: issue 49, a killed child once left the engine unable to
answer any new decode until it restarted).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Callable, Optional

logger = logging.getLogger(__name__)


def unpin(pid: int) -> Optional[set[int]]:
    """Let process ``pid`` (a helper this process just started) run on every core the kernel allows it.

    Returns its mask afterwards, or None where it could not be set (the process is gone, or the platform
    has no affinity calls): it then keeps the mask of the thread that started it."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        os.sched_setaffinity(pid, range(os.cpu_count() or 1))  # the kernel keeps only what a cpuset allows
        return os.sched_getaffinity(pid)
    except OSError as exc:
        logger.debug("helper process %d keeps its parent's CPU mask: %s", pid, exc)
        return None


class RestartBudget:
    """How often a helper child may die and be started again: more than ``most`` deaths within ``window_s`` is
    no mishap (a child that cannot start, or something killing it), and its parent gives up loudly rather than
    start children for ever. Not thread-safe: its owner calls it under its own lock."""

    MOST, WINDOW_S = 5, 60.0

    def __init__(self, most: int = MOST, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.most, self.window_s, self._clock = most, window_s, clock
        self._deaths: deque[float] = deque()

    def died(self) -> bool:
        """Count a death; True while another start is allowed."""
        now = self._clock()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > self.window_s:
            self._deaths.popleft()
        return len(self._deaths) <= self.most

    @property
    def recent(self) -> int:
        """Deaths within the window."""
        return len(self._deaths)
