"""The prefill (source) side of a bench run, in a child process or in this one.

The decode side (the bench process) drives it through a small command set:
``setup`` (allocate a random pool, register it, return the meta), ``digest`` (a
SHA-256 of some blocks, to verify what the reader got), ``await`` (watch
``drain_read_done`` until a request id shows up and report *when*, on the shared
monotonic clock), ``close``. Network backends get a real second OS process (a spawn
child and a Pipe, as ``kvxfer.loopback`` does); the in-process ``local`` backend
gets the same interface without the process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any, Optional

import numpy as np

from kvxfer.backends.base import KVTransportBackend
from kvxfer.loopback import LoopbackConfig, blocks_digest, make_backend, make_pool

#: Backends that can only reach registrations in their own process.
IN_PROCESS_ONLY = frozenset({"local"})
CONTROL_TIMEOUT_S = 120.0


class SourceRole:
    """Owns one registered source pool at a time; the same code runs in either process."""

    def __init__(self) -> None:
        self.cfg: Optional[LoopbackConfig] = None
        self.backend: Optional[KVTransportBackend] = None
        self.pool: Any = None

    def setup(self, cfg: LoopbackConfig, agent_name: str) -> dict[str, Any]:
        self.release()
        self.cfg = cfg
        self.pool = make_pool(cfg, random_seed=cfg.seed + 1)
        self.backend = make_backend(cfg, "prefill", self.pool, agent_name=agent_name)
        return self.backend.export_meta()

    def digest(self, ids: list[int]) -> str:
        assert self.cfg is not None, "setup() first"
        return blocks_digest(self.pool, self.cfg.pool_blocks, np.asarray(ids, dtype=np.int64))

    def await_read_done(self, request_id: Any, timeout_s: float) -> float:
        """Poll the transport's read-done; return ``time.monotonic()`` when ``request_id`` appeared."""
        assert self.backend is not None, "setup() first"
        deadline = time.monotonic() + timeout_s
        while True:
            if request_id in self.backend.drain_read_done():
                return time.monotonic()
            failed = [f for f in self.backend.drain_read_failed() if f.request_id == request_id]
            if failed:
                raise RuntimeError(f"reader reported failure for request {request_id!r}: {failed[0].reason}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no read-done for request {request_id!r} within {timeout_s}s")
            time.sleep(20e-6)

    def stats(self) -> dict[str, int]:
        return self.backend.stats() if self.backend is not None else {}

    def release(self) -> None:
        if self.backend is not None:
            self.backend.close()
        self.backend, self.pool, self.cfg = None, None, None


def _serve(conn: Any, role_cls: type = SourceRole) -> None:
    """Child process body: execute commands on a ``role_cls()`` until ``close`` or the parent goes away.

    Any role with ``setup``/``digest``/``await_read_done``/``stats``/``release`` works
    (the naive-NIXL baseline brings its own).
    """
    role = role_cls()
    try:
        while True:
            if not conn.poll(CONTROL_TIMEOUT_S * 5):
                return  # the parent stopped talking to us: leave rather than linger
            command, args = conn.recv()
            if command == "close":
                conn.send(("ok", role.stats()))
                return
            try:
                if command == "setup":
                    value: Any = role.setup(*args)
                elif command == "digest":
                    value = role.digest(*args)
                elif command == "await":
                    value = role.await_read_done(*args)
                else:
                    raise ValueError(f"unknown command {command!r}")
                conn.send(("ok", value))
            except Exception as exc:  # reported to the parent, which records it on the point
                conn.send(("error", f"source: {type(exc).__name__}: {exc}"))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    finally:
        role.release()
        conn.close()


class SourceClient:
    """The source as the bench sees it. ``expect`` + ``read_done_at`` bracket one pull."""

    two_process = False

    def setup(self, cfg: LoopbackConfig, agent_name: str) -> dict[str, Any]:
        raise NotImplementedError

    def digest(self, ids: np.ndarray) -> str:
        raise NotImplementedError

    def expect(self, request_id: int, timeout_s: float) -> None:
        """Start watching for ``request_id``'s read-done (call before posting the read)."""

    def read_done_at(self, request_id: int, timeout_s: float) -> float:
        raise NotImplementedError

    def close(self) -> dict[str, int]:
        raise NotImplementedError


class InProcessSource(SourceClient):
    """For backends that cannot cross processes: the source role lives here."""

    def __init__(self) -> None:
        self.role = SourceRole()

    def setup(self, cfg: LoopbackConfig, agent_name: str) -> dict[str, Any]:
        return self.role.setup(cfg, agent_name)

    def digest(self, ids: np.ndarray) -> str:
        return self.role.digest(ids.tolist())

    def read_done_at(self, request_id: int, timeout_s: float) -> float:
        return self.role.await_read_done(request_id, timeout_s)

    def close(self) -> dict[str, int]:
        stats = self.role.stats()
        self.role.release()
        return stats


class ChildSource(SourceClient):
    """The source role in a spawned child process; every call has a timeout."""

    two_process = True

    def __init__(self, timeout_s: float = CONTROL_TIMEOUT_S, role_cls: type = SourceRole) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._timeout_s = timeout_s
        self._proc = ctx.Process(target=_serve, args=(child, role_cls), name="kvxfer-bench-source", daemon=True)
        self._proc.start()
        child.close()
        self.pid = self._proc.pid
        self._pending_await: Optional[float] = None  # timeout of an ``await`` whose answer is unread

    def _call(self, command: str, *args: Any, timeout_s: Optional[float] = None) -> Any:
        if self._pending_await is not None:  # a pull failed between expect and read_done_at: resync
            try:
                self.read_done_at(-1, self._pending_await)
            except (RuntimeError, TimeoutError):
                pass
        self._conn.send((command, args))
        return self._reply(command, timeout_s)

    def _reply(self, command: str, timeout_s: Optional[float] = None) -> Any:
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"source process gave no answer to {command!r} within {timeout_s:.0f}s")
        kind, value = self._conn.recv()
        if kind == "error":
            raise RuntimeError(value)
        return value

    def setup(self, cfg: LoopbackConfig, agent_name: str) -> Any:
        return self._call("setup", cfg, agent_name)

    def digest(self, ids: np.ndarray) -> str:
        return self._call("digest", ids.tolist())

    def expect(self, request_id: int, timeout_s: float) -> None:
        self._conn.send(("await", (request_id, timeout_s)))
        self._pending_await = timeout_s

    def read_done_at(self, request_id: int, timeout_s: float) -> float:
        self._pending_await = None
        return self._reply("await", timeout_s + 5.0)

    def close(self) -> dict[str, int]:
        stats: dict[str, int] = {}
        try:
            if self._proc.is_alive():
                stats = self._call("close", timeout_s=10.0)
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        finally:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=5)
            self._conn.close()
        return stats


def open_source(backend: str, timeout_s: float) -> SourceClient:
    """A child-process source for network backends, an in-process one for ``local``."""
    return InProcessSource() if backend in IN_PROCESS_ONLY else ChildSource(timeout_s=max(timeout_s, CONTROL_TIMEOUT_S))


def agent_name(role: str, tag: str) -> str:
    """Agent names unique per process and pool (NIXL peers key on them)."""
    return f"kvxfer-bench-{role}-{os.getpid()}-{tag}"
