/* The UCX transport's compiled helper: what Python's per-call cost or its GIL gets in the way of.
 *
 * - post_puts: every put of one transfer in one call (ucp_put_nbx with the source region's parameter
 *   block), instead of one ctypes call per put.
 * - a UCS log handler that needs no GIL: UCX's async thread may log while it holds a lock that a
 *   UCX call made with the GIL held waits for; a handler that took the GIL would deadlock there.
 *
 * libucp is not linked: bindings.py hands over the addresses of the few functions used (set_calls),
 * taken from the libucp that ucxx loaded. Only the UCX transport's I/O thread calls post_puts (a
 * worker is not thread-safe); the log handler runs on any thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

typedef void *(*put_nbx_fn)(void *ep, const void *buf, size_t n, uint64_t raddr, void *rkey, const void *param);
typedef void (*request_free_fn)(void *req);
typedef int (*log_fn)(const char *file, unsigned line, const char *function, int level, const void *comp,
                      const char *fmt, va_list ap);
typedef void (*push_handler_fn)(log_fn);

static put_nbx_fn put_nbx;
static request_free_fn request_free;
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
    PyObject *nbx, *rfree, *push;
    void *b, *c, *d;
    if (!PyArg_ParseTuple(args, "OOO", &nbx, &rfree, &push))
        return NULL;
    if (!address_of(nbx, &b) || !address_of(rfree, &c) || !address_of(push, &d))
        return NULL;
    if (!b || !c || !d) {
        PyErr_SetString(PyExc_ValueError, "set_calls: a function address is NULL");
        return NULL;
    }
    put_nbx = (put_nbx_fn)b;
    request_free = (request_free_fn)c;
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

static PyMethodDef methods[] = {
    {"set_calls", set_calls, METH_VARARGS,
     "set_calls(put_nbx, request_free, ucs_log_push_handler): the libucp/libucs function "
     "addresses to call; installs the GIL-free log handler."},
    {"post_puts", post_puts, METH_VARARGS, "post_puts(ep, puts, rkeys, params) -> (posted, status)"},
    {"take_cma_failures", take_cma_failures, METH_NOARGS,
     "take_cma_failures() -> (count, last line): cma copy failures the log handler stopped since the last call"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hotpath", "The UCX transport's compiled helper.", -1,
                                    methods};

PyMODINIT_FUNC PyInit_hotpath(void) { return PyModule_Create(&module); }
