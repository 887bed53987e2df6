/* kvbridge._kvcopy.dst_snapshot (dstids.c): a fetch's destination ids checked and their
 * generations taken in one call. */
#ifndef KVB_DSTIDS_H
#define KVB_DSTIDS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

PyObject *kvb_dst_snapshot(PyObject *self, PyObject *args);

/* 1 where `ids` (a list or tuple of exactly n ints) are distinct blocks of the pool whose
 * generations list is `gens`: their ids in v and generations in g; 0 where not (nothing
 * raised: the caller's long way says why); -1 with an exception set */
int kvb_ids_take(PyObject *ids, PyObject *gens, Py_ssize_t n, int64_t *v, uint64_t *g);

/* A pool's landing marks (a bytearray, one byte per block): on=1 marks blocks v[0..n) where
 * none is marked (1; 0 where one is, nothing marked), on=0 unmarks them (1); -1 for an id
 * outside the marks or marks that are not a bytearray. The GIL held: atomic for Python. */
int kvb_marks(PyObject *marks, const int64_t *v, Py_ssize_t n, int on);

/* land(marks, ids, on) -> bool: kvb_marks from Python (ValueError for an id outside) */
PyObject *kvb_land(PyObject *self, PyObject *args);

#endif
