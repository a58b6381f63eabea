"""Thin Python objects over the cffi UCP binding, with live-object counters.

Why this layer exists: UCP objects (contexts, workers, endpoints, memory
handles, rkeys, requests) are manual-lifetime C objects. Each Python wrapper
owns exactly one, releases it exactly once, and counts itself in ``LIVE`` so a
test can assert that 1,000 open/transfer/close cycles leave nothing behind.

Threading: a worker is created ``UCS_THREAD_MODE_SERIALIZED`` and every call
that touches it (or its endpoints, rkeys and requests) runs under
``Worker.lock``. Callbacks (active messages, endpoint errors, completions) only
run inside ``ucp_worker_progress``, i.e. with that lock held.

Progress: ``Worker.start_progress_thread`` runs a thread that progresses the
worker and then sleeps on the worker's event fd (``ucp_worker_arm`` + ``poll``),
so an idle worker costs no CPU. While operations are outstanding it also wakes
on a short timer, so a transport that does not signal its completions through
the event fd still finishes them.

The compiled module is imported lazily (``load()``): kvxfer works without it,
and the UCX backend reports itself unavailable with the reason.
"""

from __future__ import annotations

import logging
import importlib
import itertools
import os
import select
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)

LIVE: Counter[str] = Counter()  # kind -> live objects of that kind in this process
_LIVE_LOCK = threading.Lock()

_ffi: Any = None
_lib: Any = None
_load_error: Optional[str] = None

# Callback targets, keyed by the integer that travels as the C callback's ``arg``.
_WORKERS: dict[int, "Worker"] = {}
#: The longest ``Worker.close`` waits for ``ucp_worker_destroy``.
WORKER_DESTROY_TIMEOUT_S = 5.0
#: Most ``ucp_worker_progress`` rounds one progress call runs (in C, ``kvx_progress_all``): enough to
#: finish what a post started, and a peer flooding the worker cannot hold the caller (an engine step).
PROGRESS_ROUNDS = 1024
_ENDPOINTS: dict[int, "Endpoint"] = {}
#: Active-message handlers, key -> (worker, ``handler(header, data, length, param)``): run by
#: ``ucp_worker_progress``, so with the worker lock held.
_AM_HANDLERS: dict[int, tuple["Worker", Callable[[bytes, Any, int, Any], None]]] = {}
_KEYS = itertools.count(1)


class UcpError(RuntimeError):
    """A UCP call failed; ``status`` is the ``ucs_status_t`` code."""

    def __init__(self, what: str, status: int) -> None:
        self.status = status
        super().__init__(f"{what} failed: {status_string(status)} ({status})")


def _count(kind: str, delta: int) -> None:
    with _LIVE_LOCK:
        LIVE[kind] += delta


def live_objects() -> dict[str, int]:
    """Snapshot of the live-object counters (only non-zero kinds)."""
    with _LIVE_LOCK:
        return {kind: n for kind, n in LIVE.items() if n}


#: C helpers of this version of the binding (``binding_build``), checked at load
_REQUIRED_SYMBOLS = ("kvx_get_chain", "kvx_batch_done", "kvx_progress_all", "kvx_serve_abandon")


def load() -> tuple[Any, Any]:
    """Import the compiled binding (loading the wheel's libucp first); raise ImportError with the fix."""
    global _ffi, _lib, _load_error
    if _lib is not None:
        return _ffi, _lib
    if _load_error is not None:
        raise ImportError(_load_error)
    try:
        try:
            import libucx  # the libucx-cu12 wheel: puts libucs/libuct/libucp in the loader's cache

            libucx.load_library()
        except ImportError:
            pass  # a system UCX may still satisfy the extension's rpath / ld.so.conf
        _ucp_cffi = importlib.import_module("kvxfer.backends.ucx._ucp_cffi")
    except (ImportError, OSError) as exc:
        _load_error = (
            f"the UCX binding could not be loaded ({exc}); install kvxfer with its build dependencies "
            "(`pip install -e .` builds kvxfer/backends/ucx/_ucp_cffi with cffi against libucx-cu12>=1.21,<1.23; "
            "a wheel built with KVXFER_BUILD_WITHOUT_UCX=1 has no binding), "
            "or build it in place with `python -m kvxfer.backends.ucx.binding_build`"
        )
        raise ImportError(_load_error) from None
    missing = [name for name in _REQUIRED_SYMBOLS if not hasattr(_ucp_cffi.lib, name)]
    if missing:  # a binding built by an older kvxfer, in place: it would fail later, in a thread
        _load_error = (f"the UCX binding is stale (it lacks {', '.join(missing)}): rebuild it with "
                       "`python -m kvxfer.backends.ucx.binding_build` or reinstall kvxfer (`pip install -e .`)")
        raise ImportError(_load_error)
    _ffi, _lib = _ucp_cffi.ffi, _ucp_cffi.lib
    _install_callbacks(_ffi)
    return _ffi, _lib


class ReasonStatus(int):
    """A ``ucs_status_t`` with kvxfer's own words for it (``status_string`` gives them): a served read
    that the source refused carries the source's reason (``served.py``)."""

    reason: str

    def __new__(cls, status: int, reason: str) -> "ReasonStatus":
        value = super().__new__(cls, status)
        value.reason = reason
        return value


def status_string(status: int) -> str:
    reason = getattr(status, "reason", None)
    if reason:
        return str(reason)
    if _lib is None:
        return f"status {status}"
    return _ffi.string(_lib.ucs_status_string(status)).decode()


def is_ok(status: int) -> bool:
    """True for UCS_OK."""
    return status == _lib.UCS_OK


def in_progress(status: int) -> bool:
    """True for UCS_INPROGRESS (a request still running)."""
    return status == _lib.UCS_INPROGRESS


def code(name: str) -> int:
    """A ``ucs_status_t`` by name (``"UCS_ERR_CANCELED"``)."""
    return int(getattr(_lib, name))


def data_bytes(data: Any, length: int) -> bytes:
    """A copy of an active message's data (valid only inside its handler)."""
    return bytes(_ffi.buffer(data, length))


def _check(status: int, what: str) -> None:
    if status != _lib.UCS_OK:
        raise UcpError(what, status)


def version() -> str:
    _, lib = load()
    return _ffi.string(lib.ucp_get_version_string()).decode()


def _install_callbacks(ffi: Any) -> None:
    """Define the ``extern "Python"`` callbacks once per process."""

    def _on_callback_error(exc_type: Any, exc: Any, tb: Any) -> None:
        logger.error("exception in a UCX callback", exc_info=(exc_type, exc, tb))

    @ffi.def_extern(onerror=_on_callback_error)
    def kvx_am_recv_py(arg, header, header_length, data, length, param):  # type: ignore[no-untyped-def]
        # Every kvxfer message is eager (its data valid during this call). A rendezvous descriptor
        # (a peer's oversized message) is nobody's here: returning UCS_OK makes UCX drop it and
        # complete the sender's request (ucp_def.h, ucp_am_recv_callback_t). It must not also be
        # released here: UCX would then release it twice.
        entry = _AM_HANDLERS.get(int(ffi.cast("uintptr_t", arg)))
        if entry is None:
            return _lib.UCS_OK
        worker, handler = entry
        if param.recv_attr & _lib.UCP_AM_RECV_ATTR_FLAG_RNDV:
            return _lib.UCS_OK
        handler(bytes(ffi.buffer(header, header_length)), data, int(length), param)
        return _lib.UCS_OK

    @ffi.def_extern(onerror=_on_callback_error)
    def kvx_ep_error_py(arg, ep, status):  # type: ignore[no-untyped-def]
        endpoint = _ENDPOINTS.get(int(ffi.cast("uintptr_t", arg)))
        if endpoint is not None:
            endpoint._on_error(int(status))


class Context:
    """A UCP context with the RMA, AM and WAKEUP features (one per backend instance)."""

    def __init__(self) -> None:
        ffi, lib = load()
        config = ffi.new("ucp_config_t **")
        _check(lib.ucp_config_read(ffi.NULL, ffi.NULL, config), "ucp_config_read")
        try:
            params = ffi.new("ucp_params_t *")
            params.field_mask = lib.UCP_PARAM_FIELD_FEATURES
            params.features = lib.UCP_FEATURE_RMA | lib.UCP_FEATURE_AM | lib.UCP_FEATURE_WAKEUP
            handle = ffi.new("ucp_context_h *")
            _check(lib.ucp_init(params, config[0], handle), "ucp_init")
        finally:
            lib.ucp_config_release(config[0])
        self.handle = handle[0]
        _count("context", 1)

    def close(self) -> None:
        if self.handle is not None:
            _lib.ucp_cleanup(self.handle)
            self.handle = None
            _count("context", -1)


class MemoryRegion:
    """``ucp_mem_map`` of an existing buffer; ``packed_rkey`` is what a peer needs to read it."""

    def __init__(self, context: Context, address: int, length: int, cuda: bool) -> None:
        ffi, lib = _ffi, _lib
        params = ffi.new("ucp_mem_map_params_t *")
        params.field_mask = (lib.UCP_MEM_MAP_PARAM_FIELD_ADDRESS | lib.UCP_MEM_MAP_PARAM_FIELD_LENGTH
                             | lib.UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE)
        params.address = ffi.cast("void *", address)
        params.length = length
        params.memory_type = lib.UCS_MEMORY_TYPE_CUDA if cuda else lib.UCS_MEMORY_TYPE_HOST
        memh = ffi.new("ucp_mem_h *")
        _check(lib.ucp_mem_map(context.handle, params, memh), "ucp_mem_map")
        self.context = context
        self.handle = memh[0]
        self.address, self.length, self.cuda = address, length, cuda
        _count("memh", 1)
        buf, size = ffi.new("void **"), ffi.new("size_t *")
        try:
            _check(lib.ucp_rkey_pack(context.handle, self.handle, buf, size), "ucp_rkey_pack")
        except UcpError:
            self.close()
            raise
        self.packed_rkey = bytes(ffi.buffer(buf[0], size[0]))
        lib.ucp_rkey_buffer_release(buf[0])

    def close(self) -> None:
        if self.handle is not None:
            _lib.ucp_mem_unmap(self.context.handle, self.handle)
            self.handle = None
            _count("memh", -1)


class Worker:
    """A UCP worker, its lock, its address, an AM handler and an optional progress thread."""

    def __init__(self, context: Context, am_id: int,
                 on_active_message: Optional[Callable[[bytes], None]] = None) -> None:
        ffi, lib = _ffi, _lib
        params = ffi.new("ucp_worker_params_t *")
        params.field_mask = lib.UCP_WORKER_PARAM_FIELD_THREAD_MODE
        params.thread_mode = lib.UCS_THREAD_MODE_SERIALIZED
        handle = ffi.new("ucp_worker_h *")
        _check(lib.ucp_worker_create(context.handle, params, handle), "ucp_worker_create")
        self.handle = handle[0]
        _count("worker", 1)
        self.lock = threading.RLock()
        self.key = next(_KEYS)
        self.on_active_message = on_active_message
        self.inflight = 0  # outstanding operations; makes the progress thread poll on a short timer
        self.idle_tasks: list[Callable[[], None]] = []  # run by the progress thread after each pass, lock held
        self.unlocked_tasks: list[Callable[[], None]] = []  # run by the progress thread after each pass, lock released
        #: run by ``close`` under the lock, after the progress thread stopped and before the worker is destroyed
        self.before_destroy: list[Callable[[], None]] = []
        #: the ``served.Server`` answering reads of this worker's pool, if any (its counters: ``stats()``)
        self.served: Any = None
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._idle_sleep = False  # True while the progress thread sleeps without a timer
        _WORKERS[self.key] = self
        try:
            addr, size = ffi.new("ucp_address_t **"), ffi.new("size_t *")
            _check(lib.ucp_worker_get_address(self.handle, addr, size), "ucp_worker_get_address")
            self.address = bytes(ffi.buffer(addr[0], size[0]))
            lib.ucp_worker_release_address(self.handle, addr[0])
            efd = ffi.new("int *")
            _check(lib.ucp_worker_get_efd(self.handle, efd), "ucp_worker_get_efd")
            self.efd = efd[0]
            self._am_keys: list[int] = []
            self.set_am_handler(am_id, self._on_notice)
        except UcpError:
            self.close()
            raise

    def _on_notice(self, header: bytes, data: Any, length: int, param: Any) -> None:
        if self.on_active_message is not None:
            self.on_active_message(header)

    def set_am_handler(self, am_id: int, handler: Callable[[bytes, Any, int, Any], None]) -> None:
        """Route active messages ``am_id`` to ``handler(header, data, length, param)`` (worker lock held;
        ``data`` is valid only during the call)."""
        ffi, lib = _ffi, _lib
        key = next(_KEYS)
        _AM_HANDLERS[key] = (self, handler)
        self._am_keys.append(key)
        am = ffi.new("ucp_am_handler_param_t *")
        am.field_mask = (lib.UCP_AM_HANDLER_PARAM_FIELD_ID | lib.UCP_AM_HANDLER_PARAM_FIELD_CB
                         | lib.UCP_AM_HANDLER_PARAM_FIELD_ARG)
        am.id = am_id
        am.cb = lib.kvx_am_recv_py
        am.arg = ffi.cast("void *", key)
        with self.lock:
            _check(lib.ucp_worker_set_am_recv_handler(self.handle, am), "ucp_worker_set_am_recv_handler")

    # --- progress ----------------------------------------------------------------------
    def progress(self) -> None:
        """Progress until the worker has nothing more to do right now."""
        with self.lock:
            if self.handle is not None:
                _lib.kvx_progress_all(self.handle, PROGRESS_ROUNDS)

    def signal(self, only_if_idle: bool = False) -> None:
        """Wake the progress thread (to stop it, or so it notices new work).

        ``only_if_idle``: skip it unless the thread is in its long idle sleep. A
        wakeup costs a thread switch and GIL hand-off (~100 us measured), so
        posting does not pay it when the thread already polls on the short timer.
        """
        if only_if_idle and not self._idle_sleep:
            return
        handle = self.handle
        if handle is not None:  # UCX: safe from any thread, no lock needed (so a poster never waits here)
            _lib.ucp_worker_signal(handle)

    def start_progress_thread(self, name: str) -> None:
        self._thread = threading.Thread(target=self._progress_loop, name=name, daemon=True)
        self._thread.start()

    def _progress_loop(self) -> None:
        poller = select.poll()
        poller.register(self.efd, select.POLLIN)
        while not self._stop:
            with self.lock:
                if self.handle is None:
                    return
                saturated = _lib.kvx_progress_all(self.handle, PROGRESS_ROUNDS) >= PROGRESS_ROUNDS
                for task in list(self.idle_tasks):
                    task()
                # a full budget of rounds: more is queued, so progress again (the lock let go between) unarmed
                status = _lib.UCS_ERR_BUSY if saturated else _lib.ucp_worker_arm(self.handle)
                busy = self.inflight > 0
            for task in self.unlocked_tasks:
                task()
            if status == _lib.UCS_ERR_BUSY:
                continue  # events arrived while arming: progress again
            # Idle: block on the event fd. With work outstanding, also wake every 2 ms.
            if busy:
                poller.poll(2)
            else:
                self._idle_sleep = True
                if self.inflight > 0:  # posted between arming and here: don't sleep on it
                    self._idle_sleep = False
                    continue
                poller.poll(1000)
                self._idle_sleep = False

    # --- teardown ----------------------------------------------------------------------
    def stop_progress_thread(self) -> None:
        if self._thread is not None:
            self._stop = True
            self.signal()
            self._thread.join(timeout=10)
            self._thread = None

    def close(self, timeout_s: float = WORKER_DESTROY_TIMEOUT_S) -> bool:
        """Destroy the worker; False if ``ucp_worker_destroy`` did not return within ``timeout_s``.

        Seen once (3 of 6 closes after a notice stall, never reproduced since pending notice
        sends are freed before it): ``ucp_worker_destroy`` not returning. close() must not hang
        its caller, so the destroy runs on a thread of its own; one that does not come back is
        logged and left (the worker stays counted in ``live_objects()``).
        """
        self.stop_progress_thread()
        with self.lock:
            if self.handle is not None:
                for hook in self.before_destroy:
                    try:
                        hook()
                    except Exception:  # noqa: BLE001 - the worker is destroyed whatever a hook did
                        logger.exception("ucx: a hook before the worker's destruction failed")
            handle, self.handle = self.handle, None
        if handle is None:
            self._forget_callbacks()
            return True
        destroyed = threading.Event()

        def destroy() -> None:
            with self.lock:
                _lib.ucp_worker_destroy(handle)
            destroyed.set()

        threading.Thread(target=destroy, name="kvxfer-ucx-worker-destroy", daemon=True).start()
        if not destroyed.wait(timeout_s):
            logger.error("ucx: ucp_worker_destroy did not return within %.1fs; the worker is abandoned (its "
                         "memory and sockets stay until the process exits)", timeout_s)
            return False
        _count("worker", -1)
        self._forget_callbacks()  # kept until now: UCX may call our callbacks while it tears down
        return True

    def _forget_callbacks(self) -> None:
        _WORKERS.pop(self.key, None)
        for key in getattr(self, "_am_keys", ()):
            _AM_HANDLERS.pop(key, None)

    def wait_request(self, request: Any, deadline: float, *, give_up: bool = False) -> int:
        """Progress until ``request`` (a non-NULL, non-error pointer) completes; free it; its status.

        Returns ``UCS_ERR_TIMED_OUT`` if the deadline passes first, leaving it counted, or, with
        ``give_up``, released anyway (UCX frees a request released early when it completes:
        for requests whose completion nothing waits for, e.g. at close).
        """
        lib = _lib
        while True:
            with self.lock:
                lib.ucp_worker_progress(self.handle)
                status = lib.ucp_request_check_status(request)
                if status != lib.UCS_INPROGRESS or (give_up and time.monotonic() > deadline):
                    lib.ucp_request_free(request)
                    _count("request", -1)
                    return int(status) if status != lib.UCS_INPROGRESS else int(lib.UCS_ERR_TIMED_OUT)
            if time.monotonic() > deadline:
                return int(lib.UCS_ERR_TIMED_OUT)
            time.sleep(0.0002)


class Endpoint:
    """An endpoint to a peer worker, with peer error handling and an error callback.

    ``peer_error_handling=False`` leaves UCX's default (no peer failure handling).
    Measured with UCX 1.22 on one host: peer error handling rules out the shared
    memory transports (posix/sysv: "no peer failure handler"), and ``ucp_get``
    then runs as software emulation over tcp (the source's progress thread serves
    it); without it, gets are zero-copy CMA reads that need no source CPU.
    """

    def __init__(self, worker: Worker, peer_address: bytes, on_error: Callable[["Endpoint", int], None],
                 peer_error_handling: bool = True) -> None:
        ffi, lib = _ffi, _lib
        self.worker = worker
        self.peer_address = peer_address
        self.on_error = on_error
        self.error: Optional[int] = None
        self.key = next(_KEYS)
        #: batches whose chained guard read goes through this endpoint and may not be posted yet:
        #: stopped before the endpoint closes, so a completion never posts on a closed endpoint
        self.guarding: set["GetBatch"] = set()
        self._address_buf = ffi.new("char[]", peer_address)  # must outlive ucp_ep_create only
        params = ffi.new("ucp_ep_params_t *")
        params.field_mask = (lib.UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | lib.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                             | lib.UCP_EP_PARAM_FIELD_ERR_HANDLER)
        params.address = ffi.cast("const ucp_address_t *", self._address_buf)
        if peer_error_handling:
            params.err_mode = lib.UCP_ERR_HANDLING_MODE_PEER
        else:
            params.field_mask &= ~lib.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE  # UCX default: no peer failure handling
        params.err_handler.cb = lib.kvx_ep_error_py
        params.err_handler.arg = ffi.cast("void *", self.key)
        handle = ffi.new("ucp_ep_h *")
        _ENDPOINTS[self.key] = self
        with worker.lock:
            status = lib.ucp_ep_create(worker.handle, params, handle)
        if status != lib.UCS_OK:
            _ENDPOINTS.pop(self.key, None)
            raise UcpError("ucp_ep_create", status)
        self.handle = handle[0]
        _count("endpoint", 1)

    def _on_error(self, status: int) -> None:
        if self.error is None:
            self.error = status
            self.on_error(self, status)

    def transports(self) -> list[tuple[str, str]]:
        """(transport, device) per lane, from ``ucp_ep_query``."""
        ffi, lib = _ffi, _lib
        entries = ffi.new("ucp_transport_entry_t[]", 16)
        attr = ffi.new("ucp_ep_attr_t *")
        attr.field_mask = lib.UCP_EP_ATTR_FIELD_TRANSPORTS
        attr.transports.entries = entries
        attr.transports.num_entries = 16
        attr.transports.entry_size = ffi.sizeof("ucp_transport_entry_t")
        with self.worker.lock:
            if self.handle is None or lib.ucp_ep_query(self.handle, attr) != lib.UCS_OK:
                return []
            return [(ffi.string(entries[i].transport_name).decode(), ffi.string(entries[i].device_name).decode())
                    for i in range(attr.transports.num_entries)]

    def close(self, timeout_s: float = 2.0) -> None:
        """Force-close: outstanding requests on it complete with ``UCS_ERR_CANCELED``."""
        ffi, lib = _ffi, _lib
        if self.handle is None:
            return
        params = ffi.new("ucp_request_param_t *")
        params.op_attr_mask = lib.UCP_OP_ATTR_FIELD_FLAGS
        params.flags = lib.UCP_EP_CLOSE_FLAG_FORCE
        with self.worker.lock:
            for batch in list(self.guarding):
                batch.stop_chain()
            ptr = lib.ucp_ep_close_nbx(self.handle, params)
            self.handle = None
            _count("endpoint", -1)
            pending = lib.kvx_ptr_status(ptr) == lib.UCS_INPROGRESS
            if pending:
                _count("request", 1)
        if pending:
            self.worker.wait_request(ptr, time.monotonic() + timeout_s, give_up=True)
        _ENDPOINTS.pop(self.key, None)


class RemoteKey:
    """A peer's packed rkey unpacked on one endpoint."""

    def __init__(self, endpoint: Endpoint, packed: bytes) -> None:
        ffi, lib = _ffi, _lib
        rkey = ffi.new("ucp_rkey_h *")
        with endpoint.worker.lock:
            _check(lib.ucp_ep_rkey_unpack(endpoint.handle, packed, rkey), "ucp_ep_rkey_unpack")
        self.endpoint = endpoint
        self.handle = rkey[0]
        _count("rkey", 1)

    def close(self) -> None:
        if self.handle is not None:
            with self.endpoint.worker.lock:
                _lib.ucp_rkey_destroy(self.handle)
            self.handle = None
            _count("rkey", -1)


def _int64s(values: "Sequence[int] | np.ndarray") -> Any:
    """``values`` as a C ``int64_t[]``: a list of Python ints copied in (no numpy on the hot path), an
    array viewed in place (made contiguous int64 first if it is not)."""
    if isinstance(values, np.ndarray):
        if values.dtype != np.int64 or not values.flags.c_contiguous:
            values = np.ascontiguousarray(values, dtype=np.int64)
        return _ffi.from_buffer("int64_t[]", values)
    return _ffi.new("int64_t[]", values)


@dataclass(frozen=True)
class GuardGet:
    """A guard read to chain behind a batch: ``length`` bytes at the peer's ``remote`` address, through
    ``endpoint`` and ``rkey`` (on the batch's worker), into host memory at ``local``."""

    endpoint: Endpoint
    rkey: RemoteKey
    local: int
    remote: int
    length: int
    #: sent as active message ``am_id`` (header only) on ``endpoint`` once the guard read landed
    notice: bytes = b""
    am_id: int = 0


class GetBatch:
    """Every row of one copy plan posted as ``ucp_get_nbx``; completion counted in C.

    ``done`` is True once every posted get has completed (or been cancelled);
    ``status`` is the first error seen (``UCS_OK`` if none). ``release()`` frees
    the requests and must run exactly once, after ``done``.

    With a ``guard`` (``kvx_get_chain``), the completion callback of the batch's last get posts
    the guard read, in C, only if every get succeeded: the guard is read strictly after the data
    and as soon as it landed. ``done`` then also waits for the guard read, and ``status`` is the
    batch's first error, else the guard's (``UCS_ERR_CANCELED`` when the chain was stopped before
    the guard was posted: ``guard_read`` tells whether it was read).
    """

    def __init__(self, endpoint: Endpoint, rkey: RemoteKey, local_base: int, remote_base: int,
                 src_offsets: "Sequence[int] | np.ndarray", dst_offsets: "Sequence[int] | np.ndarray",
                 lengths: "Sequence[int] | np.ndarray", cuda: bool,
                 guard: Optional[GuardGet] = None) -> None:
        ffi, lib = _ffi, _lib
        self.worker = endpoint.worker
        self.chain: Any = None
        self._notice: Any = None
        self._guard_endpoint: Optional[Endpoint] = None
        n = len(lengths)
        # the rows as C arrays, kept alive with the batch (UCX reads them only inside the post)
        src, dst, lens = self._rows = (_int64s(src_offsets), _int64s(dst_offsets), _int64s(lengths))
        self.requests = ffi.new("void *[]", max(n, 1))
        self.n = n
        self.released = False
        posted = ffi.new("size_t *")
        with self.worker.lock:
            if guard is None:
                self.counter = ffi.new("kvx_counter_t *")
                status = lib.kvx_get_batch(endpoint.handle, rkey.handle, local_base, remote_base, src, dst, lens, n,
                                           1 if cuda else 0, self.counter, self.requests, posted)
            else:
                if guard.endpoint.worker is not self.worker or guard.endpoint.handle is None:
                    raise UcpError("chaining a guard read (its endpoint is closed or on another worker)",
                                   int(lib.UCS_ERR_INVALID_PARAM))
                chain = self.chain = ffi.new("kvx_chain_t *")
                chain.guard_pending = 1
                chain.ep, chain.rkey = guard.endpoint.handle, guard.rkey.handle
                chain.local, chain.remote, chain.length = guard.local, guard.remote, guard.length
                if guard.notice:
                    self._notice = ffi.new("char[]", guard.notice)  # read by UCX inside the send only
                    chain.am_id, chain.notice, chain.notice_length = guard.am_id, self._notice, len(guard.notice)
                self.counter = _ffi.addressof(chain, "data")
                self._guard_endpoint = guard.endpoint
                guard.endpoint.guarding.add(self)
                status = lib.kvx_get_chain(endpoint.handle, rkey.handle, local_base, remote_base, src, dst, lens, n,
                                           1 if cuda else 0, chain, self.requests, posted)
            self.outstanding = int(self.counter.pending)
            _count("request", self.outstanding)
            self.worker.inflight += 1
        self.posted = int(posted[0])
        self.post_status = int(status)  # a row that failed to post: also the counter's status (set in C)

    @property
    def done(self) -> bool:
        """Read with acquire order in C: once True, ``status`` (written before) is final on this thread too."""
        return bool(_lib.kvx_batch_done(self.counter, self.chain if self.chain is not None else _ffi.NULL))

    @property
    def status(self) -> int:
        if self.chain is None or self.counter.status != _lib.UCS_OK:
            return int(self.counter.status)
        return int(self.chain.guard_status)

    @property
    def guard_in_flight(self) -> bool:
        """The chained guard read was posted and has not completed."""
        return self.chain is not None and self.chain.guard_state == 1

    @property
    def guard_read(self) -> bool:
        """The chained guard read completed (with the status ``status`` reports)."""
        return self.chain is not None and self.chain.guard_state == 2

    def take_notice(self) -> tuple[int, Any]:
        """The chained read-done once the guard read landed: ``(2, None)`` sent; ``(1, request)`` in
        flight, the request handed to the caller (who checks, frees and uncounts it like its own
        sends: ``request_status``); ``(-1, None)`` it failed to post and ``(0, None)`` none was
        sent: the caller sends it itself."""
        with self.worker.lock:
            chain = self.chain
            if chain is None:
                return 0, None
            state = int(chain.notice_state)
            if state == 1 and chain.notice_request != _ffi.NULL:
                request, chain.notice_request = chain.notice_request, _ffi.NULL
                _count("request", 1)
                return 1, request
            return (state if state in (2, -1) else 0), None

    def stop_chain(self) -> None:
        """Never post the guard read from here on (worker lock held by the caller or taken here)."""
        with self.worker.lock:
            if self.chain is not None:
                self.chain.stop = 1

    def cancel(self) -> int:
        """Ask UCX to cancel what is still in flight (the guard read too: it is never posted after
        this); returns how many were asked."""
        with self.worker.lock:
            if self.released:
                return 0
            if self.chain is not None:
                return int(_lib.kvx_chain_cancel(self.worker.handle, self.chain, self.requests, self.n))
            return int(_lib.kvx_cancel_pending(self.worker.handle, self.requests, self.n))

    def _free(self) -> int:
        """Free the requests (worker lock held); the guard's was posted from C, so it is counted here."""
        if self.chain is None:
            return int(_lib.kvx_free_requests(self.requests, self.n))
        if self.chain.request != _ffi.NULL:
            _count("request", 1)
        if self.chain.notice_request != _ffi.NULL:  # a read-done nobody took: UCX frees it when it completes
            _lib.ucp_request_free(self.chain.notice_request)
            self.chain.notice_request = _ffi.NULL
        if self._guard_endpoint is not None:
            self._guard_endpoint.guarding.discard(self)
        return int(_lib.kvx_chain_free(self.chain, self.requests, self.n))

    def abandon(self) -> None:
        """Free the requests of gets that will never complete (the worker is about to be destroyed).

        UCX frees a request released before completion when it completes; this object (its
        counter, which the completion callback writes) must outlive the worker.
        """
        with self.worker.lock:
            if self.released:
                return
            if self.chain is not None:
                self.chain.stop = 1
            freed = self._free()
            _count("request", -freed)
            self.released = True
            self.worker.inflight -= 1

    def release(self) -> None:
        with self.worker.lock:
            if self.released:
                return
            assert self.done, "release() before every get completed"
            freed = self._free()
            _count("request", -freed)
            self.released = True
            self.worker.inflight -= 1


def send_active_message(endpoint: Endpoint, am_id: int, payload: bytes) -> Optional[Any]:
    """Post a small AM (payload in the header, copied by UCX). Returns the request to wait on, or None."""
    return send_request(endpoint, am_id, payload)


def send_request(endpoint: Endpoint, am_id: int, payload: bytes, data: Optional[np.ndarray] = None,
                 reply: bool = False) -> Optional[Any]:
    """Post an AM: ``payload`` as its header (copied by UCX), ``data`` as an eager body (kept alive
    by the caller until the request completes) and, with ``reply``, the endpoint the receiver may
    answer on. Returns the request to wait on, or None."""
    ffi, lib = _ffi, _lib
    params = ffi.new("ucp_request_param_t *")
    params.op_attr_mask = lib.UCP_OP_ATTR_FIELD_FLAGS
    params.flags = lib.UCP_AM_SEND_FLAG_COPY_HEADER
    body, size = ffi.NULL, 0
    if data is not None:
        params.flags |= lib.UCP_AM_SEND_FLAG_EAGER
        body, size = ffi.cast("void *", data.ctypes.data), data.nbytes
    if reply:
        params.flags |= lib.UCP_AM_SEND_FLAG_REPLY
    with endpoint.worker.lock:
        if endpoint.handle is None:
            raise UcpError("ucp_am_send_nbx", int(lib.UCS_ERR_CANCELED))
        ptr = lib.ucp_am_send_nbx(endpoint.handle, am_id, payload, len(payload), body, size, params)
        status = lib.kvx_ptr_status(ptr)
        if status == lib.UCS_INPROGRESS:
            _count("request", 1)
            return ptr
    _check(status, "ucp_am_send_nbx")
    return None


def request_status(worker: Worker, request: Any) -> int:
    """Status of an in-flight request; frees it (and uncounts it) once complete."""
    lib = _lib
    with worker.lock:
        status = int(lib.ucp_request_check_status(request))
        if status != lib.UCS_INPROGRESS:
            lib.ucp_request_free(request)
            _count("request", -1)
        return status


def ucx_tls() -> str:
    """The transports UCX was told to use (``UCX_TLS``), or UCX's default."""
    return os.environ.get("UCX_TLS", "all (UCX default)")
