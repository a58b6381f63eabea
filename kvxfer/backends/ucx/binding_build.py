"""cffi builder for ``kvxfer.backends.ucx._ucp_cffi``: a thin, API-mode binding to UCX's UCP.

Why API mode: the struct layouts (``ucp_params_t``, ``ucp_request_param_t``, ...)
change between UCX releases. Declaring only the fields we touch, with ``...;``,
lets the C compiler read the real header and fill in offsets and sizes, so the
binding cannot silently disagree with ``libucp``.

Headers and libraries come from the ``libucx`` Python package (the
``libucx-cu12`` wheel), located at build time. At run time the wrapper calls
``libucx.load_library()`` first (the wheel's supported way to put ``libucp.so.0``
in the loader's cache). No rpath is set: under pip's build isolation the
build-time folder is a temporary directory that is gone after the install.

The few C helpers below exist for speed and safety, not convenience: posting a
whole copy plan's gets in one C loop keeps Python work per request constant, and
completion is counted by a C callback so no Python runs per completed get.

Built by ``setup.py`` (``cffi_modules``) during ``pip install``, or in place with
``python -m kvxfer.backends.ucx.binding_build``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cffi import FFI

MODULE_NAME = "kvxfer.backends.ucx._ucp_cffi"

#: The helper structs, written once: cffi's declarations (``CDEF``) and the C source must agree field
#: for field, so both take them from here.
KVX_COUNTER_T = "typedef struct { int64_t pending; int status; } kvx_counter_t;"
KVX_CHAIN_T = """typedef struct {
    kvx_counter_t data; int64_t guard_pending; int guard_status; int guard_state; int stop;
    ucp_ep_h ep; ucp_rkey_h rkey; uint64_t local; uint64_t remote; uint64_t length; void *request;
    unsigned am_id; const void *notice; uint64_t notice_length; int notice_state; int notice_status;
    void *notice_request;
} kvx_chain_t;"""

#: Served reads (``served.py``): what the source has in flight, counted in C by the send completions. A pool
#: per serving worker, a reader per reply endpoint, a serve per accepted READ.
KVX_SERVE_T = """typedef struct {
    int64_t requests; int64_t bytes; int64_t peak; int64_t chunks_sent; int64_t bytes_posted; int64_t failed;
    int64_t refusals; int64_t abandoned; int closing;
} kvx_serve_pool_t;
typedef struct {
    kvx_serve_pool_t *pool; int64_t requests; int64_t reads; int64_t bytes; int64_t refusals; int64_t completions;
} kvx_serve_reader_t;
typedef struct {
    kvx_serve_reader_t *reader; int64_t pending; int64_t bytes; int status; int counted; int finished; int abandoned;
} kvx_serve_t;"""

CDEF = r"""
typedef int... ucs_status_t;
typedef int... ucs_memory_type_t;
typedef int... ucs_thread_mode_t;
typedef int... ucp_err_handling_mode_t;
typedef void *ucs_status_ptr_t;

typedef struct ucp_context *ucp_context_h;
typedef struct ucp_worker *ucp_worker_h;
typedef struct ucp_ep *ucp_ep_h;
typedef struct ucp_mem *ucp_mem_h;
typedef struct ucp_rkey *ucp_rkey_h;
typedef struct ucp_config ucp_config_t;
typedef struct ucp_address ucp_address_t;

typedef void (*ucp_send_nbx_callback_t)(void *request, ucs_status_t status, void *user_data);
typedef void (*ucp_err_handler_cb_t)(void *arg, ucp_ep_h ep, ucs_status_t status);

typedef struct {
    uint64_t recv_attr;
    ucp_ep_h reply_ep;
    ...;
} ucp_am_recv_param_t;

typedef ucs_status_t (*ucp_am_recv_callback_t)(void *arg, const void *header, size_t header_length,
                                               void *data, size_t length, const ucp_am_recv_param_t *param);

typedef struct { uint64_t field_mask; uint64_t features; ...; } ucp_params_t;
typedef struct { uint64_t field_mask; ucs_thread_mode_t thread_mode; ...; } ucp_worker_params_t;
typedef struct ucp_err_handler { ucp_err_handler_cb_t cb; void *arg; } ucp_err_handler_t;
typedef struct {
    uint64_t field_mask;
    const ucp_address_t *address;
    ucp_err_handling_mode_t err_mode;
    ucp_err_handler_t err_handler;
    ...;
} ucp_ep_params_t;
typedef struct {
    uint64_t field_mask;
    void *address;
    size_t length;
    ucs_memory_type_t memory_type;
    ...;
} ucp_mem_map_params_t;
typedef struct {
    uint32_t op_attr_mask;
    uint32_t flags;
    void *user_data;
    ucs_memory_type_t memory_type;
    ...;
} ucp_request_param_t;
typedef struct {
    uint64_t field_mask;
    unsigned id;
    uint32_t flags;
    ucp_am_recv_callback_t cb;
    void *arg;
    ...;
} ucp_am_handler_param_t;
typedef struct { const char *transport_name; const char *device_name; ...; } ucp_transport_entry_t;
typedef struct { ucp_transport_entry_t *entries; unsigned num_entries; size_t entry_size; ...; } ucp_transports_t;
typedef struct { uint64_t field_mask; ucp_transports_t transports; ...; } ucp_ep_attr_t;

#define UCS_OK ...
#define UCS_INPROGRESS ...
#define UCS_ERR_BUSY ...
#define UCS_ERR_CANCELED ...
#define UCS_ERR_TIMED_OUT ...
#define UCS_ERR_INVALID_PARAM ...
#define UCS_ERR_REJECTED ...
#define UCS_MEMORY_TYPE_HOST ...
#define UCS_MEMORY_TYPE_CUDA ...
#define UCS_THREAD_MODE_SERIALIZED ...
#define UCP_PARAM_FIELD_FEATURES ...
#define UCP_FEATURE_RMA ...
#define UCP_FEATURE_AM ...
#define UCP_FEATURE_WAKEUP ...
#define UCP_WORKER_PARAM_FIELD_THREAD_MODE ...
#define UCP_EP_PARAM_FIELD_REMOTE_ADDRESS ...
#define UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE ...
#define UCP_EP_PARAM_FIELD_ERR_HANDLER ...
#define UCP_ERR_HANDLING_MODE_PEER ...
#define UCP_MEM_MAP_PARAM_FIELD_ADDRESS ...
#define UCP_MEM_MAP_PARAM_FIELD_LENGTH ...
#define UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE ...
#define UCP_OP_ATTR_FIELD_FLAGS ...
#define UCP_OP_ATTR_FIELD_CALLBACK ...
#define UCP_OP_ATTR_FIELD_USER_DATA ...
#define UCP_OP_ATTR_FIELD_MEMORY_TYPE ...
#define UCP_EP_CLOSE_FLAG_FORCE ...
#define UCP_AM_HANDLER_PARAM_FIELD_ID ...
#define UCP_AM_HANDLER_PARAM_FIELD_FLAGS ...
#define UCP_AM_HANDLER_PARAM_FIELD_CB ...
#define UCP_AM_HANDLER_PARAM_FIELD_ARG ...
#define UCP_AM_SEND_FLAG_COPY_HEADER ...
#define UCP_AM_SEND_FLAG_REPLY ...
#define UCP_AM_SEND_FLAG_EAGER ...
#define UCP_AM_RECV_ATTR_FIELD_REPLY_EP ...
#define UCP_AM_RECV_ATTR_FLAG_RNDV ...
#define UCP_EP_ATTR_FIELD_TRANSPORTS ...

const char *ucs_status_string(ucs_status_t status);
const char *ucp_get_version_string(void);
ucs_status_t ucp_config_read(const char *env_prefix, const char *filename, ucp_config_t **config_p);
void ucp_config_release(ucp_config_t *config);
ucs_status_t ucp_init(const ucp_params_t *params, const ucp_config_t *config, ucp_context_h *context_p);
void ucp_cleanup(ucp_context_h context_p);

ucs_status_t ucp_worker_create(ucp_context_h context, const ucp_worker_params_t *params, ucp_worker_h *worker_p);
void ucp_worker_destroy(ucp_worker_h worker);
ucs_status_t ucp_worker_get_address(ucp_worker_h worker, ucp_address_t **address_p, size_t *address_length_p);
void ucp_worker_release_address(ucp_worker_h worker, ucp_address_t *address);
unsigned ucp_worker_progress(ucp_worker_h worker);
ucs_status_t ucp_worker_get_efd(ucp_worker_h worker, int *fd);
ucs_status_t ucp_worker_arm(ucp_worker_h worker);
ucs_status_t ucp_worker_signal(ucp_worker_h worker);
ucs_status_t ucp_worker_set_am_recv_handler(ucp_worker_h worker, const ucp_am_handler_param_t *param);

ucs_status_t ucp_ep_create(ucp_worker_h worker, const ucp_ep_params_t *params, ucp_ep_h *ep_p);
ucs_status_ptr_t ucp_ep_close_nbx(ucp_ep_h ep, const ucp_request_param_t *param);
ucs_status_t ucp_ep_query(ucp_ep_h ep, ucp_ep_attr_t *attr);

ucs_status_t ucp_mem_map(ucp_context_h context, const ucp_mem_map_params_t *params, ucp_mem_h *memh_p);
ucs_status_t ucp_mem_unmap(ucp_context_h context, ucp_mem_h memh);
ucs_status_t ucp_rkey_pack(ucp_context_h context, ucp_mem_h memh, void **rkey_buffer_p, size_t *size_p);
void ucp_rkey_buffer_release(void *rkey_buffer);
ucs_status_t ucp_ep_rkey_unpack(ucp_ep_h ep, const void *rkey_buffer, ucp_rkey_h *rkey_p);
void ucp_rkey_destroy(ucp_rkey_h rkey);

ucs_status_ptr_t ucp_am_send_nbx(ucp_ep_h ep, unsigned id, const void *header, size_t header_length,
                                 const void *buffer, size_t count, const ucp_request_param_t *param);
void ucp_am_data_release(ucp_worker_h worker, void *data);
ucs_status_t ucp_request_check_status(void *request);
void ucp_request_cancel(ucp_worker_h worker, void *request);
void ucp_request_free(void *request);

/* kvxfer helpers (defined in the source below) */
@KVX_COUNTER_T@
int kvx_ptr_status(void *ptr);
void kvx_counter_cb(void *request, ucs_status_t status, void *user_data);
int kvx_get_batch(ucp_ep_h ep, ucp_rkey_h rkey, uint64_t local_base, uint64_t remote_base,
                  const int64_t *src_off, const int64_t *dst_off, const int64_t *lengths, size_t n,
                  int cuda, kvx_counter_t *counter, void **requests, size_t *posted);
size_t kvx_cancel_pending(ucp_worker_h worker, void **requests, size_t n);
size_t kvx_free_requests(void **requests, size_t n);
@KVX_CHAIN_T@
int kvx_get_chain(ucp_ep_h ep, ucp_rkey_h rkey, uint64_t local_base, uint64_t remote_base,
                  const int64_t *src_off, const int64_t *dst_off, const int64_t *lengths, size_t n,
                  int cuda, kvx_chain_t *chain, void **requests, size_t *posted);
size_t kvx_chain_cancel(ucp_worker_h worker, kvx_chain_t *chain, void **requests, size_t n);
int kvx_batch_done(kvx_counter_t *counter, kvx_chain_t *chain);
unsigned kvx_progress_all(ucp_worker_h worker, unsigned max_rounds);
size_t kvx_chain_free(kvx_chain_t *chain, void **requests, size_t n);
@KVX_SERVE_T@
int kvx_serve_rows(kvx_serve_t *serve, ucp_ep_h ep, unsigned am_id, uint64_t batch, uint64_t first,
                   uint64_t base, const uint64_t *rows, size_t n, size_t chunk);
void kvx_serve_abandon(kvx_serve_t *serve);
int kvx_serve_refuse(ucp_ep_h ep, unsigned am_id, const void *header, size_t header_length,
                     kvx_serve_reader_t *reader, int64_t max_reader, int64_t max_total);

extern "Python" ucs_status_t kvx_am_recv_py(void *arg, const void *header, size_t header_length,
                                            void *data, size_t length, const ucp_am_recv_param_t *param);
extern "Python" void kvx_ep_error_py(void *arg, ucp_ep_h ep, ucs_status_t status);
"""

SOURCE = r"""
#include <ucp/api/ucp.h>

@KVX_COUNTER_T@

/* UCS_PTR_STATUS is a macro: NULL -> UCS_OK, error pointer -> its status, request -> UCS_INPROGRESS. */
static int kvx_ptr_status(void *ptr) { return (int)UCS_PTR_STATUS(ptr); }

/* Completion of one request of a batch: count it down and keep the first error. */
static void kvx_counter_cb(void *request, ucs_status_t status, void *user_data)
{
    kvx_counter_t *counter = (kvx_counter_t *)user_data;
    (void)request;
    if (status != UCS_OK && counter->status == UCS_OK) {
        counter->status = status;
    }
    /* last, with release order: a thread that sees pending reach 0 (kvx_batch_done's acquire load)
     * also sees the status stored above */
    __atomic_sub_fetch(&counter->pending, 1, __ATOMIC_RELEASE);
}

/* Post one get per row, each completing through cb(user_data). Requests still in flight land in
 * requests[i] (NULL when the get completed at once); *posted says how many rows were posted. The
 * counter's pending is raised for every in-flight request before it can complete (completion only
 * happens inside ucp_worker_progress). Stops at the first row that fails to post: its status. */
static int kvx_post_gets(ucp_ep_h ep, ucp_rkey_h rkey, uint64_t local_base, uint64_t remote_base,
                         const int64_t *src_off, const int64_t *dst_off, const int64_t *lengths, size_t n,
                         int cuda, ucp_send_nbx_callback_t cb, void *user_data, kvx_counter_t *counter,
                         void **requests, size_t *posted)
{
    ucp_request_param_t param;
    size_t i;
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = cb;
    param.user_data = user_data;
    if (cuda) {
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        param.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    *posted = 0;
    for (i = 0; i < n; ++i) {
        ucs_status_ptr_t ptr = ucp_get_nbx(ep, (void *)(uintptr_t)(local_base + (uint64_t)dst_off[i]),
                                           (size_t)lengths[i], remote_base + (uint64_t)src_off[i], rkey, &param);
        requests[i] = NULL;
        if (UCS_PTR_IS_ERR(ptr)) {
            return (int)UCS_PTR_STATUS(ptr);
        }
        *posted = i + 1;
        if (ptr != NULL) {
            requests[i] = ptr;
            counter->pending++;
        }
    }
    return (int)UCS_OK;
}

/* A batch of gets counted down on one counter, which keeps the first error (a row that failed to
 * post included: stored before any completion can run, so a reader that sees it done sees it). */
static int kvx_get_batch(ucp_ep_h ep, ucp_rkey_h rkey, uint64_t local_base, uint64_t remote_base,
                         const int64_t *src_off, const int64_t *dst_off, const int64_t *lengths, size_t n,
                         int cuda, kvx_counter_t *counter, void **requests, size_t *posted)
{
    int status = kvx_post_gets(ep, rkey, local_base, remote_base, src_off, dst_off, lengths, n, cuda,
                               kvx_counter_cb, counter, counter, requests, posted);
    if (status != (int)UCS_OK && counter->status == UCS_OK) {
        counter->status = status;
    }
    return status;
}

/* Ask UCX to cancel every request of a batch that is still in flight. */
static size_t kvx_cancel_pending(ucp_worker_h worker, void **requests, size_t n)
{
    size_t i, cancelled = 0;
    for (i = 0; i < n; ++i) {
        if (requests[i] != NULL && ucp_request_check_status(requests[i]) == UCS_INPROGRESS) {
            ucp_request_cancel(worker, requests[i]);
            ++cancelled;
        }
    }
    return cancelled;
}

/* A served read's reply header: which batch, which row, where in the row the data goes. */
typedef struct { uint64_t batch; uint64_t row; uint64_t offset; } kvx_served_hdr_t;

@KVX_SERVE_T@

/* A served read (served.py): one READ the source accepted, its rows (offset and length pairs relative to
 * base, row indices from first) sent back on the reply endpoint ep as eager active messages of at most chunk
 * bytes, each headed by (batch, row, offset). Eager, so that the reader copies the data in its handler and
 * never reads from us (no rendezvous: over tcp that would be UCX's software GET again); through UCX's
 * protocol layer, which completes a failed send with an error (the reader gone), never an abort.
 *
 * Every chunk of a READ is posted here, in the READ's handler: sends posted to a reply endpoint later, from
 * a send's completion or after the handler, stalled for good over tcp (measured: UCX 1.22, posted and never
 * written, the socket empty), so the flow control is the READ itself: the source bounds what one READ asks
 * and what one reader and all have in flight (served.py, from these counts), and a reader asks for its next
 * READs as earlier ones land. Counted here: the requests and bytes in flight per reader and in all (a READ's
 * bytes until its last send completed), and completions, by which served.py sees a reader that stopped. */
static void kvx_serve_uncount(kvx_serve_t *serve)
{
    kvx_serve_reader_t *reader = serve->reader;
    if (serve->counted) {
        serve->counted = 0;
        reader->reads -= 1;
        reader->bytes -= serve->bytes;
        reader->pool->bytes -= serve->bytes;
    }
}

static void kvx_serve_cb(void *request, ucs_status_t status, void *user_data)
{
    kvx_serve_t *serve = (kvx_serve_t *)user_data;
    kvx_serve_reader_t *reader = serve->reader;
    (void)request;
    serve->pending -= 1;
    if (serve->abandoned) {  /* counted apart (kvx_serve_abandon): only that count goes down */
        reader->pool->abandoned -= 1;
    } else {
        reader->requests -= 1;
        reader->completions += 1;
        reader->pool->requests -= 1;
        if (status == UCS_OK) {
            reader->pool->chunks_sent += 1;
        } else {
            reader->pool->failed += 1;
            if (serve->status == (int)UCS_OK) {
                serve->status = (int)status;
            }
        }
    }
    if (serve->pending == 0) {
        kvx_serve_uncount(serve);
        serve->finished = 1;
    }
}

/* Post every chunk of an accepted READ (from its handler: ep valid). The caller set serve->reader and
 * serve->bytes (the READ's total); the rest starts at zero. Stops at the first send that fails to post.
 * Returns whether the serve is finished already (nothing in flight). */
static int kvx_serve_rows(kvx_serve_t *serve, ucp_ep_h ep, unsigned am_id, uint64_t batch, uint64_t first,
                          uint64_t base, const uint64_t *rows, size_t n, size_t chunk)
{
    kvx_serve_reader_t *reader = serve->reader;
    kvx_serve_pool_t *pool = reader->pool;
    ucp_request_param_t param;
    kvx_served_hdr_t hdr;
    size_t i;
    uint64_t done, len;
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.flags = UCP_AM_SEND_FLAG_COPY_HEADER | UCP_AM_SEND_FLAG_EAGER;
    param.cb.send = kvx_serve_cb;
    param.user_data = serve;
    hdr.batch = batch;
    serve->counted = 1;
    reader->reads += 1;
    reader->bytes += serve->bytes;
    pool->bytes += serve->bytes;
    for (i = 0; i < n && serve->status == (int)UCS_OK; ++i) {
        hdr.row = first + i;
        for (done = 0; done < rows[2 * i + 1]; done += len) {
            ucs_status_ptr_t ptr;
            len = rows[2 * i + 1] - done;
            if (len > chunk) {
                len = chunk;
            }
            hdr.offset = done;
            ptr = ucp_am_send_nbx(ep, am_id, &hdr, sizeof(hdr), (void *)(uintptr_t)(base + rows[2 * i] + done),
                                  len, &param);
            if (UCS_PTR_IS_ERR(ptr)) {
                pool->failed += 1;
                serve->status = (int)UCS_PTR_STATUS(ptr);
                break;
            }
            pool->bytes_posted += (int64_t)len;
            if (ptr == NULL) {
                pool->chunks_sent += 1;  /* sent at once: nothing in flight */
                continue;
            }
            ucp_request_free(ptr);  /* UCX frees it once complete; the callback still runs */
            serve->pending += 1;
            reader->requests += 1;
            pool->requests += 1;
            if (pool->requests > pool->peak) {
                pool->peak = pool->requests;
            }
        }
    }
    if (serve->pending == 0) {
        kvx_serve_uncount(serve);
        serve->finished = 1;
    }
    return serve->finished;
}

/* Give up on a serve whose reader takes nothing (served.SERVE_STALL_S): its sends still in flight stop
 * counting against its reader and the pool; they are counted apart (pool->abandoned) until UCX completes
 * them, which for a reader that is gone may be never. */
static void kvx_serve_abandon(kvx_serve_t *serve)
{
    kvx_serve_reader_t *reader = serve->reader;
    if (serve->finished || serve->abandoned) {
        return;
    }
    reader->requests -= serve->pending;
    reader->pool->requests -= serve->pending;
    reader->pool->abandoned += serve->pending;
    kvx_serve_uncount(serve);
    serve->abandoned = 1;
}

static void kvx_refusal_cb(void *request, ucs_status_t status, void *user_data)
{
    kvx_serve_reader_t *reader = (kvx_serve_reader_t *)user_data;
    (void)request;
    (void)status;
    reader->refusals -= 1;
    reader->pool->refusals -= 1;
}

/* A refusal (header only, copied) on a READ's reply endpoint, from its handler. At most max_reader of
 * them in flight to one reader and max_total in all: a reader that floods the source with READs it
 * does not drain the answers of gets no more. Returns 1 if posted, 0 if dropped or it failed. */
static int kvx_serve_refuse(ucp_ep_h ep, unsigned am_id, const void *header, size_t header_length,
                            kvx_serve_reader_t *reader, int64_t max_reader, int64_t max_total)
{
    ucp_request_param_t param;
    ucs_status_ptr_t ptr;
    if (reader->refusals >= max_reader || reader->pool->refusals >= max_total) {
        return 0;
    }
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.flags = UCP_AM_SEND_FLAG_COPY_HEADER;
    param.cb.send = kvx_refusal_cb;
    param.user_data = reader;
    ptr = ucp_am_send_nbx(ep, am_id, header, header_length, NULL, 0, &param);
    if (UCS_PTR_IS_ERR(ptr)) {
        return 0;
    }
    if (ptr != NULL) {
        ucp_request_free(ptr);
        reader->refusals += 1;
        reader->pool->refusals += 1;
    }
    return 1;
}

/* A guard read chained behind a batch of gets (issue 27: the lease read strictly after the data
 * read, posted by the transport the moment the data read completed, not by a later Python poll).
 * guard_state: 0 waiting for the batch, 1 posted, 2 completed, -1 never posted (a get of the batch
 * failed, or the chain was stopped: the guard must not be read then). guard_pending is 1 until the
 * guard is over (completed, or known never to be posted), so the whole chain is over when
 * data.pending == 0 and guard_pending == 0. Callbacks run inside ucp_worker_progress (the worker
 * lock held by the caller), which is where the guard get is posted from. */
@KVX_CHAIN_T@

static size_t kvx_free_requests(void **requests, size_t n);

/* The read-done, sent once the guard read landed (notice_length 0: the caller sends it). Header only,
 * copied by UCX. notice_state: 0 not sent, 2 sent, 1 in flight (notice_request: the caller adopts it
 * and tracks it as it tracks its own notices), -1 failed to post (notice_status: the caller sends it). */
static void kvx_chain_notify(kvx_chain_t *chain)
{
    ucp_request_param_t param;
    ucs_status_ptr_t ptr;
    if (chain->notice_length == 0 || chain->notice_state != 0 || chain->stop) {
        return;
    }
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_COPY_HEADER;
    ptr = ucp_am_send_nbx(chain->ep, chain->am_id, chain->notice, (size_t)chain->notice_length, NULL, 0, &param);
    if (UCS_PTR_IS_ERR(ptr)) {
        chain->notice_status = UCS_PTR_STATUS(ptr);
        chain->notice_state = -1;
    } else if (ptr == NULL) {
        chain->notice_status = UCS_OK;
        chain->notice_state = 2;
    } else {
        chain->notice_request = ptr;
        chain->notice_state = 1;
    }
}

static void kvx_chain_guard_cb(void *request, ucs_status_t status, void *user_data)
{
    kvx_chain_t *chain = (kvx_chain_t *)user_data;
    (void)request;
    chain->guard_status = status;
    chain->guard_state = 2;
    if (status == UCS_OK) {
        kvx_chain_notify(chain);
    }
    __atomic_store_n(&chain->guard_pending, 0, __ATOMIC_RELEASE);
}

/* Post the guard get once every get of the batch completed, and only if all succeeded and the
 * chain was not stopped. Host memory on the local side (no memory type): the scratch slot. */
static void kvx_chain_post_guard(kvx_chain_t *chain)
{
    ucp_request_param_t param;
    ucs_status_ptr_t ptr;
    if (chain->guard_state != 0) {
        return;
    }
    if (chain->data.status != UCS_OK || chain->stop) {
        chain->guard_status = chain->data.status != UCS_OK ? chain->data.status : UCS_ERR_CANCELED;
        chain->guard_state = -1;
        __atomic_store_n(&chain->guard_pending, 0, __ATOMIC_RELEASE);
        return;
    }
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = kvx_chain_guard_cb;
    param.user_data = chain;
    ptr = ucp_get_nbx(chain->ep, (void *)(uintptr_t)chain->local, (size_t)chain->length, chain->remote,
                      chain->rkey, &param);
    if (UCS_PTR_IS_ERR(ptr)) {
        chain->guard_status = UCS_PTR_STATUS(ptr);
        chain->guard_state = -1;
        __atomic_store_n(&chain->guard_pending, 0, __ATOMIC_RELEASE);
    } else if (ptr == NULL) {
        chain->guard_status = UCS_OK;
        chain->guard_state = 2;
        kvx_chain_notify(chain);
        __atomic_store_n(&chain->guard_pending, 0, __ATOMIC_RELEASE);
    } else {
        chain->request = ptr;
        chain->guard_state = 1;
    }
}

static void kvx_chain_data_cb(void *request, ucs_status_t status, void *user_data)
{
    kvx_chain_t *chain = (kvx_chain_t *)user_data;
    kvx_counter_cb(request, status, &chain->data);
    if (chain->data.pending == 0) {
        kvx_chain_post_guard(chain);
    }
}

/* kvx_get_batch with a guard read chained behind it (chain->ep, rkey, local, remote, length set by
 * the caller; guard_pending 1, guard_state 0). A row that fails to post stops the chain: the gets
 * already posted still complete, and the guard is never read. */
static int kvx_get_chain(ucp_ep_h ep, ucp_rkey_h rkey, uint64_t local_base, uint64_t remote_base,
                         const int64_t *src_off, const int64_t *dst_off, const int64_t *lengths, size_t n,
                         int cuda, kvx_chain_t *chain, void **requests, size_t *posted)
{
    int status = kvx_post_gets(ep, rkey, local_base, remote_base, src_off, dst_off, lengths, n, cuda,
                               kvx_chain_data_cb, chain, &chain->data, requests, posted);
    if (status != (int)UCS_OK && chain->data.status == UCS_OK) {
        chain->data.status = status;
    }
    if (chain->data.pending == 0) {
        kvx_chain_post_guard(chain);  /* every get completed at once (or none was posted) */
    }
    return status;
}

/* Stop a chain: its guard is not posted any more, and every request still in flight (the batch's
 * and the guard's) is asked to cancel. Returns how many were asked. */
static size_t kvx_chain_cancel(ucp_worker_h worker, kvx_chain_t *chain, void **requests, size_t n)
{
    size_t cancelled;
    chain->stop = 1;
    cancelled = kvx_cancel_pending(worker, requests, n);
    if (chain->request != NULL && ucp_request_check_status(chain->request) == UCS_INPROGRESS) {
        ucp_request_cancel(worker, chain->request);
        ++cancelled;
    }
    return cancelled;
}

/* Free a chain's requests (the batch's and the guard's); returns how many were freed. */
static size_t kvx_chain_free(kvx_chain_t *chain, void **requests, size_t n)
{
    size_t freed = kvx_free_requests(requests, n);
    if (chain->request != NULL) {
        ucp_request_free(chain->request);
        chain->request = NULL;
        ++freed;
    }
    return freed;
}

/* Whether a batch (and its chained guard, if any) is over, read with acquire order: once it says so,
 * the statuses (and the guard's notice fields) written before are the ones this thread reads. */
static int kvx_batch_done(kvx_counter_t *counter, kvx_chain_t *chain)
{
    if (__atomic_load_n(&counter->pending, __ATOMIC_ACQUIRE) != 0) {
        return 0;
    }
    return chain == NULL || __atomic_load_n(&chain->guard_pending, __ATOMIC_ACQUIRE) == 0;
}

/* ucp_worker_progress until it reports nothing more to do, at most max_rounds times (a peer flooding
 * the worker cannot hold the caller), in one call from Python instead of one per round. */
static unsigned kvx_progress_all(ucp_worker_h worker, unsigned max_rounds)
{
    unsigned rounds = 0;
    while (rounds < max_rounds && ucp_worker_progress(worker) != 0) {
        ++rounds;
    }
    return rounds;
}

/* Free a completed batch's requests; returns how many were freed. */
static size_t kvx_free_requests(void **requests, size_t n)
{
    size_t i, freed = 0;
    for (i = 0; i < n; ++i) {
        if (requests[i] != NULL) {
            ucp_request_free(requests[i]);
            requests[i] = NULL;
            ++freed;
        }
    }
    return freed;
}
"""


CDEF, SOURCE = (text.replace("@KVX_COUNTER_T@", KVX_COUNTER_T).replace("@KVX_CHAIN_T@", KVX_CHAIN_T)
                .replace("@KVX_SERVE_T@", KVX_SERVE_T) for text in (CDEF, SOURCE))


def libucx_prefix() -> Path:
    """The installed ``libucx`` package folder (headers in include/, libraries in lib/)."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the 'libucx' package (pip install 'libucx-cu12>=1.21,<1.23') is needed to build the UCX binding")
    prefix = Path(list(spec.submodule_search_locations)[0])
    if not (prefix / "include" / "ucp" / "api" / "ucp.h").is_file():
        raise RuntimeError(f"{prefix} has no include/ucp/api/ucp.h; reinstall libucx-cu12")
    return prefix


def make_ffi() -> FFI:
    prefix = libucx_prefix()
    libdir = str(prefix / "lib")
    ffibuilder = FFI()
    ffibuilder.cdef(CDEF)
    ffibuilder.set_source(
        MODULE_NAME,
        SOURCE,
        include_dirs=[str(prefix / "include")],
        library_dirs=[libdir],
        libraries=["ucp", "ucs"],
        extra_compile_args=["-O2", "-Wno-sign-compare"],
        py_limited_api=True,  # what setuptools builds too (``_ucp_cffi.abi3.so``): one file name either way
    )
    return ffibuilder


ffibuilder = make_ffi()  # what setup.py's ``cffi_modules`` picks up

if __name__ == "__main__":
    # In-place build for development: compiles under build/cffi and copies the
    # extension next to this file (as an editable install would).
    import shutil

    root = Path(__file__).resolve().parents[3]
    here = Path(__file__).resolve().parent
    built = Path(ffibuilder.compile(tmpdir=str(root / "build" / "cffi"), verbose=False))
    for other in here.glob("_ucp_cffi.*"):  # a build under another name would shadow or be shadowed by this one
        if other.name != built.name and other.suffix in (".so", ".pyd"):
            other.unlink()
    target = here / built.name
    shutil.copy2(built, target.with_name(target.name + ".tmp"))
    target.with_name(target.name + ".tmp").replace(target)  # atomic: a process loading it meanwhile sees one whole file
    print(target)
