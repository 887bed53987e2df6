/* kvbridge._kvcopy.dst_snapshot: a fetch's destination block ids checked and their generations
 * taken, in one call (kvbridge/blockcopy.py has its Python twin, py_dst_snapshot).
 *
 *   dst_snapshot(ids, gens, n) -> (list[int], list[int]) | None
 *       `ids` a list or tuple of exactly `n` ints (int itself, not a subclass), each in
 *       [0, len(gens)), no two equal; `gens` the pool's own list of generations. Returns a new
 *       list of the ids and a new list of their generations as they are now, or None where
 *       any of that does not hold -- the caller's long way then says what is wrong (or
 *       takes what only it takes, such as numpy integers). Nothing is raised for bad ids.
 *
 * The GIL is held throughout, so the generations are one snapshot with respect to Python
 * threads (a pool changes generations under the GIL).
 */
#include "dstids.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DUP_PAIRWISE 32    /* up to this many ids, compared pairwise; more are sorted first */

static int cmp_ll(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* 1 where two of v[0..n) are equal, 0 where none are, -1 out of memory (exception set) */
static int has_duplicates(const long long *v, Py_ssize_t n) {
    if (n <= DUP_PAIRWISE) {
        for (Py_ssize_t i = 1; i < n; i++)
            for (Py_ssize_t j = 0; j < i; j++)
                if (v[i] == v[j])
                    return 1;
        return 0;
    }
    long long *s = PyMem_Malloc((size_t)n * sizeof(long long));
    if (s == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(s, v, (size_t)n * sizeof(long long));
    qsort(s, (size_t)n, sizeof(long long), cmp_ll);
    int dup = 0;
    for (Py_ssize_t i = 1; i < n && !dup; i++)
        dup = s[i] == s[i - 1];
    PyMem_Free(s);
    return dup;
}

PyObject *kvb_dst_snapshot(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ids, *gens;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OO!n", &ids, &PyList_Type, &gens, &n))
        return NULL;
    if (!(PyList_CheckExact(ids) || PyTuple_CheckExact(ids)) || PySequence_Fast_GET_SIZE(ids) != n || n < 0)
        Py_RETURN_NONE;
    long long one, *v = n <= 1 ? &one : PyMem_Malloc((size_t)n * sizeof(long long));
    if (v == NULL)
        return PyErr_NoMemory();
    PyObject *res = NULL, *out = NULL, *snap = NULL;
    PyObject **items = PySequence_Fast_ITEMS(ids);
    Py_ssize_t nblocks = PyList_GET_SIZE(gens);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (!PyLong_CheckExact(items[k]))
            goto refuse;
        int overflow = 0;
        v[k] = PyLong_AsLongLongAndOverflow(items[k], &overflow);
        if (overflow || v[k] < 0 || v[k] >= nblocks)
            goto refuse;
    }
    int dup = has_duplicates(v, n);
    if (dup < 0)
        goto done;
    if (dup)
        goto refuse;
    out = PyList_New(n);
    snap = PyList_New(n);
    if (out == NULL || snap == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *g = PyList_GET_ITEM(gens, (Py_ssize_t)v[k]);
        Py_INCREF(items[k]);
        PyList_SET_ITEM(out, k, items[k]);
        Py_INCREF(g);
        PyList_SET_ITEM(snap, k, g);
    }
    res = PyTuple_Pack(2, out, snap);
    goto done;
refuse:
    res = Py_None;
    Py_INCREF(res);
done:
    Py_XDECREF(out);
    Py_XDECREF(snap);
    if (v != &one)
        PyMem_Free(v);
    return res;
}
