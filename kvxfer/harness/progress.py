"""Progress for the commands that run a harness (loopback, soak, generate).

A run that ends within a second shows nothing; a longer one gets a rich spinner
(and a bar when the total is known) on stderr, so stdout stays the command's
result. Nothing is drawn when stderr is not a terminal (CI logs, pipes) or with
``--quiet``: a log file full of redraws helps nobody.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

#: How long a run may take before its progress appears.
DELAY_S = 1.0


class DelayedProgress:
    """One task's progress, drawn on stderr only once the run has lasted ``delay_s``."""

    def __init__(self, description: str, total: Optional[int] = None, *, enabled: bool = True,
                 delay_s: float = DELAY_S, console: Optional[Console] = None) -> None:
        self.console = console or Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal
        columns = [SpinnerColumn(), TextColumn("{task.description}")]
        if total is not None:
            columns += [BarColumn(), MofNCompleteColumn()]
        columns.append(TimeElapsedColumn())
        self._progress = Progress(*columns, console=self.console, transient=True)
        self._task = self._progress.add_task(description, total=total)
        self._delay_s = delay_s
        self._lock = threading.Lock()
        self._timer: Optional[threading.Timer] = None
        self._started = self._stopped = False

    def __enter__(self) -> "DelayedProgress":
        if self.enabled:
            self._timer = threading.Timer(self._delay_s, self._start)
            self._timer.daemon = True
            self._timer.start()
        return self

    def _start(self) -> None:
        with self._lock:
            if not self._stopped:
                self._progress.start()
                self._started = True

    def phase(self, description: str) -> None:
        """What the run is doing now (replaces the description)."""
        self._progress.update(self._task, description=description)

    def advance_to(self, completed: int, total: Optional[int] = None) -> None:
        """``completed`` of ``total`` steps are done."""
        self._progress.update(self._task, completed=completed, total=total)

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._stopped = True
            if self._started:
                self._progress.stop()


__all__ = ["DELAY_S", "DelayedProgress"]
