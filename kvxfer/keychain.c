/* The offload key chain (kvxfer.offload.records.page_keys): one call for every page of a stride or
 * a prompt, where a Python loop paid a hashlib call per page.
 *
 * chain(prev, tokens, page_size) -> list[bytes]
 *
 * prev: bytes (the key before the first page: the rank's seed or the last page key), at most 64.
 * tokens: a C-contiguous 1-D int64 array; page_size > 0 tokens a page. For each whole page i:
 *
 *     key[i] = BLAKE2b-128(key[i - 1] || the page's token ids as native int64)   (key[-1] = prev)
 *
 * the same bytes as ``hashlib.blake2b(prev + page.tobytes(), digest_size=16).digest()``: keys name
 * records on file, so a key made here finds a record written by the Python chain, and back. A
 * trailing partial page has no key. BLAKE2b is written here from its specification (RFC 7693):
 * unkeyed, 16-byte digest, sequential mode.
 *
 * 2,048 pages of 16 tokens (a 32k prompt, as ``restore`` chains it): 0.6 ms here, 1.3-2.8 ms in the
 * Python loop this replaced, on the dev box. Called by the offload manager's scheduler-thread calls (step, release,
 * restore, receive_to_host) and nothing else; it keeps no state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "columns.h"

#define DIGEST 16
#define BLOCK 128
#define MAX_PREV 64

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* the message word order of each of the 12 rounds (rounds 10 and 11 repeat 0 and 1) */
static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p)   /* little-endian, as the specification reads words */
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
#else
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
#endif
}

#define G(a, b, c, d, x, y)            \
    do {                               \
        a = a + b + (x);               \
        d = rotr(d ^ a, 32);           \
        c = c + d;                     \
        b = rotr(b ^ c, 24);           \
        a = a + b + (y);               \
        d = rotr(d ^ a, 16);           \
        c = c + d;                     \
        b = rotr(b ^ c, 63);           \
    } while (0)

/* F: one 128-byte block into the state ``h``; ``t``: bytes hashed so far, this block included */
static void compress(uint64_t h[8], const uint8_t block[BLOCK], uint64_t t, int last)
{
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++)
        m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t;   /* the counter's high word stays 0: messages here are far below 2**64 bytes */
    if (last)
        v[14] = ~v[14];
#pragma GCC unroll 12
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
        G(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
        G(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
        G(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
        G(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
        G(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
        G(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
        G(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
        G(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b-128 of ``msg`` (``n`` bytes) into ``out`` */
static void blake2b_16(const uint8_t *msg, size_t n, uint8_t out[DIGEST])
{
    uint64_t h[8];
    memcpy(h, IV, sizeof h);
    h[0] ^= 0x01010000ULL | DIGEST;   /* depth 1, fanout 1, no key, digest length */
    size_t done = 0;
    while (n - done > BLOCK) {        /* every block but the last (which may be whole) */
        compress(h, msg + done, done + BLOCK, 0);
        done += BLOCK;
    }
    uint8_t last[BLOCK] = {0};
    memcpy(last, msg + done, n - done);
    compress(h, last, n, 1);
    for (int i = 0; i < DIGEST; i++)
        out[i] = (uint8_t)(h[i / 8] >> (8 * (i % 8)));
}

static PyObject *chain(PyObject *self, PyObject *args)
{
    Py_buffer prev;
    PyObject *tok;
    Py_ssize_t page_size;
    if (!PyArg_ParseTuple(args, "y*On", &prev, &tok, &page_size))
        return NULL;
    Column c = {0};
    PyObject *out = NULL;
    uint8_t *msg = NULL;
    if (prev.len > MAX_PREV || page_size <= 0) {
        PyErr_Format(PyExc_ValueError, "keychain: prev must be at most %d bytes (got %zd) and page_size > 0 "
                     "(got %zd)", MAX_PREV, prev.len, page_size);
        goto done;
    }
    if (!column_of("keychain", tok, "tokens", 8, 0, &c))
        goto done;
    Py_ssize_t pages = c.len / page_size;
    if ((out = PyList_New(pages)) == NULL || pages == 0)
        goto done;
    /* a whole page lies inside the token buffer: its bytes, and the message's, fit in memory */
    size_t page_bytes = (size_t)page_size * 8;
    if ((msg = PyMem_Malloc(MAX_PREV + page_bytes)) == NULL) {
        Py_CLEAR(out);
        PyErr_NoMemory();
        goto done;
    }
    const uint8_t *tokens = c.view.buf;
    size_t head = (size_t)prev.len;
    memcpy(msg, prev.buf, head);
    for (Py_ssize_t i = 0; i < pages; i++) {
        uint8_t key[DIGEST];
        memcpy(msg + head, tokens + (size_t)i * page_bytes, page_bytes);
        blake2b_16(msg, head + page_bytes, key);
        PyObject *b = PyBytes_FromStringAndSize((const char *)key, DIGEST);
        if (b == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, b);
        memcpy(msg, key, DIGEST);   /* the next page chains on this key */
        head = DIGEST;
    }
done:
    PyMem_Free(msg);
    release_columns(&c, 1);
    PyBuffer_Release(&prev);
    return out;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(prev, tokens, page_size) -> list of the 16-byte BLAKE2b keys of each whole page, chained"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvxfer.keychain", NULL, -1, methods};

PyMODINIT_FUNC PyInit_keychain(void)
{
    return PyModule_Create(&module);
}
