/* kvbridge._kvcopy.dst_snapshot (dstids.c): a fetch's destination ids checked and their
 * generations taken in one call. */
#ifndef KVB_DSTIDS_H
#define KVB_DSTIDS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *kvb_dst_snapshot(PyObject *self, PyObject *args);

#endif
