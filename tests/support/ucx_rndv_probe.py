"""Run by ``tests/backends/test_ucx_backend.py``: a peer sends this process's ucx workers active messages too
large for eager (UCX delivers them by rendezvous). kvxfer takes no such message: its handler must
return without releasing the descriptor (UCX drops it, ucp_def.h); releasing it as well left UCX's
AM buffer pool inconsistent ("was not returned to mpool ucp_am_bufs" at close, one per message).
Prints each send's status, then PROBE-OK once a pull still works and both backends closed."""
import sys
import time

import numpy as np
import torch

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.backends.ucx import binding as _ucp
from kvxfer.backends.ucx.notices import AM_ID
cls = construct_kv_transfer_backend_class("ucx")
a = cls("probe-a", torch.zeros(4, 16, 1024, dtype=torch.uint8), 4)
b = cls("probe-b", torch.zeros(4, 16, 1024, dtype=torch.uint8), 4)
ffi, lib = _ucp.load()
wa, wb = a._worker, b._worker
errors = []
ep = _ucp.Endpoint(wb, wa.address, lambda e, s: errors.append(s), peer_error_handling=False)
big = np.full(8 << 20, 7, dtype=np.uint8)
hdr = b"x" * 16
for i in range(int(sys.argv[1])):
    params = ffi.new("ucp_request_param_t *")
    params.op_attr_mask = lib.UCP_OP_ATTR_FIELD_FLAGS
    params.flags = lib.UCP_AM_SEND_FLAG_COPY_HEADER
    with wb.lock:
        ptr = lib.ucp_am_send_nbx(ep.handle, AM_ID, hdr, len(hdr), ffi.cast("void *", big.ctypes.data), big.nbytes, params)
    st = lib.kvx_ptr_status(ptr)
    deadline = time.monotonic() + 10
    while st == lib.UCS_INPROGRESS and time.monotonic() < deadline:
        wa.progress(); wb.progress()
        with wb.lock:
            st = lib.ucp_request_check_status(ptr)
    if ptr != ffi.NULL and lib.kvx_ptr_status(ptr) == lib.UCS_INPROGRESS:
        with wb.lock:
            lib.ucp_request_free(ptr)
    print("send", i, _ucp.status_string(st), flush=True)
# still serving: a pull from a by b
meta = a.export_meta()
b.begin_pull_blocks(meta, [0, 1], [2, 3]).wait(timeout_s=10)
print("pull ok; notices queued:", len(a._notices), flush=True)
ep.close() if hasattr(ep, "close") else None
a.close(); b.close()
print("PROBE-OK")
