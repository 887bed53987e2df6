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

int kvb_ids_take(PyObject *ids, PyObject *gens, Py_ssize_t n, int64_t *v, uint64_t *g) {
    if (!(PyList_CheckExact(ids) || PyTuple_CheckExact(ids)) || PySequence_Fast_GET_SIZE(ids) != n || n < 0
            || !PyList_CheckExact(gens))
        return 0;
    PyObject **items = PySequence_Fast_ITEMS(ids);
    Py_ssize_t nblocks = PyList_GET_SIZE(gens);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (!PyLong_CheckExact(items[k]))
            return 0;
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(items[k], &overflow);
        if (overflow || x < 0 || x >= nblocks)
            return 0;
        v[k] = (int64_t)x;
    }
    int dup = has_duplicates((const long long *)v, n);
    if (dup)
        return dup < 0 ? -1 : 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        g[k] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(gens, (Py_ssize_t)v[k]));
        if (g[k] == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

int kvb_marks(PyObject *marks, const int64_t *v, Py_ssize_t n, int on) {
    if (!PyByteArray_CheckExact(marks))
        return -1;
    Py_ssize_t size = PyByteArray_GET_SIZE(marks);
    unsigned char *m = (unsigned char *)PyByteArray_AS_STRING(marks);
    for (Py_ssize_t k = 0; k < n; k++)
        if (v[k] < 0 || v[k] >= size)
            return -1;
    if (on)
        for (Py_ssize_t k = 0; k < n; k++)
            if (m[v[k]])
                return 0;
    for (Py_ssize_t k = 0; k < n; k++)
        m[v[k]] = (unsigned char)on;
    return 1;
}

PyObject *kvb_land(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *marks, *ids;
    int on;
    if (!PyArg_ParseTuple(args, "O!Op", &PyByteArray_Type, &marks, &ids, &on))
        return NULL;
    PyObject *fast = PySequence_Fast(ids, "land: block ids");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    int64_t one, *v = n <= 1 ? &one : PyMem_Malloc((size_t)n * sizeof(int64_t));
    PyObject *res = NULL;
    if (v == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        long long x = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, k));
        if (x == -1 && PyErr_Occurred())
            goto done;
        v[k] = (int64_t)x;
    }
    int ok = kvb_marks(marks, v, n, on);
    if (ok < 0)
        PyErr_SetString(PyExc_ValueError, "land: a block id outside the pool");
    else
        res = PyBool_FromLong(ok);
done:
    if (v != &one)
        PyMem_Free(v);
    Py_DECREF(fast);
    return res;
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
