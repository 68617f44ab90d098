/* The 1-D arrays kvxfer's compiled helpers read (rangecheck.c, rowmerge.c, keychain.c): a C-contiguous buffer of
 * int64 (itemsize 8) or of bytes/bools (itemsize 1), checked once; ``module`` names the caller in
 * the error. ``release_columns`` gives back every buffer taken (those not taken are skipped).
 * Included by those files only: every function here is static. */
#ifndef KVXFER_COLUMNS_H
#define KVXFER_COLUMNS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

typedef struct {
    Py_buffer view;
    Py_ssize_t len;
    int held;
} Column;

static int column_of(const char *module, PyObject *o, const char *name, int itemsize, int writable, Column *c)
{
    if (PyObject_GetBuffer(o, &c->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return 0;
    c->held = 1;
    const char *f = c->view.format ? c->view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    int ok = itemsize == 8 ? (strcmp(f, "q") == 0 || strcmp(f, "l") == 0)
                           : (strcmp(f, "B") == 0 || strcmp(f, "?") == 0 || strcmp(f, "b") == 0);
    if (c->view.itemsize != itemsize || !ok || c->view.ndim > 1) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be a 1-D %s array (got format %s, itemsize %zd)", module, name,
                     itemsize == 8 ? "int64" : "uint8 or bool", c->view.format ? c->view.format : "B",
                     c->view.itemsize);
        return 0;
    }
    c->len = c->view.len / itemsize;
    return 1;
}

static void release_columns(Column *c, int n)
{
    for (int i = 0; i < n; i++)
        if (c[i].held)
            PyBuffer_Release(&c[i].view);
}

#endif
