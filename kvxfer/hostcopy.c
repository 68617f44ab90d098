/* kvxfer's compiled helper for host memory: the runs of a plan copied in one call.
 *
 * copy_runs(src_addr, src_size, dst_addr, dst_size, src_region, src_offset, dst_region, dst_offset,
 *           nbytes, release_gil_from)
 *
 * Every argument but the last is a C-contiguous int64 array (numpy). The first four describe the
 * regions (address and size in bytes, one entry each), the next five the runs. Every run is checked
 * against its regions before the first byte moves: a bad run raises ValueError naming it and nothing
 * is copied. Then one memmove per run (right even where a run's source and destination overlap). The GIL is released for the copies when the runs hold at least
 * release_gil_from bytes: a short copy is cheaper than taking the GIL back behind a busy thread.
 *
 * Called by kvxfer.copy (execute_plan, copy_runs, gather_runs, scatter_runs) for regions in host
 * memory, from any thread; it keeps no state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    Py_buffer view;
    const int64_t *data;
    Py_ssize_t len;
    int held;
} Column;

static const char *const NAMES[9] = {"src_addr", "src_size", "dst_addr", "dst_size", "src_region",
                                     "src_offset", "dst_region", "dst_offset", "nbytes"};

static int column(PyObject *o, const char *name, Column *c)
{
    if (PyObject_GetBuffer(o, &c->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return 0;
    c->held = 1;
    const char *f = c->view.format ? c->view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (c->view.itemsize != 8 || !(strcmp(f, "q") == 0 || strcmp(f, "l") == 0) || c->view.ndim > 1) {
        PyErr_Format(PyExc_TypeError, "copy_runs: %s must be a 1-D int64 array (got format %s, itemsize %zd)",
                     name, c->view.format ? c->view.format : "B", c->view.itemsize);
        return 0;
    }
    c->data = (const int64_t *)c->view.buf;
    c->len = c->view.len / 8;
    return 1;
}

/* 0 <= offset, 0 <= n, offset + n <= size, without overflow */
static int inside(int64_t offset, int64_t n, int64_t size)
{
    return offset >= 0 && n >= 0 && size >= 0 && offset <= size && n <= size - offset;
}

static PyObject *copy_runs(PyObject *self, PyObject *args)
{
    PyObject *objs[9];
    long long release_from;
    Column c[9];
    PyObject *result = NULL;
    memset(c, 0, sizeof c);
    if (!PyArg_ParseTuple(args, "OOOOOOOOOL", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6], &objs[7], &objs[8], &release_from))
        return NULL;
    for (int i = 0; i < 9; i++)
        if (!column(objs[i], NAMES[i], &c[i]))
            goto done;
    const int64_t *sa = c[0].data, *ss = c[1].data, *da = c[2].data, *ds = c[3].data;
    const int64_t *sr = c[4].data, *so = c[5].data, *dr = c[6].data, *dof = c[7].data, *n = c[8].data;
    Py_ssize_t nsrc = c[0].len, ndst = c[2].len, count = c[8].len;
    if (c[1].len != nsrc || c[3].len != ndst) {
        PyErr_SetString(PyExc_ValueError, "copy_runs: each region needs one address and one size");
        goto done;
    }
    for (int i = 4; i < 8; i++)
        if (c[i].len != count) {
            PyErr_Format(PyExc_ValueError, "copy_runs: %s has %zd entries, nbytes %zd", NAMES[i], c[i].len, count);
            goto done;
        }
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (sr[i] < 0 || sr[i] >= nsrc || dr[i] < 0 || dr[i] >= ndst) {
            PyErr_Format(PyExc_ValueError, "copy_runs: run %zd names region %lld -> %lld of %zd -> %zd", i,
                         (long long)sr[i], (long long)dr[i], nsrc, ndst);
            goto done;
        }
        if (!inside(so[i], n[i], ss[sr[i]]) || !inside(dof[i], n[i], ds[dr[i]])) {
            PyErr_Format(PyExc_ValueError, "copy_runs: run %zd (%lld bytes, source offset %lld of %lld, "
                         "destination offset %lld of %lld) is outside its regions", i, (long long)n[i],
                         (long long)so[i], (long long)ss[sr[i]], (long long)dof[i], (long long)ds[dr[i]]);
            goto done;
        }
        if (n[i] && (!sa[sr[i]] || !da[dr[i]])) {
            PyErr_Format(PyExc_ValueError, "copy_runs: run %zd reads or writes a region at address 0", i);
            goto done;
        }
        total = n[i] > INT64_MAX - total ? INT64_MAX : total + n[i];
    }
    if (total >= release_from) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++)
            memmove((char *)(uintptr_t)da[dr[i]] + dof[i], (const char *)(uintptr_t)sa[sr[i]] + so[i], (size_t)n[i]);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < count; i++)
            memmove((char *)(uintptr_t)da[dr[i]] + dof[i], (const char *)(uintptr_t)sa[sr[i]] + so[i], (size_t)n[i]);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (int i = 0; i < 9; i++)
        if (c[i].held)
            PyBuffer_Release(&c[i].view);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS,
     "copy_runs(src_addr, src_size, dst_addr, dst_size, src_region, src_offset, dst_region, dst_offset, "
     "nbytes, release_gil_from): check every run against its regions, then memmove each (int64 arrays)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvxfer.hostcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit_hostcopy(void)
{
    return PyModule_Create(&module);
}
