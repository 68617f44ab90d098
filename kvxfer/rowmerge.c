/* The planner's row work in one call (kvxfer.plan_rows): token byte offsets and the merge of runs
 * that continue each other.
 *
 * merge(rs, rd, lens, out_rs, out_rd, out_lens) -> k
 *     Runs (source start, destination start, length) merged, in order, where one starts, on both
 *     sides, where the one before it ends. Writes the k merged runs to the out arrays.
 * token_rows(src_slots, dst_slots, src_geometry, dst_geometry, length, out_rs, out_rd, out_lens) -> k
 *     The same for the rows of ``length`` bytes at each token's offset: a geometry is the tuple
 *     (page_size, page_stride, token_stride, shift), the offset of slot s being
 *     floor(s / page_size) * page_stride + (s mod page_size) * token_stride + shift (one multiply
 *     when pages sit back to back, shifts for a page size that is a power of two: a division per
 *     slot is slower than numpy's, which divides by a constant without dividing).
 *
 * outside(values, lo, hi) -> i
 *     The index of the first value outside [lo, hi), or -1: a slot check (Layout.check_slots).
 *
 * Every array is a 1-D C-contiguous int64 array; the inputs are of one length and each out array
 * is at least as long (token_rows' out arrays share no memory with its slot arrays: the callers
 * make them fresh; merge's may be its inputs). Sums wrap as numpy's int64 do (the planner's slots are checked before they
 * come here, so none does). Called by kvxfer.plan_rows (merge_runs, merge_any_order,
 * Geometry.rows) and kvxfer.layout (check_slots) on the planning thread; it keeps no state and
 * holds the GIL (a few microseconds for a request's slots, ~0.25 ms for 131,072).
 *
 * Why compiled: a plan is made per request (every transfer, every reload), and the same steps in
 * numpy were ~15 calls of a few microseconds each, most of a plan's time for a short request.
 * Each step is a tight loop of its own (offsets, then the merge in place): one loop doing both,
 * with a branch per slot, was 2.3x slower than numpy on 131,072 slots. The stable sort by source
 * start that a second merge may need stays numpy's (kvxfer.plan_rows: ``_in_source_order``).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "columns.h"

static int column(PyObject *o, const char *name, int writable, Column *c)
{
    return column_of("rowmerge", o, name, 8, writable, c);
}

static inline int64_t add(int64_t a, int64_t b) { return (int64_t)((uint64_t)a + (uint64_t)b); }
static inline int64_t mul(int64_t a, int64_t b) { return (int64_t)((uint64_t)a * (uint64_t)b); }

typedef struct {
    int64_t page_size, page_stride, token_stride, shift;
    int back_to_back;   /* page_stride == page_size * token_stride: offset = slot * token_stride + shift */
    int log2;           /* page_size is 2**log2, else -1 */
} Geometry;

static int geometry(PyObject *o, const char *name, Geometry *g)
{
    if (!PyArg_ParseTuple(o, "LLLL", &g->page_size, &g->page_stride, &g->token_stride, &g->shift))
        return 0;
    if (g->page_size < 1) {
        PyErr_Format(PyExc_ValueError, "rowmerge: %s page size must be >= 1", name);
        return 0;
    }
    g->back_to_back = g->page_stride == mul(g->page_size, g->token_stride);
    g->log2 = -1;
    for (int b = 0; b < 62; b++)
        if (g->page_size == (int64_t)1 << b)
            g->log2 = b;
    return 1;
}

/* Python's floor division and modulo, so that a slot's offset is numpy's divmod's. */
static inline int64_t offset_of(int64_t slot, const Geometry *g)
{
    if (g->back_to_back)
        return add(mul(slot, g->token_stride), g->shift);
    int64_t page, in_page;
    if (g->log2 >= 0 && slot >= 0) {
        page = slot >> g->log2, in_page = slot & (g->page_size - 1);
    } else {
        page = slot / g->page_size, in_page = slot % g->page_size;
        if (in_page < 0)
            page -= 1, in_page += g->page_size;
    }
    return add(add(mul(page, g->page_stride), mul(in_page, g->token_stride)), g->shift);
}

/* Merge n runs in order into out, which may be the input itself (run i is read before anything is
 * written at i); run i's length is lens[i * lens_step] (0: one length for all). Returns the count. */
static Py_ssize_t merge_in_order(const int64_t *rs, const int64_t *rd, const int64_t *lens, Py_ssize_t lens_step,
                                 Py_ssize_t n, int64_t *ors, int64_t *ord, int64_t *olens)
{
    if (n == 0)
        return 0;
    Py_ssize_t k = 0;
    int64_t s0 = rs[0], d0 = rd[0], len = lens[0], end_s = add(rs[0], lens[0]), end_d = add(rd[0], lens[0]);
    for (Py_ssize_t i = 1; i < n; i++) {
        int64_t s = rs[i], d = rd[i], l = lens[i * lens_step];
        if (s == end_s && d == end_d) {
            len = add(len, l);
        } else {
            ors[k] = s0, ord[k] = d0, olens[k] = len, k++;
            s0 = s, d0 = d, len = l;
        }
        end_s = add(s, l), end_d = add(d, l);
    }
    ors[k] = s0, ord[k] = d0, olens[k] = len;
    return k + 1;
}

/* Each slot's byte offset into out: one tight loop per case, no branch per slot. */
static void offsets(const int64_t *restrict slots, Py_ssize_t n, Geometry g, int64_t *restrict out)
{
    Py_ssize_t i;
    if (g.back_to_back) {
        for (i = 0; i < n; i++)
            out[i] = add(mul(slots[i], g.token_stride), g.shift);
        return;
    }
    for (i = 0; i < n; i++)
        out[i] = offset_of(slots[i], &g);
}

static int outputs(PyObject *const *objs, Py_ssize_t n, Column *c)
{
    static const char *names[3] = {"out_rs", "out_rd", "out_lens"};
    for (int j = 0; j < 3; j++) {
        if (!column(objs[j], names[j], 1, &c[j]))
            return 0;
        if (c[j].len < n) {
            PyErr_Format(PyExc_ValueError, "rowmerge: %s has %zd entries, fewer than the %zd runs", names[j],
                         c[j].len, n);
            return 0;
        }
    }
    return 1;
}

static PyObject *merge(PyObject *self, PyObject *args)
{
    PyObject *o[6];
    Column c[6] = {{0}};
    Py_ssize_t k = -1;
    if (!PyArg_ParseTuple(args, "OOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5]))
        return NULL;
    if (!column(o[0], "rs", 0, &c[0]) || !column(o[1], "rd", 0, &c[1]) || !column(o[2], "lens", 0, &c[2]))
        goto done;
    if (c[0].len != c[2].len || c[1].len != c[2].len) {
        PyErr_Format(PyExc_ValueError, "rowmerge: rs, rd and lens differ in length (%zd, %zd, %zd)", c[0].len,
                     c[1].len, c[2].len);
        goto done;
    }
    if (!outputs(&o[3], c[2].len, &c[3]))
        goto done;
    k = merge_in_order(c[0].view.buf, c[1].view.buf, c[2].view.buf, 1, c[2].len, c[3].view.buf, c[4].view.buf,
                       c[5].view.buf);
done:
    release_columns(c, 6);
    return k < 0 ? NULL : PyLong_FromSsize_t(k);
}

static PyObject *token_rows(PyObject *self, PyObject *args)
{
    PyObject *o[8];
    long long length;
    Geometry gs, gd;
    Column c[5] = {{0}};
    Py_ssize_t k = -1;
    if (!PyArg_ParseTuple(args, "OOO!O!LOOO", &o[0], &o[1], &PyTuple_Type, &o[2], &PyTuple_Type, &o[3], &length,
                          &o[5], &o[6], &o[7]))
        return NULL;
    if (!geometry(o[2], "src", &gs) || !geometry(o[3], "dst", &gd))
        return NULL;
    if (!column(o[0], "src_slots", 0, &c[0]) || !column(o[1], "dst_slots", 0, &c[1]))
        goto done;
    Py_ssize_t n = c[0].len;
    if (c[1].len != n) {
        PyErr_Format(PyExc_ValueError, "rowmerge: %zd src slots vs %zd dst slots", n, c[1].len);
        goto done;
    }
    if (!outputs(&o[5], n, &c[2]))
        goto done;
    int64_t *ors = c[2].view.buf, *ord = c[3].view.buf, len = length;
    offsets(c[0].view.buf, n, gs, ors);   /* the rows, then merged in place */
    offsets(c[1].view.buf, n, gd, ord);
    k = merge_in_order(ors, ord, &len, 0, n, ors, ord, c[4].view.buf);
done:
    release_columns(c, 5);
    return k < 0 ? NULL : PyLong_FromSsize_t(k);
}

static PyObject *outside(PyObject *self, PyObject *args)
{
    PyObject *o;
    long long lo, hi;
    Column c = {{0}};
    if (!PyArg_ParseTuple(args, "OLL", &o, &lo, &hi))
        return NULL;
    if (!column(o, "values", 0, &c)) {
        release_columns(&c, 1);
        return NULL;
    }
    const int64_t *v = c.view.buf;
    Py_ssize_t i, n = c.len;
    for (i = 0; i < n && v[i] >= lo && v[i] < hi; i++)
        ;
    release_columns(&c, 1);
    return PyLong_FromSsize_t(i < n ? i : -1);
}

static PyMethodDef methods[] = {
    {"outside", outside, METH_VARARGS, "outside(values, lo, hi) -> index of the first value outside [lo, hi), or -1"},
    {"merge", merge, METH_VARARGS, "merge(rs, rd, lens, out_rs, out_rd, out_lens) -> count of merged runs"},
    {"token_rows", token_rows, METH_VARARGS,
     "token_rows(src_slots, dst_slots, src_geometry, dst_geometry, length, out_rs, out_rd, out_lens) -> count"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvxfer.rowmerge",
                                    "The planner's row work, compiled (see rowmerge.c).", -1, methods};

PyMODINIT_FUNC PyInit_rowmerge(void) { return PyModule_Create(&module); }
