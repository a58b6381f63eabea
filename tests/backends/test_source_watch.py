"""``SourceWatch``: a pidfd on a source of this host, asked by the engine's thread and a progress thread at once."""

from __future__ import annotations

import subprocess
import sys
import threading

from kvxfer.backends.same_host import PID_FIELD, START_FIELD, SourceWatch, process_start_time
from kvxfer.meta.seal import HOST_FIELD, host_identity


def test_watch_answers_two_threads_at_once_and_sees_the_exit():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        meta = {HOST_FIELD: host_identity(), PID_FIELD: child.pid, START_FIELD: process_start_time(child.pid)}
        watch = SourceWatch.for_meta(meta)
        assert watch is not None and not watch.exited()
        errors: list[BaseException] = []

        def ask() -> None:  # one poll object, two threads: CPython refuses a concurrent poll() unless guarded
            try:
                for _ in range(20000):
                    assert not watch.exited()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        child.stdin.close()
        child.wait(timeout=10)
        assert watch.exited()
        watch.close()
        assert watch.exited()  # closed: as good as gone
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
