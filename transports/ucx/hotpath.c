/* The UCX transport's compiled helper: what Python's per-call cost or its GIL gets in the way of.
 *
 * - post_puts: every put of one transfer in one call (ucp_put_nbx with the source region's parameter
 *   block), instead of one ctypes call per put.
 * - progress: the I/O loop's progress of its workers, bounded in time (ucxx's own progress drains
 *   until nothing moves: one such call ran 5.6 s while a transfer's puts faulted in cold pages, and
 *   the loop sent no heartbeat meanwhile), with the GIL released only while there is work.
 * - a UCS log handler that needs no GIL: UCX's async thread may log while it holds a lock that a
 *   UCX call made with the GIL held waits for; a handler that took the GIL would deadlock there.
 *
 * libucp is not linked: bindings.py hands over the addresses of the few functions used (set_calls),
 * taken from the libucp that ucxx loaded. Only the thread holding the transport's loop (its I/O
 * thread, or a caller's turn) calls post_puts and progress, one at a time; the log handler runs
 * on any thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef void *(*put_nbx_fn)(void *ep, const void *buf, size_t n, uint64_t raddr, void *rkey, const void *param);
typedef void (*request_free_fn)(void *req);
typedef unsigned (*worker_progress_fn)(void *worker);
typedef int (*log_fn)(const char *file, unsigned line, const char *function, int level, const void *comp,
                      const char *fmt, va_list ap);
typedef void (*push_handler_fn)(log_fn);

static put_nbx_fn put_nbx;
static request_free_fn request_free;
static worker_progress_fn worker_progress;
static unsigned long cma_failures, cma_last_line;   /* read and reset by take_cma_failures */

#define PTR_ERR_MIN ((uintptr_t)-100)   /* UCS_PTR_IS_ERR: status pointers -100..-1 */
#define HOLD_GIL_BELOW (64 * 1024)      /* fewer bytes: posted with the GIL held (no thread switch) */

/* UCS log handler, called before UCX's default one (which abort()s on FATAL lines). cma logs a
 * failed process_vm_writev/readv to a dead pid as FATAL when the endpoint has no error handler; the
 * same call returns UCS_ERR_IO_ERROR when the line does not abort. Counted here, logged by Python. */
static int log_hook(const char *file, unsigned line, const char *function, int level, const void *comp,
                    const char *fmt, va_list ap)
{
    (void)function; (void)comp; (void)fmt; (void)ap;
    if (level == 0 && file) {   /* UCS_LOG_LEVEL_FATAL */
        const char *base = strrchr(file, '/');
        if (strcmp(base ? base + 1 : file, "cma_ep.c") == 0) {
            __atomic_store_n(&cma_last_line, (unsigned long)line, __ATOMIC_RELAXED);
            __atomic_add_fetch(&cma_failures, 1, __ATOMIC_RELAXED);
            return 0;   /* UCS_LOG_FUNC_RC_STOP */
        }
    }
    return 1;           /* UCS_LOG_FUNC_RC_CONTINUE */
}

static int address_of(PyObject *o, void **out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *out = (void *)(uintptr_t)v;
    return 1;
}

static PyObject *set_calls(PyObject *self, PyObject *args)
{
    PyObject *nbx, *rfree, *wprog, *push;
    void *b, *c, *e, *d;
    if (!PyArg_ParseTuple(args, "OOOO", &nbx, &rfree, &wprog, &push))
        return NULL;
    if (!address_of(nbx, &b) || !address_of(rfree, &c) || !address_of(wprog, &e) || !address_of(push, &d))
        return NULL;
    if (!b || !c || !e || !d) {
        PyErr_SetString(PyExc_ValueError, "set_calls: a function address is NULL");
        return NULL;
    }
    put_nbx = (put_nbx_fn)b;
    request_free = (request_free_fn)c;
    worker_progress = (worker_progress_fn)e;
    ((push_handler_fn)d)(log_hook);
    Py_RETURN_NONE;
}

static PyObject *take_cma_failures(PyObject *self, PyObject *unused)
{
    unsigned long n = __atomic_exchange_n(&cma_failures, 0, __ATOMIC_RELAXED);
    return Py_BuildValue("(kk)", n, __atomic_load_n(&cma_last_line, __ATOMIC_RELAXED));
}

/* A buffer of 8-byte items: ncols > 0 asks for rows of that many (C-contiguous). */
static int get_table(PyObject *o, Py_buffer *view, Py_ssize_t ncols, const char *what)
{
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS) < 0)
        return 0;
    if (view->len % (8 * ncols) != 0) {
        PyErr_Format(PyExc_ValueError, "post_puts: %s has %zd bytes, not rows of %zd 8-byte items", what,
                     view->len, ncols);
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* post_puts(ep, puts, rkeys, params) -> (posted, status)
 *   puts:   rows of 5 int64 (source address, destination address, bytes, source region, destination region)
 *   rkeys:  uint64 per destination region (the peer's unpacked rkeys)
 *   params: uint64 per source region: the address of its ucp_request_param_t (no callback)
 * Every region index and length is checked before anything is posted (ValueError: nothing posted).
 * Then the puts are posted in order until one fails: posted = how many were, status = 0 when all
 * were, else the failing UCS status (the puts before it are in flight: a flush covers them). */
static PyObject *post_puts(PyObject *self, PyObject *args)
{
    PyObject *ep_o, *puts_o, *rkeys_o, *params_o;
    void *ep;
    Py_buffer pv, kv, mv;
    if (!PyArg_ParseTuple(args, "OOOO", &ep_o, &puts_o, &rkeys_o, &params_o) || !address_of(ep_o, &ep))
        return NULL;
    if (!put_nbx) {
        PyErr_SetString(PyExc_RuntimeError, "post_puts: set_calls was not called");
        return NULL;
    }
    if (!get_table(puts_o, &pv, 5, "puts"))
        return NULL;
    if (!get_table(rkeys_o, &kv, 1, "rkeys")) {
        PyBuffer_Release(&pv);
        return NULL;
    }
    if (!get_table(params_o, &mv, 1, "params")) {
        PyBuffer_Release(&pv);
        PyBuffer_Release(&kv);
        return NULL;
    }
    const int64_t *p = pv.buf;
    const uint64_t *rkeys = kv.buf, *params = mv.buf;
    Py_ssize_t count = pv.len / 40, nkeys = kv.len / 8, nparams = mv.len / 8, k, done = 0;
    long long total = 0;
    int status = 0;
    PyThreadState *ts = NULL;
    for (k = 0; k < count; k++) {
        const int64_t *r = p + 5 * k;
        if (r[2] <= 0 || r[3] < 0 || r[3] >= nparams || !params[r[3]] || r[4] < 0 || r[4] >= nkeys
            || !rkeys[r[4]]) {
            PyErr_Format(PyExc_ValueError, "post_puts: put %zd has %lld bytes, source region %lld of %zd, "
                         "destination region %lld of %zd (or no parameter block, or no rkey)", k,
                         (long long)r[2], (long long)r[3], nparams, (long long)r[4], nkeys);
            goto out;
        }
        total += r[2];
    }
    if (total >= HOLD_GIL_BELOW)
        ts = PyEval_SaveThread();
    for (k = 0; k < count; k++) {
        const int64_t *r = p + 5 * k;
        /* no callback: NULL (done) or a request, whose completion the turn's flush covers */
        void *req = put_nbx(ep, (const void *)(uintptr_t)r[0], (size_t)r[2], (uint64_t)r[1],
                            (void *)(uintptr_t)rkeys[r[4]], (const void *)(uintptr_t)params[r[3]]);
        if ((uintptr_t)req >= PTR_ERR_MIN) {
            status = (int)(intptr_t)req;
            break;
        }
        if (req)
            request_free(req);
        done++;
    }
    if (ts)
        PyEval_RestoreThread(ts);
out:
    PyBuffer_Release(&pv);
    PyBuffer_Release(&kv);
    PyBuffer_Release(&mv);
    if (PyErr_Occurred())
        return NULL;
    return Py_BuildValue("(ni)", done, status);
}

static long long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

#define MAX_WORKERS 8

/* progress(workers, budget_ns, hold) -> events
 *   workers: a tuple of ucp_worker_h addresses (at most MAX_WORKERS)
 * Progresses every worker, round after round, until a round moves nothing or budget_ns passed,
 * and returns how many events moved. hold: take the first round with the GIL held (nothing in
 * flight: it moves a message or two, and a thread busy in Python would otherwise make the I/O
 * thread wait its switch interval to take the GIL back); the rest run without it. */
static PyObject *progress(PyObject *self, PyObject *args)
{
    PyObject *ws;
    long long budget;
    int hold;
    void *w[MAX_WORKERS];
    if (!PyArg_ParseTuple(args, "O!Lp", &PyTuple_Type, &ws, &budget, &hold))
        return NULL;
    if (!worker_progress) {
        PyErr_SetString(PyExc_RuntimeError, "progress: set_calls was not called");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(ws), i;
    if (n > MAX_WORKERS) {
        PyErr_Format(PyExc_ValueError, "progress: %zd workers, at most %d", n, MAX_WORKERS);
        return NULL;
    }
    for (i = 0; i < n; i++)
        if (!address_of(PyTuple_GET_ITEM(ws, i), &w[i]) || !w[i]) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "progress: worker %zd is NULL", i);
            return NULL;
        }
    unsigned long long events = 0, moved = 1;
    if (hold) {
        moved = 0;
        for (i = 0; i < n; i++)
            moved += worker_progress(w[i]);
        events = moved;
    }
    if (moved) {
        PyThreadState *ts = PyEval_SaveThread();
        long long end = now_ns() + budget;
        do {
            moved = 0;
            for (i = 0; i < n; i++)
                moved += worker_progress(w[i]);
            events += moved;
        } while (moved && now_ns() < end);
        PyEval_RestoreThread(ts);
    }
    return PyLong_FromUnsignedLongLong(events);
}

static PyMethodDef methods[] = {
    {"set_calls", set_calls, METH_VARARGS,
     "set_calls(put_nbx, request_free, worker_progress, ucs_log_push_handler): the libucp/libucs "
     "function addresses to call; installs the GIL-free log handler."},
    {"progress", progress, METH_VARARGS, "progress(workers, budget_ns, hold) -> events moved"},
    {"post_puts", post_puts, METH_VARARGS, "post_puts(ep, puts, rkeys, params) -> (posted, status)"},
    {"take_cma_failures", take_cma_failures, METH_NOARGS,
     "take_cma_failures() -> (count, last line): cma copy failures the log handler stopped since the last call"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hotpath", "The UCX transport's compiled helper.", -1,
                                    methods};

PyMODINIT_FUNC PyInit_hotpath(void) { return PyModule_Create(&module); }
