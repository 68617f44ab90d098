/* kvxfer's compiled helper for host memory: the runs of a plan copied in one call.
 *
 * copy_runs(src_addr, src_size, dst_addr, dst_size, src_region, src_offset, dst_region, dst_offset,
 *           nbytes, release_gil_from[, stream_from])
 *
 * Every array argument is a C-contiguous int64 array (numpy). The first four describe the
 * regions (address and size in bytes, one entry each), the next five the runs. Every run is checked
 * against its regions before the first byte moves: a bad run raises ValueError naming it and nothing
 * is copied. Then one memmove per run (right even where a run's source and destination overlap). The GIL is released for the copies when the runs hold at least
 * release_gil_from bytes: a short copy is cheaper than taking the GIL back behind a busy thread.
 *
 * stream_from (default: never): when the runs hold at least this many bytes, runs whose source and
 * destination do not overlap are written with non-temporal (streaming) stores, then a store fence,
 * so every byte is visible to other threads when the call returns. For a receiver scattering a
 * message into a pool much larger than the caches: the stores skip reading each destination line
 * first. Measured (32 MiB as 512 B runs into random 16-row pages of a 128 MiB pool, best of 7):
 * rows 1024 B apart (a head slice of token-major rows) 3.80 ms with memmove, 2.54 ms streamed;
 * back to back 2.43 and 2.49 ms. Not for a buffer read again soon (a staging frame about to be
 * sent): streamed bytes leave the caches.
 *
 * copy_staged(block_addr, block_size, addr, size, region, offset, nbytes, gather, release_gil_from[,
 *             stream_from])
 *
 * The same between one contiguous block (a staging frame, a received message) and the regions: run i
 * is at the block's offset nbytes[0] + ... + nbytes[i-1]. gather: 1 copies the runs into the block,
 * 0 out of it. Every run is checked against its region, and their sum against block_size, before
 * the first byte moves. It spares the caller the block-side columns copy_runs needs (a cumulative
 * sum and two more arrays: ~20 us for the 7,800 half rows of a 4 MiB message).
 *
 * copy_group(src_addr, src_size, dst_addr, dst_size, src_region, src_base, dst_region, dst_base, row_src,
 *            row_dst, row_len, heads, src_head_stride, dst_head_stride, release_gil_from[, stream_from])
 *
 * The runs of one plan group (kvxfer.plan.RunGroup) without spelling them out first: every part p x
 * row r x head j is the run (src_region[p], src_base[p] + row_src[r] + j * src_head_stride,
 * dst_region[p], dst_base[p] + row_dst[r] + j * dst_head_stride, row_len[r]), in that order. Each is
 * checked as in copy_runs (offsets that overflow int64 are outside) before the first byte moves. It
 * spares the executor RunGroup.runs(), whose arrays cost ~180 us for a 4 MiB request of 128 runs when
 * the caches hold other bytes (as after a decode step): more than a fifth of the copy itself.
 *
 * Called by kvxfer.copy (execute_plan, copy_runs, gather_runs, scatter_runs) for regions in host
 * memory, from any thread; it keeps no state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

/* memmove, with streaming stores for the 16-byte aligned middle of the destination when the two
 * ranges do not overlap (the head and tail go through memcpy); without SSE2, memmove. */
static void copy_streamed(char *d, const char *s, size_t n)
{
#if defined(__SSE2__)
    uintptr_t di = (uintptr_t)d, si = (uintptr_t)s;
    if (n >= 256 && (di + n <= si || si + n <= di)) {
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        memcpy(d, s, head);
        d += head;
        s += head;
        n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), a);
            _mm_stream_si128((__m128i *)(d + i + 16), b);
            _mm_stream_si128((__m128i *)(d + i + 32), c);
            _mm_stream_si128((__m128i *)(d + i + 48), e);
        }
        memcpy(d + body, s + body, n - body);
        return;
    }
#endif
    memmove(d, s, n);
}

static void copy_all(const int64_t *sa, const int64_t *da, const int64_t *sr, const int64_t *so, const int64_t *dr,
                     const int64_t *dof, const int64_t *n, Py_ssize_t count, int streamed)
{
    if (!streamed) {
        for (Py_ssize_t i = 0; i < count; i++)
            memmove((char *)(uintptr_t)da[dr[i]] + dof[i], (const char *)(uintptr_t)sa[sr[i]] + so[i], (size_t)n[i]);
        return;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        copy_streamed((char *)(uintptr_t)da[dr[i]] + dof[i], (const char *)(uintptr_t)sa[sr[i]] + so[i], (size_t)n[i]);
#if defined(__SSE2__)
    _mm_sfence();   /* streamed stores are weakly ordered: done before anyone is told */
#endif
}

/* 0 <= offset, 0 <= n, offset + n <= size, without overflow */
static int inside(int64_t offset, int64_t n, int64_t size)
{
    return offset >= 0 && n >= 0 && size >= 0 && offset <= size && n <= size - offset;
}

static PyObject *copy_runs(PyObject *self, PyObject *args)
{
    PyObject *objs[9];
    long long release_from, stream_from = -1;
    Column c[9];
    PyObject *result = NULL;
    memset(c, 0, sizeof c);
    if (!PyArg_ParseTuple(args, "OOOOOOOOOL|L", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6], &objs[7], &objs[8], &release_from, &stream_from))
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
    int streamed = stream_from >= 0 && total >= stream_from;
    if (total >= release_from) {
        Py_BEGIN_ALLOW_THREADS
        copy_all(sa, da, sr, so, dr, dof, n, count, streamed);
        Py_END_ALLOW_THREADS
    } else {
        copy_all(sa, da, sr, so, dr, dof, n, count, streamed);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (int i = 0; i < 9; i++)
        if (c[i].held)
            PyBuffer_Release(&c[i].view);
    return result;
}

static void staged_all(char *block, const int64_t *addr, const int64_t *r, const int64_t *o, const int64_t *n,
                       Py_ssize_t count, int gather, int streamed)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        char *region = (char *)(uintptr_t)addr[r[i]] + o[i];
        if (gather)
            memmove(block, region, (size_t)n[i]);
        else if (streamed)
            copy_streamed(region, block, (size_t)n[i]);
        else
            memmove(region, block, (size_t)n[i]);
        block += n[i];
    }
#if defined(__SSE2__)
    if (streamed)
        _mm_sfence();   /* as in copy_all */
#endif
}

static PyObject *copy_staged(PyObject *Py_UNUSED(self), PyObject *args)
{
    static const char *const names[5] = {"addr", "size", "region", "offset", "nbytes"};
    PyObject *objs[5];
    long long block_addr, block_size, release_from, stream_from = -1;
    int gather;
    Column c[5];
    PyObject *result = NULL;
    memset(c, 0, sizeof c);
    if (!PyArg_ParseTuple(args, "LLOOOOOpL|L", &block_addr, &block_size, &objs[0], &objs[1], &objs[2], &objs[3],
                          &objs[4], &gather, &release_from, &stream_from))
        return NULL;
    for (int i = 0; i < 5; i++)
        if (!column(objs[i], names[i], &c[i]))
            goto done;
    const int64_t *addr = c[0].data, *size = c[1].data, *r = c[2].data, *o = c[3].data, *n = c[4].data;
    Py_ssize_t nregions = c[0].len, count = c[4].len;
    if (c[1].len != nregions || c[2].len != count || c[3].len != count) {
        PyErr_SetString(PyExc_ValueError, "copy_staged: each region needs one address and one size, each run "
                                          "a region, an offset and a length");
        goto done;
    }
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (r[i] < 0 || r[i] >= nregions || !inside(o[i], n[i], size[r[i]])) {
            PyErr_Format(PyExc_ValueError, "copy_staged: run %zd (region %lld, offset %lld, %lld bytes) is outside "
                         "its region", i, (long long)r[i], (long long)o[i], (long long)n[i]);
            goto done;
        }
        if (!inside(total, n[i], block_size) || (n[i] && (!addr[r[i]] || !block_addr))) {
            PyErr_Format(PyExc_ValueError, "copy_staged: run %zd passes the block's %lld bytes or an address 0", i,
                         block_size);
            goto done;
        }
        total += n[i];
    }
    int streamed = !gather && stream_from >= 0 && total >= stream_from;
    if (total >= release_from) {
        Py_BEGIN_ALLOW_THREADS
        staged_all((char *)(uintptr_t)block_addr, addr, r, o, n, count, gather, streamed);
        Py_END_ALLOW_THREADS
    } else {
        staged_all((char *)(uintptr_t)block_addr, addr, r, o, n, count, gather, streamed);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (int i = 0; i < 5; i++)
        if (c[i].held)
            PyBuffer_Release(&c[i].view);
    return result;
}

/* a + b + c, or 0 when it overflows int64 */
static int sum3(int64_t a, int64_t b, int64_t c, int64_t *out)
{
    int64_t ab;
    return !__builtin_add_overflow(a, b, &ab) && !__builtin_add_overflow(ab, c, out);
}

static PyObject *copy_group(PyObject *Py_UNUSED(self), PyObject *args)
{
    static const char *const names[11] = {"src_addr", "src_size", "dst_addr", "dst_size", "src_region",
                                          "src_base", "dst_region", "dst_base", "row_src", "row_dst", "row_len"};
    PyObject *objs[11];
    long long heads, shs, dhs, release_from, stream_from = -1;
    Column c[11];
    PyObject *result = NULL;
    memset(c, 0, sizeof c);
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOLLLL|L", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6], &objs[7], &objs[8], &objs[9], &objs[10], &heads, &shs, &dhs, &release_from,
                          &stream_from))
        return NULL;
    for (int i = 0; i < 11; i++)
        if (!column(objs[i], names[i], &c[i]))
            goto done;
    const int64_t *sa = c[0].data, *ss = c[1].data, *da = c[2].data, *ds = c[3].data;
    const int64_t *sr = c[4].data, *sb = c[5].data, *dr = c[6].data, *db = c[7].data;
    const int64_t *rs = c[8].data, *rd = c[9].data, *n = c[10].data;
    Py_ssize_t nsrc = c[0].len, ndst = c[2].len, parts = c[4].len, rows = c[8].len;
    if (c[1].len != nsrc || c[3].len != ndst) {
        PyErr_SetString(PyExc_ValueError, "copy_group: each region needs one address and one size");
        goto done;
    }
    if (c[5].len != parts || c[6].len != parts || c[7].len != parts || c[9].len != rows || c[10].len != rows) {
        PyErr_SetString(PyExc_ValueError, "copy_group: each part needs two regions and two bases, each row two "
                                          "offsets and a length");
        goto done;
    }
    if (heads < 1) {
        PyErr_Format(PyExc_ValueError, "copy_group: heads must be >= 1, got %lld", heads);
        goto done;
    }
    int64_t total = 0;
    for (Py_ssize_t p = 0; p < parts; p++) {
        if (sr[p] < 0 || sr[p] >= nsrc || dr[p] < 0 || dr[p] >= ndst) {
            PyErr_Format(PyExc_ValueError, "copy_group: part %zd names region %lld -> %lld of %zd -> %zd", p,
                         (long long)sr[p], (long long)dr[p], nsrc, ndst);
            goto done;
        }
        for (Py_ssize_t r = 0; r < rows; r++)
            for (long long j = 0; j < heads; j++) {
                int64_t sh, dh, so, dof;
                if (__builtin_mul_overflow(j, (int64_t)shs, &sh) || __builtin_mul_overflow(j, (int64_t)dhs, &dh)
                    || !sum3(sb[p], rs[r], sh, &so) || !sum3(db[p], rd[r], dh, &dof)
                    || !inside(so, n[r], ss[sr[p]]) || !inside(dof, n[r], ds[dr[p]])) {
                    PyErr_Format(PyExc_ValueError, "copy_group: part %zd, row %zd, head %lld (%lld bytes) is outside "
                                 "its regions", p, r, j, (long long)n[r]);
                    goto done;
                }
                if (n[r] && (!sa[sr[p]] || !da[dr[p]])) {
                    PyErr_Format(PyExc_ValueError, "copy_group: part %zd reads or writes a region at address 0", p);
                    goto done;
                }
                total = n[r] > INT64_MAX - total ? INT64_MAX : total + n[r];
            }
    }
    int streamed = stream_from >= 0 && total >= stream_from;
    {
        PyThreadState *ts = total >= release_from ? PyEval_SaveThread() : NULL;   /* as copy_runs */
        for (Py_ssize_t p = 0; p < parts; p++) {
            char *s0 = (char *)(uintptr_t)sa[sr[p]] + sb[p], *d0 = (char *)(uintptr_t)da[dr[p]] + db[p];
            for (Py_ssize_t r = 0; r < rows; r++)
                for (long long j = 0; j < heads; j++) {
                    char *d = d0 + rd[r] + j * dhs;
                    const char *s = s0 + rs[r] + j * shs;
                    if (streamed)
                        copy_streamed(d, s, (size_t)n[r]);
                    else
                        memmove(d, s, (size_t)n[r]);
                }
        }
#if defined(__SSE2__)
        if (streamed)
            _mm_sfence();   /* as in copy_all */
#endif
        if (ts)
            PyEval_RestoreThread(ts);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (int i = 0; i < 11; i++)
        if (c[i].held)
            PyBuffer_Release(&c[i].view);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS,
     "copy_runs(src_addr, src_size, dst_addr, dst_size, src_region, src_offset, dst_region, dst_offset, "
     "nbytes, release_gil_from[, stream_from]): check every run against its regions, then memmove each "
     "(int64 arrays; streaming stores from stream_from bytes)."},
    {"copy_staged", copy_staged, METH_VARARGS,
     "copy_staged(block_addr, block_size, addr, size, region, offset, nbytes, gather, release_gil_from[, "
     "stream_from]): the runs into (gather) or out of one contiguous block, back to back, each checked first."},
    {"copy_group", copy_group, METH_VARARGS,
     "copy_group(src_addr, src_size, dst_addr, dst_size, src_region, src_base, dst_region, dst_base, row_src, "
     "row_dst, row_len, heads, src_head_stride, dst_head_stride, release_gil_from[, stream_from]): the runs of one "
     "plan group (part x row x head), each checked first, then moved."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvxfer.hostcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit_hostcopy(void)
{
    return PyModule_Create(&module);
}
