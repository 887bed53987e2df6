/* kvbridge._kvcopy: block copies and block checksums in one pass over the bytes.
 *
 * A block's checksum (kvbridge.integrity): the xxh3-64 of its parts' own xxh3-64 digests, each
 * as 8 little-endian bytes, in (layer, part) order (kvb_combine, copyhash.h).
 *
 * A pool's memory is described by *planes*: one per (layer, part) in canonical order, each
 * three int64 values (address of block 0's part, stride between blocks, end address of the
 * buffer). Block b's part in plane p is the `part` bytes at base_p + b * stride_p.
 *
 *   hash_blocks(planes, ids, part, group) -> list[int]
 *       the checksum of each block over `group` consecutive planes, group-major: with
 *       group == number of planes, one checksum per block (kvbridge.integrity.block_checksums);
 *       with group == parts per layer, one per (layer, block) (layer_checksums).
 *   copy_blocks(dst_planes, dst_ids, src_planes, src_ids, part, hash) -> list[int] | None
 *       (`hash`: 0 none, 1 the fastest path, 2 the chunked path even where FUSED, 3 the one
 *       pass with AVX2 even where AVX-512 runs -- for the tests and bench/copyhash.py, which
 *       compare them)
 *       copy every block's parts from src to dst, plane by plane; with `hash`, also the checksum
 *       of each block's bytes *as they landed in dst*: where FUSED (x86-64 with AVX2: 1; with
 *       AVX-512F: 2), each part in one
 *       pass -- each 64-byte stripe loaded once, stored and hashed from the same registers
 *       (copyhash.c), as fast as the copy alone; elsewhere chunk by chunk, each chunk hashed
 *       while it is still in cache (each byte is read from memory once).
 *
 *   gather_blocks(planes, ids, part, head, tail) -> bytearray
 *       `head` zero bytes, then the blocks' parts in canonical (wire) order -- plane by plane,
 *       ids in the order given -- then `tail` zero bytes: a small reply built in one buffer.
 *   scatter_blocks(dst_planes, dst_ids, src, offset, part, hash) -> list[int] | None
 *       the reverse: wire-ordered bytes of `src` (any buffer) from `offset` into the blocks;
 *       with `hash`, the checksum of each block as it landed (as copy_blocks).
 *
 *   read_small(fd, frame, rid, nbytes, dst_planes, dst_ids, part, hash, claimed) -> tuple
 *       tcp:// small reads in one call: send `frame` on socket `fd`, take the reply to request
 *       `rid` -- header (16) | fence (16) | `nbytes` of blocks | trailer (4), see
 *       kvbridge/transports/wire.py -- into a private buffer, and only when it is this read's
 *       DATA reply of that size, its trailer vouches for it (status 0) and its fence is zero
 *       (or `claimed`), land the blocks (hashed as with scatter_blocks). Returns
 *         (0, epoch, counter, digests | None)   landed;
 *         (1, received bytes)                   the header is not that of this read's reply;
 *         (2, the whole reply)                  the fence or the trailer says no: nothing landed;
 *         (3, received bytes)                   the peer closed the connection first.
 *       The socket's own timeouts apply (SO_SNDTIMEO/SO_RCVTIMEO); a socket error is an
 *       OSError. The GIL is released while it sends and waits.
 *   serve_small(fd, payload, rid, table, id_offset, gens, planes, part) -> int
 *       the sender's side: a READ request's `payload` that asks for a whole handle without a
 *       claim, of a handle `table` indexes (handle id -> (issued bytes, block ids,
 *       generations)) and that carries exactly the bytes issued (compared in constant time),
 *       whose blocks still have those generations in `gens` (the pool's list) once copied
 *       out: its DATA reply (zero fence, trailer OK) built in one buffer and sent on `fd`.
 *       Returns the block bytes sent, or -1 where it served nothing (the caller's long way
 *       serves or refuses the read, saying why). The GIL is held from the lookup to the
 *       generation check, so no Python thread ends the handle or frees a block between them,
 *       and released for the send.
 *   serve_next(fd, buf, table, id_offset, gens, planes, part, pool, pinned, served)
 *           -> (served, used, received, count)
 *       the sender's frame loop for the usual reads: receives into the frame reader's empty
 *       buffer, answering each receive that brings exactly one whole READ serve_small would
 *       answer (and counting it in `served`: reads, bytes) and receiving again, until one
 *       does not, or
 *       `pool.buffers` is not `pinned` any more (served: bytes sent for that last receive's
 *       frame, or -1 with nothing sent; used: that frame's bytes; received: bytes now in `buf`,
 *       -2 on the socket's timeout, -3 when the peer closed; count: reads answered).
 *
 *   fetch_whole(fd, ticket, rid, extra, nbytes, dst_planes, dst_ids, part, sums, gens, marks, timeout[, claim, fence])
 *            -> None | True | (code, gens, detail)
 *       the receiver's usual tcp:// fetch (a whole raw handle into whole host blocks; leased:
 *       the owner asked to claim as it serves, the fence it reports written to `fence`) in one call: the destination ids checked (dstids.c) and their generations taken, the
 *       blocks marked as landing in the pool's `marks`, the READ for handle bytes `ticket`
 *       built and sent (deferred releases `extra` behind it), the reply taken by its deadline
 *       (`timeout` seconds: no watchdog) -- up to 64 KiB of blocks into a private buffer and
 *       then landed, more straight into the blocks (recv_blocks' loop) -- each block hashed
 *       as it lands, the checksums compared with `sums`, the generations compared again.
 *       None: nothing sent or marked; True: all held, marks undone (leased: left to the
 *       caller); else the outcome for the caller's pipeline, the marks left to it (see the
 *       function).
 *   land(marks, ids, on) -> bool   (dstids.c)
 *       a pool's landing marks set (where none was) or unset, atomically for Python threads.
 *   recv_blocks(fd, dst_planes, dst_ids, part, hash, cancel) -> (code, received, digests | None)
 *       tcp:// reads too large for read_small: a DATA reply's block bytes (wire order) received
 *       straight into the blocks, recvmsg over a window of up to 1,024 parts / 4 MiB, each
 *       part's xxh3-64 fed with every piece right after it landed (with `hash`); the GIL
 *       released for each receive, `cancel.is_set()` asked between them. Code 0: all landed;
 *       1: the peer closed first; 2: cancelled (with the bytes received so far).
 *   shm_read(mapping, raw, ids, want, dst_planes, dst_ids, hash, expect, between)
 *            -> (code, digests | None)
 *       shm:// one-sided reads in one call (kvbridge/transports/shmtable.py): the handle's
 *       digest (BLAKE2b-128 of its bytes) live in the sender's table and its blocks' generations as
 *       issued, the copy (and hash), then the same slot sequence and the source generations
 *       again; digests equal to `expect` come back as None. Code 0: copied and still the
 *       handle's; 1: not vouched for, nothing written; 2: the source changed during the copy,
 *       the bytes landed are not the handle's (shm_fetch also compares the destination's
 *       generations: code 3). Loads of the table and generations are acquire loads.
 *   dst_snapshot(ids, gens, n) -> (ids, generations) | None   (dstids.c)
 *       a fetch's destination ids checked (n distinct ints in range) and their generations
 *       taken in one call; None where they are not such ids.
 *
 * Every address is checked against its plane before anything is read or written: an id
 * outside [0, (end - base - part) / stride] raises ValueError. The GIL is released for
 * transfers of 64 KiB and more. xxHash (BSD-2-Clause, native/cpu/xxhash/) is built in with
 * its x86 runtime dispatch, so each part's digest equals the `xxhash` package's xxh3_64.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <limits.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <sys/uio.h>

#define XXH_STATIC_LINKING_ONLY
#if defined(KVB_X86_DISPATCH)
#include "xxh_x86dispatch.h"
#else
#include "xxhash.h"
#endif
#include "copyhash.h"
#include "helper.h"
#include "blake2b.h"
#include "dstids.h"

#ifndef CHUNK
#define CHUNK (64 * 1024)
#endif          /* copy then hash this much at a time: it stays in L2 */
#define NOGIL_BYTES (64 * 1024)    /* release the GIL for transfers at least this large */
/* Copies (and hashes) of at least PAR_BYTES in two parts or more are shared with the helper
 * thread where one is configured (helper.h), in units of whole parts (PAR_UNIT_BYTES or more
 * each, at most PAR_MAX_UNITS units): a block's checksum combines its parts' own (kvb_combine),
 * so the parts of one block may land on two threads. Under PAR_WAKE_BYTES only a helper already
 * polling takes part: waking one (a system call, and on a VM the other vCPU's wake-up) measured
 * costlier than the help for a 1 MiB block in busy spells of the Zen 1 VM (README). */
#ifndef PAR_BYTES
#define PAR_BYTES (1024 * 1024)
#endif
#define PAR_WAKE_BYTES (8 * 1024 * 1024)
#define PAR_UNIT_BYTES (64 * 1024)
#define PAR_NS_PER_KIB 100.0       /* a copy and hash, roughly (10 GB/s): the helper's lateness budget */
#define PAR_MAX_UNITS 4096

typedef struct {
    int64_t base, stride, end;
} plane_t;

typedef struct {
    plane_t *p;     /* a private copy: the caller's buffer may change once the GIL is released */
    Py_ssize_t n;
} planes_t;

static int get_planes(PyObject *obj, planes_t *out) {
    Py_buffer buf;
    if (PyObject_GetBuffer(obj, &buf, PyBUF_SIMPLE) < 0)
        return -1;
    if (buf.len % (Py_ssize_t)sizeof(plane_t)) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "planes: a multiple of 3 int64 values expected");
        return -1;
    }
    out->n = buf.len / (Py_ssize_t)sizeof(plane_t);
    out->p = PyMem_Malloc((size_t)(buf.len ? buf.len : 1));
    if (out->p == NULL) {
        PyBuffer_Release(&buf);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(out->p, buf.buf, (size_t)buf.len);
    PyBuffer_Release(&buf);
    return 0;
}

/* 1 where blocks 0..hi (hi >= 0) lie within every plane of `pl`, 0 where not */
static int ids_fit(const planes_t *pl, int64_t part, int64_t hi) {
    for (Py_ssize_t j = 0; j < pl->n; j++) {
        const plane_t *p = &pl->p[j];
        if (p->stride < 0 || p->base < 0 || part < 0 || (p->end - p->base - part) < 0 ||
            (p->stride ? hi > (p->end - p->base - part) / p->stride : 0))
            return 0;
    }
    return 1;
}

/* ids -> int64 array (caller frees); every id checked against every plane */
static int64_t *get_ids(PyObject *seq, const planes_t *pl, int64_t part, Py_ssize_t *n_out) {
    /* a tuple snapshot: converting an item cannot change the sequence under us */
    PyObject *fast = PyTuple_Check(seq) ? (Py_INCREF(seq), seq) : PySequence_Tuple(seq);
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(fast);
    int64_t *ids = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (ids == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    int64_t lo = INT64_MAX, hi = -1;
    PyObject **items = &PyTuple_GET_ITEM(fast, 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(items[i]);
        if (v == -1 && PyErr_Occurred()) {
            PyMem_Free(ids);
            Py_DECREF(fast);
            return NULL;
        }
        ids[i] = (int64_t)v;
        if (v < lo) lo = v;
        if (v > hi) hi = v;
    }
    Py_DECREF(fast);
    if (n && lo < 0) {
        PyMem_Free(ids);
        PyErr_SetString(PyExc_ValueError, "negative block id");
        return NULL;
    }
    if (n && !ids_fit(pl, part, hi)) {
        PyMem_Free(ids);
        PyErr_Format(PyExc_ValueError, "block %lld outside a plane", (long long)hi);
        return NULL;
    }
    *n_out = n;
    return ids;
}

static PyObject *digest_list(const XXH64_hash_t *d, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong((unsigned long long)d[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* The n digests as a list -- or None where `expect` (the checksums the caller would compare them
 * with: a tuple of ints; NULL or anything else compares with nothing) holds exactly them. */
static PyObject *digests_unless(const XXH64_hash_t *d, Py_ssize_t n, PyObject *expect) {
    if (expect != NULL && PyTuple_Check(expect) && PyTuple_GET_SIZE(expect) == n) {
        Py_ssize_t k = 0;
        for (; k < n; k++) {
            unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(expect, k));
            if (v == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();          /* not a checksum: the list goes back, the caller refuses */
                break;
            }
            if (v != (unsigned long long)d[k])
                break;
        }
        if (k == n)
            Py_RETURN_NONE;
    }
    return digest_list(d, n);
}

/* A job of `total` parts of `part` bytes shared with the helper: `*per` parts per unit
 * (PAR_UNIT_BYTES or more, one part at least, PAR_MAX_UNITS units at most, two at least);
 * `*late`, the time past which a helper leaves the job: a quarter of the caller's own share at
 * PAR_NS_PER_KIB. Returns the number of units. */
static size_t par_plan(Py_ssize_t total, int64_t part, Py_ssize_t *per, long long *late) {
    Py_ssize_t p = (Py_ssize_t)((PAR_UNIT_BYTES + part - 1) / (part > 0 ? part : 1));
    Py_ssize_t cap = (total + PAR_MAX_UNITS - 1) / PAR_MAX_UNITS;
    p = p > cap ? p : cap;
    if (p > (total + 1) / 2)
        p = (total + 1) / 2;
    if (p < 1)
        p = 1;
    size_t units = (size_t)((total + p - 1) / p);
    double share = (double)(units / 2) * (double)p * (double)part;
    *per = p;
    *late = (long long)(share / 1024.0 * PAR_NS_PER_KIB / 4);
    return units;
}

/* hash_blocks' work, shared like copy_core's: part u is plane (u / group / n) * group + u % group
 * of block ids[u / group % n], its digest put in pd[u] (group-major, block, plane). */
typedef struct {
    const planes_t *pl;
    const int64_t *ids;
    Py_ssize_t n, group, per, total;
    int64_t part;
    XXH64_hash_t *pd;
} hashjob_t;

static void hash_unit(void *ctx, size_t u, int who) {
    (void)who;
    hashjob_t *h = ctx;
    Py_ssize_t q = (Py_ssize_t)u * h->per, end = q + h->per < h->total ? q + h->per : h->total;
    for (; q < end; q++) {
        Py_ssize_t gk = q / h->group, j = q % h->group;
        const plane_t *p = &h->pl->p[(gk / h->n) * h->group + j];
        h->pd[q] = XXH3_64bits((const void *)(uintptr_t)(p->base + h->ids[gk % h->n] * p->stride), (size_t)h->part);
    }
}

static PyObject *hash_blocks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *pobj, *idobj;
    long long part, group;
    if (!PyArg_ParseTuple(args, "OOLL", &pobj, &idobj, &part, &group))
        return NULL;
    planes_t pl;
    if (get_planes(pobj, &pl) < 0)
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = 0;
    int64_t *ids = NULL;
    XXH64_hash_t *d = NULL, *pd = NULL;
    if (group <= 0 || pl.n % group) {
        PyErr_SetString(PyExc_ValueError, "group must divide the number of planes");
        goto done;
    }
    ids = get_ids(idobj, &pl, part, &n);
    if (ids == NULL)
        goto done;
    Py_ssize_t ngroups = pl.n / group;
    hashjob_t h = {&pl, ids, n, group, 1, pl.n * n, part, NULL};
    d = PyMem_Malloc((size_t)(ngroups * n > 0 ? ngroups * n : 1) * sizeof(XXH64_hash_t));
    pd = h.pd = PyMem_Malloc((size_t)(h.total > 0 ? h.total : 1) * sizeof(XXH64_hash_t));
    if (d == NULL || pd == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double total = (double)part * (double)n * (double)pl.n;
    int nogil = total >= NOGIL_BYTES;
    PyThreadState *ts = nogil ? PyEval_SaveThread() : NULL;
    if (total >= PAR_BYTES && h.total >= 2 && kvb_par_on()) {      /* the parts shared with the helper */
        long long late;
        size_t units = par_plan(h.total, part, &h.per, &late);
        kvb_par_run(&h, units, units / 2, hash_unit, late, total >= PAR_WAKE_BYTES);
    } else {
        h.per = h.total;                                           /* one unit: all of it, here */
        hash_unit(&h, 0, 0);
    }
    for (Py_ssize_t gk = 0; gk < ngroups * n; gk++)
        d[gk] = kvb_combine(pd + gk * group, (size_t)group, 1);
    if (ts)
        PyEval_RestoreThread(ts);
    res = digest_list(d, ngroups * n);
done:
    PyMem_Free(pd);
    PyMem_Free(d);
    PyMem_Free(ids);
    PyMem_Free(pl.p);
    return res;
}

/* copy_core's work, shared with the helper thread (helper.h) when it is large: part u of the
 * copy (block u / np's part in plane u % np) copied, and hashed into pd[u], by copy_part on
 * whichever thread claimed it, with that thread's own scratch (`who`: 0 the caller, 1 the
 * helper); a unit is `per` such parts in order. */
typedef struct {
    const planes_t *dp, *sp;
    const int64_t *did, *sid;
    int64_t part;
    int hash;
    int stream;                      /* stores past the caches (kvb_stream_from) */
    int fused;                       /* one pass per part (kvb_copy_hash) */
    Py_ssize_t per;                  /* parts per unit */
    Py_ssize_t total;                /* parts: blocks x planes */
    XXH64_hash_t *pd;                /* each part's digest, block-major */
    XXH3_state_t *st[2];
} copyjob_t;

static void copy_part(copyjob_t *c, Py_ssize_t u, int who) {
    const planes_t *dp = c->dp, *sp = c->sp;
    Py_ssize_t k = u / dp->n, j = u % dp->n;
    int64_t part = c->part;
    char *dst = (char *)(uintptr_t)(dp->p[j].base + c->did[k] * dp->p[j].stride);
    const char *src = (const char *)(uintptr_t)(sp->p[j].base + c->sid[k] * sp->p[j].stride);
    int apart = dst == src || dst >= src + part || src >= dst + part;     /* not partly overlapping */
    if (c->hash && c->fused && apart) {
        c->pd[u] = kvb_copy_hash(dst, src, (size_t)part, c->hash == 3 ? 1 : 2, c->stream);
        return;
    }
    if (!c->hash && c->stream && apart) {
        kvb_stream_copy(dst, src, (size_t)part);
        return;
    }
    XXH3_state_t *st = c->st[who];
    if (c->hash)
        XXH3_64bits_reset(st);
    for (int64_t off = 0; off < part; off += CHUNK) {
        size_t m = (size_t)(part - off < CHUNK ? part - off : CHUNK);
        memmove(dst + off, src + off, m);   /* a block read into itself overlaps */
        if (c->hash)
            XXH3_64bits_update(st, dst + off, m);
    }
    if (c->hash)
        c->pd[u] = XXH3_64bits_digest(st);
}

static void copy_unit(void *ctx, size_t u, int who) {
    copyjob_t *c = ctx;
    Py_ssize_t q = (Py_ssize_t)u * c->per, end = q + c->per < c->total ? q + c->per : c->total;
    for (; q < end; q++)
        copy_part(c, q, who);
}

/* 1 where the bytes this copy lands may depend on the order of its blocks: a destination byte
 * may be another block's source (the span of some destination plane, its lowest block's start
 * to its highest block's end, meets the span of some source plane), or two blocks may land on
 * the same bytes (a destination id named twice, or a destination plane's stride under a part);
 * 0 where none of that holds. One thread copies blocks in order, so such a copy (blocks moved
 * down within one buffer, say) lands as that order says; shared, the caller takes its tail
 * from the end while the helper copies at the same time, so a block could be read after (or
 * while) another overwrote it, or be written by both. Such copies stay on one thread.
 * Conservative (spans, not blocks; ids spread over more than 2^23 are not looked at, they stay
 * on one thread too); under the GIL, O(n + planes log planes); -1 without memory (one thread).
 * Not seen: distinct destination planes that overlap one another (hand-made planes). */
typedef struct {
    int64_t lo, hi;
} span_t;

static int span_cmp(const void *a, const void *b) {
    int64_t x = ((const span_t *)a)->lo, y = ((const span_t *)b)->lo;
    return (x > y) - (x < y);
}

static int order_matters(const planes_t *dp, const int64_t *did, const planes_t *sp, const int64_t *sid, Py_ssize_t n,
                         int64_t part) {
    int64_t dmin = INT64_MAX, dmax = -1, smin = INT64_MAX, smax = -1;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (did[k] < dmin) dmin = did[k];
        if (did[k] > dmax) dmax = did[k];
        if (sid[k] < smin) smin = sid[k];
        if (sid[k] > smax) smax = sid[k];
    }
    if (n == 0 || sp->n == 0 || dp->n == 0)
        return 0;
    for (Py_ssize_t j = 0; n > 1 && j < dp->n; j++)
        if (dp->p[j].stride < part)             /* neighbouring blocks share bytes */
            return 1;
    if (dmax - dmin >= ((int64_t)1 << 23))
        return 1;
    unsigned char *seen = PyMem_Calloc((size_t)((dmax - dmin) / 8 + 1), 1);
    if (seen == NULL)
        return -1;
    int twice = 0;
    for (Py_ssize_t k = 0; k < n && !twice; k++) {
        int64_t v = did[k] - dmin;
        twice = seen[v >> 3] >> (v & 7) & 1;
        seen[v >> 3] |= (unsigned char)(1u << (v & 7));
    }
    PyMem_Free(seen);
    if (twice)
        return 1;
    span_t *s = PyMem_Malloc((size_t)sp->n * sizeof(span_t));
    if (s == NULL)
        return -1;
    /* ids and planes were checked (get_ids): strides >= 0, every block inside its plane */
    for (Py_ssize_t j = 0; j < sp->n; j++) {
        s[j].lo = sp->p[j].base + smin * sp->p[j].stride;
        s[j].hi = sp->p[j].base + smax * sp->p[j].stride + part;
    }
    qsort(s, (size_t)sp->n, sizeof(span_t), span_cmp);
    Py_ssize_t m = 0;                           /* merged: disjoint, ascending in lo and hi */
    for (Py_ssize_t j = 1; j < sp->n; j++) {
        if (s[j].lo < s[m].hi) {
            if (s[j].hi > s[m].hi)
                s[m].hi = s[j].hi;
        } else {
            s[++m] = s[j];
        }
    }
    m++;
    int meet = 0;
    for (Py_ssize_t j = 0; j < dp->n && !meet; j++) {
        int64_t lo = dp->p[j].base + dmin * dp->p[j].stride, hi = dp->p[j].base + dmax * dp->p[j].stride + part;
        Py_ssize_t a = 0, b = m;                /* the first merged span ending after lo */
        while (a < b) {
            Py_ssize_t c = a + (b - a) / 2;
            if (s[c].hi <= lo)
                a = c + 1;
            else
                b = c;
        }
        meet = a < m && s[a].lo < hi;
    }
    PyMem_Free(s);
    return meet;
}

/* The copy loop of copy_blocks and scatter_blocks: block sid[k] of each source plane j to
 * block did[k] of destination plane j; with `hash`, each destination block's checksum as it
 * landed (kvb_combine of its parts' xxh3-64) -- each part in one pass (kvb_copy_hash) where
 * FUSED and the part does not partly overlap its source, else in CHUNK pieces, each hashed
 * after its copy. Addresses were checked by the callers. A copy of kvb_stream_from() bytes or
 * more stores past the caches (copyhash.h). Returns the digest list (None where they equal
 * `expect`, see digests_unless), None unhashed, or NULL with an exception set. Copies of
 * PAR_BYTES or more in two parts or more are shared with the helper thread (copy_unit), parts
 * at a time, unless order_matters. */
static PyObject *copy_core(const planes_t *dp, const int64_t *did, const planes_t *sp, const int64_t *sid,
                           Py_ssize_t n, int64_t part, int hash, PyObject *expect) {
    PyObject *res = NULL;
    copyjob_t c = {dp, sp, did, sid, part, hash, 0, 0, 1, n * dp->n, NULL, {NULL, NULL}};
    double total = (double)part * (double)n * (double)dp->n;
    c.stream = total >= (double)kvb_stream_from();
    c.fused = (hash == 1 || hash == 3) && kvb_copy_hash_fused() && part > 240;
    int shared = total >= PAR_BYTES && c.total >= 2 && kvb_par_on() &&
                 order_matters(dp, did, sp, sid, n, part) == 0;              /* unless it lands in block order */
    int nt = shared ? 2 : 1;
    XXH64_hash_t *d = NULL;
    if (hash) {
        c.pd = PyMem_Malloc((size_t)(c.total ? c.total : 1) * sizeof(XXH64_hash_t));
        d = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(XXH64_hash_t));
        for (int w = 0; w < nt; w++)           /* for parts that partly overlap their source, too */
            c.st[w] = XXH3_createState();
        if (c.pd == NULL || d == NULL || c.st[0] == NULL || (shared && c.st[1] == NULL)) {
            PyErr_NoMemory();
            goto done;
        }
    }
    int nogil = total >= NOGIL_BYTES;
    PyThreadState *ts = nogil ? PyEval_SaveThread() : NULL;
    if (shared) {
        long long late;
        size_t units = par_plan(c.total, part, &c.per, &late);
        kvb_par_run(&c, units, units / 2, copy_unit, late, total >= PAR_WAKE_BYTES);
    } else {
        for (Py_ssize_t u = 0; u < c.total; u++)
            copy_part(&c, u, 0);
    }
    if (hash)
        for (Py_ssize_t k = 0; k < n; k++)
            d[k] = kvb_combine(c.pd + k * dp->n, (size_t)dp->n, 1);
    if (ts)
        PyEval_RestoreThread(ts);
    if (hash) {
        res = digests_unless(d, n, expect);
    } else {
        res = Py_None;
        Py_INCREF(res);
    }
done:
    for (int w = 0; w < 2; w++)
        if (c.st[w])
            XXH3_freeState(c.st[w]);
    PyMem_Free(c.pd);
    PyMem_Free(d);
    return res;
}

static PyObject *copy_blocks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *dpobj, *didobj, *spobj, *sidobj;
    long long part;
    int hash;
    if (!PyArg_ParseTuple(args, "OOOOLi", &dpobj, &didobj, &spobj, &sidobj, &part, &hash))
        return NULL;
    if (hash < 0 || hash > 3) {
        PyErr_SetString(PyExc_ValueError, "hash: 0 (none), 1 (hash), 2 (hash, chunked path) or 3 (hash, AVX2 pass)");
        return NULL;
    }
    planes_t dp, sp;
    if (get_planes(dpobj, &dp) < 0)
        return NULL;
    if (get_planes(spobj, &sp) < 0) {
        PyMem_Free(dp.p);
        return NULL;
    }
    PyObject *res = NULL;
    Py_ssize_t nd = 0, ns = 0;
    int64_t *did = NULL, *sid = NULL;
    if (dp.n != sp.n) {
        PyErr_SetString(PyExc_ValueError, "source and destination have different numbers of planes");
        goto done;
    }
    did = get_ids(didobj, &dp, part, &nd);
    if (did == NULL)
        goto done;
    sid = get_ids(sidobj, &sp, part, &ns);
    if (sid == NULL)
        goto done;
    if (nd != ns) {
        PyErr_SetString(PyExc_ValueError, "source and destination name different numbers of blocks");
        goto done;
    }
    res = copy_core(&dp, did, &sp, sid, nd, part, hash, NULL);
done:
    PyMem_Free(did);
    PyMem_Free(sid);
    PyMem_Free(dp.p);
    PyMem_Free(sp.p);
    return res;
}

/* wire order: plane j, block k at (j * n + k) * part from the start of the run of blocks */
static PyObject *gather_blocks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *pobj, *idobj;
    long long part, head, tail;
    if (!PyArg_ParseTuple(args, "OOLLL", &pobj, &idobj, &part, &head, &tail))
        return NULL;
    if (head < 0 || tail < 0) {
        PyErr_SetString(PyExc_ValueError, "negative head or tail");
        return NULL;
    }
    planes_t pl;
    if (get_planes(pobj, &pl) < 0)
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = 0;
    int64_t *ids = get_ids(idobj, &pl, part, &n);
    if (ids == NULL)
        goto done;
    double total = (double)head + (double)tail + (double)part * (double)n * (double)pl.n;
    if (total > (double)PY_SSIZE_T_MAX / 2) {
        PyErr_SetString(PyExc_OverflowError, "gather_blocks: too many bytes");
        goto done;
    }
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (out == NULL)
        goto done;
    char *o = PyByteArray_AS_STRING(out);
    memset(o, 0, (size_t)head);
    memset(o + (Py_ssize_t)total - tail, 0, (size_t)tail);
    char *w = o + head;
    /* the new bytearray is private to this call: nothing else can resize it meanwhile */
    PyThreadState *ts = total >= NOGIL_BYTES ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t j = 0; j < pl.n; j++) {
        for (Py_ssize_t k = 0; k < n; k++) {
            memcpy(w, (const void *)(uintptr_t)(pl.p[j].base + ids[k] * pl.p[j].stride), (size_t)part);
            w += part;
        }
    }
    if (ts)
        PyEval_RestoreThread(ts);
done:
    PyMem_Free(ids);
    PyMem_Free(pl.p);
    return out;
}

/* Wire-ordered bytes at `src` (plane j holds blocks 0..n-1 back to back from j*n*part) into
 * blocks `ids` of `dp`, through copy_core: the source described as planes too. `src` must stay
 * valid and unchanged for the call (the callers hold the buffer). */
static PyObject *scatter_wire(const planes_t *dp, const int64_t *ids, Py_ssize_t n, const char *src, int64_t part,
                              int hash) {
    PyObject *res = NULL;
    planes_t sp = {NULL, dp->n};
    sp.p = PyMem_Malloc((size_t)(dp->n ? dp->n : 1) * sizeof(plane_t));
    int64_t *sid = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (sp.p == NULL || sid == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < dp->n; j++) {
        sp.p[j].base = (int64_t)(uintptr_t)src + (int64_t)j * n * part;
        sp.p[j].stride = part;
        sp.p[j].end = sp.p[j].base + (int64_t)n * part;
    }
    for (Py_ssize_t k = 0; k < n; k++)
        sid[k] = k;
    res = copy_core(dp, ids, &sp, sid, n, part, hash, NULL);
done:
    PyMem_Free(sid);
    PyMem_Free(sp.p);
    return res;
}

static PyObject *scatter_blocks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *dpobj, *didobj, *srcobj;
    long long offset, part;
    int hash;
    if (!PyArg_ParseTuple(args, "OOOLLp", &dpobj, &didobj, &srcobj, &offset, &part, &hash))
        return NULL;
    planes_t dp;
    if (get_planes(dpobj, &dp) < 0)
        return NULL;
    Py_buffer src;
    if (PyObject_GetBuffer(srcobj, &src, PyBUF_SIMPLE) < 0) {
        PyMem_Free(dp.p);
        return NULL;
    }
    PyObject *res = NULL;
    Py_ssize_t n = 0;
    int64_t *ids = get_ids(didobj, &dp, part, &n);
    if (ids == NULL)
        goto done;
    double need = (double)part * (double)n * (double)dp.n;
    if (offset < 0 || (double)offset + need > (double)src.len) {
        PyErr_Format(PyExc_ValueError, "scatter_blocks: the source holds %zd bytes, %.0f wanted from offset %lld",
                     src.len, need, offset);
        goto done;
    }
    /* the exported buffer cannot be resized or freed while we hold it */
    res = scatter_wire(&dp, ids, n, (const char *)src.buf + offset, part, hash);
done:
    PyMem_Free(ids);
    PyMem_Free(dp.p);
    PyBuffer_Release(&src);
    return res;
}

/* ------------------------------------------------------------------ tcp:// small reads */
#define HEAD_LEN 16     /* !2sBBIQ: magic "KB", version, kind, request id, length */
#define FENCE_LEN 16    /* !QQ */
#define TRAILER_LEN 4   /* !BBH: status, two zero bytes */
#define WIRE_VERSION 7   /* kvbridge/transports/wire.py's VERSION: checked when that module loads */
#define KIND_DATA 2
#define READ_SMALL_MAX (1 << 20)

static uint64_t be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}

/* send or receive with the GIL released; -1 with a Python exception set on an error, 0 on EOF */
static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* A receive held to `deadline` (CLOCK_MONOTONIC ns; 0: none) without a watchdog: the first
 * receive is bounded by the socket's own SO_RCVTIMEO (Timeout.transfer, which the deadline
 * exceeds); once part of the reply is in, each wait is a poll for what is left of the deadline,
 * so a peer trickling bytes cannot hold it longer: past it, *late is set and the bytes so far
 * come back as at EOF. 1 to receive now, 0 to look at the deadline again, -1 (exception set). */
static int wait_for(int fd, Py_ssize_t got, int64_t deadline, int *late) {
    if (!deadline || !got)
        return 1;
    int64_t left = deadline - mono_ns();
    if (left <= 0) {
        *late = 1;
        return 1;
    }
    struct pollfd pfd = {fd, POLLIN, 0};
    int ready;
    int ms = left / 1000000 >= INT_MAX ? INT_MAX : (int)(left / 1000000) + 1;
    Py_BEGIN_ALLOW_THREADS
    ready = poll(&pfd, 1, ms);
    Py_END_ALLOW_THREADS
    if (ready < 0 && errno != EINTR) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (ready < 0 && PyErr_CheckSignals() < 0)
        return -1;
    return ready > 0;
}

/* send or receive with the GIL released (a receive held to `deadline` where it is not 0, see
 * wait_for); -1 with a Python exception set on an error, 0 on EOF (or the deadline passed)
 * with nothing, -2 - got with `got` bytes */
static Py_ssize_t io_loop(int fd, char *buf, Py_ssize_t len, Py_ssize_t at_least, int sending, int64_t deadline,
                          int *late) {
    Py_ssize_t got = 0;
    *late = 0;
    while (got < at_least) {
        if (!sending) {
            int go = wait_for(fd, got, deadline, late);
            if (go < 0)
                return -1;
            if (*late)
                return got ? -2 - got : 0;
            if (!go)
                continue;
        }
        ssize_t k;
        int later = !sending && deadline && got;      /* poll said readable */
        Py_BEGIN_ALLOW_THREADS
        k = sending ? send(fd, buf + got, (size_t)(len - got), MSG_NOSIGNAL)
                    : recv(fd, buf + got, (size_t)(len - got), later ? MSG_DONTWAIT : 0);
        Py_END_ALLOW_THREADS
        if (k < 0) {
            if (errno == EINTR) {
                if (PyErr_CheckSignals() < 0)
                    return -1;
                continue;
            }
            if (later && (errno == EAGAIN || errno == EWOULDBLOCK))
                continue;                     /* look again */
            /* SO_SNDTIMEO passed with the reply part-sent: a stalled peer, never "no frame yet"
             * (callers take BlockingIOError for an idle receive and would keep the connection,
             * a cut-off DATA frame in it) */
            if (sending && (errno == EAGAIN || errno == EWOULDBLOCK))
                errno = ETIMEDOUT;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (k == 0 && !sending)
            return got ? -2 - got : 0;   /* EOF: the caller learns how much had arrived */
        got += k;
    }
    return got;
}

static PyObject *read_small(PyObject *self, PyObject *args) {
    (void)self;
    int fd, hash, claimed;
    Py_buffer frame;
    unsigned long rid;
    long long nbytes, part;
    PyObject *dpobj, *didobj;
    if (!PyArg_ParseTuple(args, "iy*kLOOLpp", &fd, &frame, &rid, &nbytes, &dpobj, &didobj, &part, &hash, &claimed))
        return NULL;
    PyObject *res = NULL;
    char *buf = NULL;
    int64_t *ids = NULL;
    planes_t dp = {NULL, 0};
    Py_ssize_t n = 0;
    if (nbytes < 0 || nbytes > READ_SMALL_MAX) {
        PyErr_SetString(PyExc_ValueError, "read_small: nbytes outside [0, 1 MiB]");
        goto done;
    }
    if (get_planes(dpobj, &dp) < 0)
        goto done;
    ids = get_ids(didobj, &dp, part, &n);      /* checked before a byte is sent */
    if (ids == NULL)
        goto done;
    if ((double)part * (double)n * (double)dp.n != (double)nbytes) {
        PyErr_SetString(PyExc_ValueError, "read_small: the blocks do not hold nbytes");
        goto done;
    }
    Py_ssize_t want = HEAD_LEN + FENCE_LEN + (Py_ssize_t)nbytes + TRAILER_LEN;
    buf = PyMem_Malloc((size_t)want);
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int late;
    if (io_loop(fd, frame.buf, frame.len, frame.len, 1, 0, &late) < 0)
        goto done;
    Py_ssize_t got = io_loop(fd, buf, want, HEAD_LEN, 0, 0, &late);
    if (got == -1)
        goto done;
    if (got <= 0) {                            /* EOF before a whole header */
        Py_ssize_t had = got == 0 ? 0 : -2 - got;
        res = Py_BuildValue("(iy#)", 3, buf, had);
        goto done;
    }
    const unsigned char *h = (const unsigned char *)buf;
    uint32_t got_id = ((uint32_t)h[4] << 24) | ((uint32_t)h[5] << 16) | ((uint32_t)h[6] << 8) | h[7];
    if (h[0] != 'K' || h[1] != 'B' || h[2] != WIRE_VERSION || h[3] != KIND_DATA || got_id != (uint32_t)rid
            || be64(h + 8) != (uint64_t)(want - HEAD_LEN)) {
        res = Py_BuildValue("(iy#)", 1, buf, got);
        goto done;
    }
    if (got < want) {
        Py_ssize_t more = io_loop(fd, buf + got, want - got, want - got, 0, 0, &late);
        if (more == -1)
            goto done;
        if (more <= 0) {
            Py_ssize_t had = got + (more == 0 ? 0 : -2 - more);
            res = Py_BuildValue("(iy#)", 3, buf, had);
            goto done;
        }
    }
    uint64_t epoch = be64(h + HEAD_LEN), counter = be64(h + HEAD_LEN + 8);
    const unsigned char *t = h + want - TRAILER_LEN;
    if (t[0] || t[1] || t[2] || t[3] || (!claimed && (epoch || counter))) {
        res = Py_BuildValue("(iy#)", 2, buf, want);
        goto done;
    }
    PyObject *digests = scatter_wire(&dp, ids, n, buf + HEAD_LEN + FENCE_LEN, part, hash);
    if (digests == NULL)
        goto done;
    res = Py_BuildValue("(iKKN)", 0, (unsigned long long)epoch, (unsigned long long)counter, digests);
done:
    PyBuffer_Release(&frame);
    PyMem_Free(buf);
    PyMem_Free(ids);
    PyMem_Free(dp.p);
    return res;
}

/* ------------------------------------------------------------------ the sender's small reads */
static uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static void put_be(unsigned char *p, uint64_t v, int n) {
    for (int i = n - 1; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)(v & 0xff);
}

/* 1 when `gens` (the pool's list) holds `want` (a tuple or a list) at `ids`; 0 otherwise; -1 on error */
static int same_gens(PyObject *gens, const int64_t *ids, Py_ssize_t n, PyObject *want) {
    if (!(PyTuple_Check(want) || PyList_Check(want)) || PySequence_Fast_GET_SIZE(want) != n)
        return 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (ids[k] >= PyList_GET_SIZE(gens))
            return 0;
        unsigned long long a = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(gens, ids[k]));
        unsigned long long b = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(want, k));
        if (PyErr_Occurred())
            return -1;
        if (a != b)
            return 0;
    }
    return 1;
}

/* The sender's answer to one READ request `p` (`len` bytes of payload) with request id `rid`,
 * as serve_small describes it: the block bytes sent, -1 where nothing was sent (the long way
 * serves or refuses the read), -2 with an exception set. Holds the GIL throughout except for
 * the send. */
static long serve_core(int fd, const unsigned char *p, Py_ssize_t len, unsigned long rid, PyObject *table,
                       Py_ssize_t id_off, PyObject *gens, PyObject *pobj, long long part) {
    PyObject *entry = NULL;
    planes_t pl = {NULL, 0};
    int64_t *ids = NULL;
    unsigned char *buf = NULL;
    Py_ssize_t n = 0;
    long served = -1;
    /* a whole read without a claim: u32 length | the handle's bytes | flags 0 */
    if (len < 5 || p[len - 1] != 0 || be32(p) != (uint64_t)(len - 5) || id_off < 0 || len - 5 < id_off + 16)
        goto done;
    Py_ssize_t hn = len - 5;
    PyObject *key = PyBytes_FromStringAndSize((const char *)p + 4 + id_off, 16);
    if (key == NULL)
        goto fail;
    entry = PyDict_GetItemWithError(table, key);
    Py_DECREF(key);
    if (entry == NULL) {
        if (PyErr_Occurred())
            goto fail;
        goto done;
    }
    Py_INCREF(entry);
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3 || !PyBytes_Check(PyTuple_GET_ITEM(entry, 0)))
        goto done;
    PyObject *raw = PyTuple_GET_ITEM(entry, 0);
    if (PyBytes_GET_SIZE(raw) != hn)
        goto done;
    const unsigned char *issued = (const unsigned char *)PyBytes_AS_STRING(raw);
    unsigned char diff = 0;            /* constant time: a forger learns nothing from how long it took */
    for (Py_ssize_t i = 0; i < hn; i++)
        diff |= (unsigned char)(issued[i] ^ p[4 + i]);
    if (diff)
        goto done;
    if (get_planes(pobj, &pl) < 0)
        goto fail;
    ids = get_ids(PyTuple_GET_ITEM(entry, 1), &pl, part, &n);
    if (ids == NULL)
        goto fail;
    double nbytes = (double)part * (double)n * (double)pl.n;
    if (nbytes > READ_SMALL_MAX)
        goto done;
    Py_ssize_t total = HEAD_LEN + FENCE_LEN + (Py_ssize_t)nbytes + TRAILER_LEN;
    buf = PyMem_Malloc((size_t)total);
    if (buf == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    buf[0] = 'K';
    buf[1] = 'B';
    buf[2] = WIRE_VERSION;
    buf[3] = KIND_DATA;
    put_be(buf + 4, (uint32_t)rid, 4);
    put_be(buf + 8, (uint64_t)(total - HEAD_LEN), 8);
    memset(buf + HEAD_LEN, 0, FENCE_LEN);
    memset(buf + total - TRAILER_LEN, 0, TRAILER_LEN);
    unsigned char *w = buf + HEAD_LEN + FENCE_LEN;
    for (Py_ssize_t j = 0; j < pl.n; j++) {
        for (Py_ssize_t k = 0; k < n; k++) {
            memcpy(w, (const void *)(uintptr_t)(pl.p[j].base + ids[k] * pl.p[j].stride), (size_t)part);
            w += part;
        }
    }
    /* validate after the copy: still the handle's blocks (the GIL was held since the lookup) */
    int same = same_gens(gens, ids, n, PyTuple_GET_ITEM(entry, 2));
    if (same < 0)
        goto fail;
    if (!same)
        goto done;
    int late;
    if (io_loop(fd, (char *)buf, total, total, 1, 0, &late) < 0)
        goto fail;
    served = (long)nbytes;
    goto done;
fail:
    served = -2;
done:
    Py_XDECREF(entry);
    PyMem_Free(buf);
    PyMem_Free(ids);
    PyMem_Free(pl.p);
    return served;
}

static PyObject *serve_small(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    Py_buffer req;
    unsigned long rid;
    PyObject *table, *gens, *pobj;
    Py_ssize_t id_off;
    long long part;
    if (!PyArg_ParseTuple(args, "iy*kO!nO!OL", &fd, &req, &rid, &PyDict_Type, &table, &id_off, &PyList_Type, &gens,
                          &pobj, &part))
        return NULL;
    long served = serve_core(fd, req.buf, req.len, rid, table, id_off, gens, pobj, part);
    PyBuffer_Release(&req);
    return served == -2 ? NULL : PyLong_FromLong(served);
}

#define KIND_READ 1
#define F_CLAIM 2     /* a request flag: the claim field follows (wire.F_CLAIM) */

/* serve_next(fd, buf, table, id_offset, gens, planes, part, pool, pinned, served) -> (served, used, received, count)
 * The sender's frame loop for the usual reads, in C: receives on socket `fd` into `buf` (a
 * bytearray, the frame reader's empty buffer: nothing is allocated), the GIL released while it
 * waits, and while each receive brings one whole READ frame that serve_small answers, and
 * nothing behind it, answers it, counts it in `served` (two int64: reads, bytes; the sender's
 * stats, added to under the GIL) and receives
 * again. It returns at the first receive that is not exactly that, or once `pool.buffers` is
 * no longer `pinned` (the pool closed: its planes may be gone). served: the block bytes sent
 * for that receive's frame, or -1 (nothing sent for it: the frame reader takes the `received`
 * bytes from the start of `buf`); used: the bytes of the frame answered (the rest is the
 * reader's); received: -2 when the socket's timeout passed with nothing (EAGAIN), -3 when the
 * peer closed it; count: the reads answered in this call (each counted in `served`). */
static PyObject *serve_next(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    Py_buffer b, cb;
    PyObject *table, *gens, *pobj, *pool, *pinned;
    Py_ssize_t id_off;
    long long part;
    if (!PyArg_ParseTuple(args, "iw*O!nO!OLOOw*", &fd, &b, &PyDict_Type, &table, &id_off, &PyList_Type, &gens, &pobj,
                          &part, &pool, &pinned, &cb))
        return NULL;
    PyObject *res = NULL;
    long long *counts = cb.buf;
    if (cb.len != 2 * (Py_ssize_t)sizeof(long long) || ((uintptr_t)cb.buf & 7)) {
        PyErr_SetString(PyExc_ValueError, "serve_next: served must be two aligned 64-bit counters");
        PyBuffer_Release(&cb);
        PyBuffer_Release(&b);
        return NULL;
    }
    Py_ssize_t got;
    Py_ssize_t count = 0;
    for (;;) {
        int err = 0;
        for (;;) {
            Py_BEGIN_ALLOW_THREADS
            got = recv(fd, b.buf, (size_t)b.len, 0);
            err = errno;
            Py_END_ALLOW_THREADS
            if (got >= 0 || err != EINTR)
                break;
            if (PyErr_CheckSignals() < 0)
                goto done;
        }
        if (got < 0) {
            if (err == EAGAIN || err == EWOULDBLOCK) {
                res = Py_BuildValue("(iinn)", -1, 0, (Py_ssize_t)-2, count);
            } else {
                errno = err;
                PyErr_SetFromErrno(PyExc_OSError);
            }
            goto done;
        }
        if (got == 0) {
            res = Py_BuildValue("(iinn)", -1, 0, (Py_ssize_t)-3, count);
            goto done;
        }
        PyObject *now = PyObject_GetAttrString(pool, "buffers");   /* closed while we waited? */
        if (now == NULL)
            goto done;
        Py_DECREF(now);
        if (now != pinned)
            break;
        const unsigned char *h = b.buf;
        if (!(got >= HEAD_LEN && h[0] == 'K' && h[1] == 'B' && h[2] == WIRE_VERSION && h[3] == KIND_READ))
            break;
        uint64_t length = be64(h + 8);
        if (length > (uint64_t)(got - HEAD_LEN))
            break;
        long served = serve_core(fd, h + HEAD_LEN, (Py_ssize_t)length, (unsigned long)be32(h + 4), table, id_off, gens,
                                 pobj, part);
        if (served == -2) {
            if (!PyErr_ExceptionMatches(PyExc_ValueError))
                goto done;             /* the send failed (OSError) or no memory: the caller drops the peer */
            PyErr_Clear();             /* blocks outside the pool's planes: the long way refuses precisely */
            served = -1;
        }
        if (served < 0)
            break;
        counts[0] += 1;                /* the GIL held: atomic for Python readers */
        counts[1] += served;
        count++;
        Py_ssize_t used = HEAD_LEN + (Py_ssize_t)length;
        if (used < got) {              /* frames behind it: the reader's */
            res = Py_BuildValue("(lnnn)", served, used, got, count);
            goto done;
        }
    }
    res = Py_BuildValue("(innn)", -1, (Py_ssize_t)0, got, count);
done:
    PyBuffer_Release(&cb);
    PyBuffer_Release(&b);
    return res;
}

/* ------------------------------------------------------------------ tcp:// large reads */

#define RECV_IOV 1024               /* iovecs per recvmsg (IOV_MAX) ... */
#define RECV_WINDOW (4 << 20)       /* ... and about this many bytes */

/* The parts of blocks `ids` (n of them) in wire order -- plane by plane, the blocks in order --
 * received from `fd` straight into them (recvmsg over RECV_IOV iovecs, about RECV_WINDOW bytes
 * at a time), the landing part's state `st` (NULL: no hashing) fed with every piece right
 * after it landed and each part's digest put in pd[i] (stream part i), the GIL released meanwhile. Between receives: `cancel.is_set()` (cancel not
 * Py_None), and `deadline` (CLOCK_MONOTONIC ns; 0: none): past it, the receive ends -- each
 * receive is bounded by the socket's SO_RCVTIMEO, so a peer trickling bytes overruns it by
 * one such timeout at most. 0 all received, 1 the peer closed, 2 cancelled, 3 the deadline
 * passed; -1 with an exception set. `*received`: the bytes received. */
static int recv_parts(int fd, const planes_t *dpp, const int64_t *ids, Py_ssize_t n, int64_t part,
                      XXH3_state_t *st, XXH64_hash_t *pd, struct iovec *iov, PyObject *cancel, int64_t deadline,
                      long long *out) {
    const planes_t dp = *dpp;
    Py_ssize_t nparts = n * dp.n;           /* stream part i: plane i / n, block ids[i % n] */
    Py_ssize_t i = 0;                       /* first part not wholly received */
    int64_t off = 0;                        /* bytes of part i received */
    long long received = 0;
    *out = 0;
    int code = 0;
    while (i < nparts) {
        int cnt = 0;
        int64_t have = 0;
        for (Py_ssize_t q = i; q < nparts && cnt < RECV_IOV && have < RECV_WINDOW; q++, cnt++) {
            const plane_t *p = &dp.p[q / n];
            int64_t o = q == i ? off : 0;
            iov[cnt].iov_base = (char *)(uintptr_t)(p->base + ids[q % n] * p->stride) + o;
            iov[cnt].iov_len = (size_t)(part - o);
            have += part - o;
        }
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)cnt;
        ssize_t k;
        int err = 0;
        Py_BEGIN_ALLOW_THREADS
        k = recvmsg(fd, &msg, 0);
        err = errno;
        if (k > 0) {                        /* advance over what landed, hashing each piece of it */
            int64_t left = k;
            while (left > 0) {
                int64_t c = part - off < left ? part - off : left;
                if (st != NULL) {
                    const plane_t *p = &dp.p[i / n];
                    if (off == 0)
                        XXH3_64bits_reset(st);
                    XXH3_64bits_update(st, (const char *)(uintptr_t)(p->base + ids[i % n] * p->stride) + off,
                                       (size_t)c);
                }
                off += c;
                left -= c;
                if (off == part) {
                    if (st != NULL)
                        pd[i] = XXH3_64bits_digest(st);
                    i++;
                    off = 0;
                }
            }
        }
        Py_END_ALLOW_THREADS
        if (k < 0) {
            if (err == EINTR) {
                if (PyErr_CheckSignals() < 0)
                    return -1;
                continue;
            }
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            *out = received;
            return -1;
        }
        if (k == 0) {
            code = 1;
            break;
        }
        received += k;
        if (deadline && i < nparts && mono_ns() > deadline) {
            code = 3;
            break;
        }
        if (cancel != Py_None && i < nparts) {
            PyObject *r = PyObject_CallMethod(cancel, "is_set", NULL);
            if (r == NULL)
                return -1;
            int set = PyObject_IsTrue(r);
            Py_DECREF(r);
            if (set < 0)
                return -1;
            if (set) {
                code = 2;
                break;
            }
        }
    }
    *out = received;
    return code;
}

/* Blocks `ids` received straight into place (recv_parts: `cancel`, `deadline`), each block
 * hashed as it lands where `hash`: 0 and *digests (a list, or None without hash) when all came;
 * else recv_parts' code (*digests NULL); -1 with an exception set. *received: the bytes taken. */
static int recv_hashed(int fd, const planes_t *dp, const int64_t *ids, Py_ssize_t n, int64_t part, int hash,
                       PyObject *cancel, int64_t deadline, long long *received, PyObject **digests) {
    *digests = NULL;
    *received = 0;
    XXH3_state_t *st = NULL;
    XXH64_hash_t *pd = NULL;
    struct iovec *iov = PyMem_Malloc(RECV_IOV * sizeof(struct iovec));
    int code = -1;
    if (iov == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if (hash) {                             /* the state of the part landing; each part's digest */
        st = aligned_alloc(64, (sizeof(XXH3_state_t) + 63) & ~(size_t)63);
        pd = PyMem_Malloc((size_t)(n * dp->n > 0 ? n * dp->n : 1) * sizeof(XXH64_hash_t));
        if (st == NULL || pd == NULL) {
            PyErr_NoMemory();
            goto out;
        }
        XXH3_INITSTATE(st);
    }
    code = recv_parts(fd, dp, ids, n, part, st, pd, iov, cancel, deadline, received);
    if (code != 0)
        goto out;
    if (!hash) {
        *digests = Py_NewRef(Py_None);
        goto out;
    }
    XXH64_hash_t *d = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(XXH64_hash_t));
    if (d == NULL) {
        PyErr_NoMemory();
        code = -1;
        goto out;
    }
    for (Py_ssize_t b = 0; b < n; b++)      /* stream part j * n + b: block b's part in plane j */
        d[b] = kvb_combine(pd + b, (size_t)dp->n, (size_t)n);
    *digests = digest_list(d, n);
    PyMem_Free(d);
    if (*digests == NULL)
        code = -1;
out:
    free(st);
    PyMem_Free(pd);
    PyMem_Free(iov);
    return code;
}

/* recv_blocks(fd, dst_planes, dst_ids, part, hash, cancel) -> (code, received, digests | None)
 * The block bytes of a DATA reply -- wire order: plane by plane, the blocks in the order of
 * `dst_ids` -- received from socket `fd` straight into the blocks, recvmsg over a window of
 * parts at a time; with `hash`, each block's xxh3-64 fed with every piece right after it
 * landed (still in cache), so the digests are those of the bytes as they landed. The GIL is
 * released for each receive and its hashing; `cancel` (None, or anything with is_set()) is
 * asked between receives. Codes: 0 all received (the digests, or None); 1 the peer closed
 * the connection after `received` bytes; 2 cancelled after `received` bytes. The socket's own
 * timeouts apply (SO_RCVTIMEO): a timeout or a socket error is an OSError. */
static PyObject *recv_blocks(PyObject *self, PyObject *args) {
    (void)self;
    int fd, hash;
    PyObject *dpobj, *didobj, *cancel;
    long long part;
    if (!PyArg_ParseTuple(args, "iOOLpO", &fd, &dpobj, &didobj, &part, &hash, &cancel))
        return NULL;
    planes_t dp = {NULL, 0};
    int64_t *ids = NULL;
    PyObject *res = NULL, *digests = NULL;
    Py_ssize_t n = 0;
    if (get_planes(dpobj, &dp) < 0)
        return NULL;
    if ((ids = get_ids(didobj, &dp, part, &n)) == NULL)
        goto done;
    if (part <= 0 && n * dp.n > 0) {
        PyErr_SetString(PyExc_ValueError, "recv_blocks: part must be positive");
        goto done;
    }
    long long received;
    int code = recv_hashed(fd, &dp, ids, n, part, hash, cancel, 0, &received, &digests);
    if (code >= 0)
        res = Py_BuildValue("(iLN)", code, received, code == 0 ? digests : Py_NewRef(Py_None));
done:
    PyMem_Free(ids);
    PyMem_Free(dp.p);
    return res;
}

/* ------------------------------------------------------------------ shm one-sided reads */

#define TABLE_HEAD 64   /* kvbridge/transports/shmtable.py: HEAD_SIZE, SLOT, PROBE */
#define TABLE_SLOT 32
#define TABLE_PROBE 16

static uint32_t load32(const unsigned char *p) {
    return __atomic_load_n((const uint32_t *)(const void *)p, __ATOMIC_ACQUIRE);
}

/* Every block ids[k] < nblocks holds generation want[k] in `gens` (u32 each): 1, 0 or -1. */
static int gens_hold(const unsigned char *gens, Py_ssize_t nblocks, const int64_t *ids, const uint32_t *want,
                     Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        if (ids[k] < 0 || ids[k] >= nblocks || load32(gens + 4 * ids[k]) != want[k])
            return 0;
    }
    return 1;
}

/* shm_read(mapping, raw, ids, want, dst_planes, dst_ids, hash, expect, between)
 *     -> (code, digests | None)
 * The one-sided read of kvbridge/transports/shmtable.py in one call. `mapping` is the reader's
 * view of one sender, made once: (table, nslots, gens, src_planes, part, pin). The handle whose
 * bytes are `raw` -- their BLAKE2b-128 digest (blake2b.c) live in the sender's
 * `table` (nslots slots) -- and whose blocks `ids` still hold generations `want` in `gens` is
 * copied from `src_planes` (the mapped pool) into `dst_ids` of `dst_planes` (hashed as it lands
 * when `hash`), then the slot's sequence number and every generation are read again. `pin` (the
 * mapping's memoryview) is held for the call; `expect`, if a tuple, is the handle's checksums:
 * digests equal to them come back as None (copy_core); `between`, if not None, is called
 * after the copy and before the second look (tests). Codes:
 *   0  copied, and nothing changed: the digests (or None);
 *   1  not vouched for (not in the table, a generation already moved): nothing was written;
 *   2  the source changed during the copy: the bytes landed are not the handle's;
 *   3  (shm_fetch only) a destination block's generation is not the caller's snapshot after
 *      the copy (checked before 2: freed or reused since the caller began). */
/* A one-call fetch's fallback, (code, the n generations of `snap` as a list, detail), stealing
 * `detail` (NULL: an error already set); NULL with an exception set. */
static PyObject *fallback_out(int code, const uint64_t *snap, Py_ssize_t n, PyObject *detail) {
    PyObject *gens = detail == NULL ? NULL : PyList_New(n);
    for (Py_ssize_t k = 0; gens != NULL && k < n; k++) {
        PyObject *g = PyLong_FromUnsignedLongLong(snap[k]);
        if (g == NULL)
            Py_CLEAR(gens);
        else
            PyList_SET_ITEM(gens, k, g);
    }
    if (gens == NULL) {
        Py_XDECREF(detail);
        return NULL;
    }
    return Py_BuildValue("(iNN)", code, gens, detail);
}

typedef struct {                /* the reader's view of one sender (shm_map) */
    Py_buffer tb, gb, pin;
    Py_ssize_t nslots;
    long long part;
    planes_t sp;
} shmmap_t;

/* `mapping` parsed, its buffers held (shm_unmap releases them): 0, or -1 with an exception set */
static int shm_map(PyObject *mapobj, shmmap_t *m) {
    PyObject *tobj, *gobj, *spobj, *pinobj;
    memset(m, 0, sizeof *m);
    if (!PyTuple_Check(mapobj)) {
        PyErr_SetString(PyExc_TypeError, "shm_read: the mapping must be a tuple");
        return -1;
    }
    if (!PyArg_ParseTuple(mapobj, "OnOOLO", &tobj, &m->nslots, &gobj, &spobj, &m->part, &pinobj))
        return -1;
    if (PyObject_GetBuffer(pinobj, &m->pin, PyBUF_SIMPLE) < 0)
        return -1;
    if (PyObject_GetBuffer(tobj, &m->tb, PyBUF_SIMPLE) < 0 || PyObject_GetBuffer(gobj, &m->gb, PyBUF_SIMPLE) < 0)
        return -1;
    if (m->nslots <= 0 || (m->nslots & (m->nslots - 1)) || m->nslots > (m->tb.len - TABLE_HEAD) / TABLE_SLOT) {
        PyErr_SetString(PyExc_ValueError, "shm_read: a table of nslots (a power of two) slots expected");
        return -1;
    }
    return get_planes(spobj, &m->sp);
}

static void shm_unmap(shmmap_t *m) {
    PyMem_Free(m->sp.p);
    if (m->gb.obj)
        PyBuffer_Release(&m->gb);
    if (m->tb.obj)
        PyBuffer_Release(&m->tb);
    if (m->pin.obj)
        PyBuffer_Release(&m->pin);
}

/* The handle's generations `wantobj` (ns of them) into want[]: 1; 0 where one is past u32 (no
 * block ever holds it: not vouched for); -1 with an exception set */
static int shm_wants(PyObject *wantobj, Py_ssize_t ns, uint32_t *want) {
    PyObject *wt = PySequence_Tuple(wantobj);
    if (wt == NULL)
        return -1;
    int ok = 1;
    if (PyTuple_GET_SIZE(wt) != ns) {
        PyErr_SetString(PyExc_ValueError, "shm_read: ids, generations and destination differ in length");
        ok = -1;
    }
    for (Py_ssize_t k = 0; k < ns && ok == 1; k++) {
        unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(wt, k));
        if (v == (unsigned long long)-1 && PyErr_Occurred())
            ok = -1;
        else if (v > 0xFFFFFFFFull)
            ok = 0;
        else
            want[k] = (uint32_t)v;
    }
    Py_DECREF(wt);
    return ok;
}

/* 1 when the pool's generation list `gens` holds snap[k] at ids[k] for every k; 0 otherwise; -1 on error */
static int same_snap(PyObject *gens, const int64_t *ids, Py_ssize_t n, const uint64_t *snap) {
    for (Py_ssize_t k = 0; k < n; k++) {
        if (ids[k] >= PyList_GET_SIZE(gens))
            return 0;
        unsigned long long a = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(gens, ids[k]));
        if (a == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        if (a != snap[k])
            return 0;
    }
    return 1;
}

/* shm_read's steps on parsed arguments (and shm_fetch's): 1. the handle live in the table and
 * its blocks `sid` at generations `want`; 2. the copy into `did` of `dp` (hashed, compared with
 * `expect`: copy_core); `between`; 3. the destination's generations (the pool's list `dlive`
 * against `snap`; not where dlive is NULL), then the slot and the source generations again. The code (0..3, see shm_read; *digests set for 0), or -1
 * with an exception set. */
static int shm_copy(const shmmap_t *m, const char *raw, Py_ssize_t rawlen, const int64_t *sid, const uint32_t *want,
                    const planes_t *dp, const int64_t *did, Py_ssize_t n, int hash, PyObject *expect,
                    PyObject *dlive, const uint64_t *snap, PyObject *between, PyObject **digests) {
    *digests = NULL;
    unsigned char dg[16];
    kvb_blake2b(dg, sizeof dg, raw, (size_t)rawlen);
    const unsigned char *table = m->tb.buf, *gens = m->gb.buf;
    Py_ssize_t nblocks = m->gb.len / 4, nslots = m->nslots;
    uint32_t home = ((uint32_t)dg[0] | (uint32_t)dg[1] << 8 | (uint32_t)dg[2] << 16 | (uint32_t)dg[3] << 24) &
                    (uint32_t)(nslots - 1);
    const unsigned char *slot = NULL;
    uint32_t seq = 0;
    for (int k = 0; k < TABLE_PROBE && slot == NULL; k++) {
        const unsigned char *sl = table + TABLE_HEAD + (Py_ssize_t)((home + (uint32_t)k) & (uint32_t)(nslots - 1)) * TABLE_SLOT;
        uint32_t s = load32(sl);
        if ((s & 1) && memcmp(sl + 8, dg, 16) == 0 && load32(sl) == s) {
            slot = sl;
            seq = s;
        }
    }
    if (slot == NULL || !gens_hold(gens, nblocks, sid, want, n))
        return 1;
    PyObject *got = copy_core(dp, did, &m->sp, sid, n, m->part, hash, expect);
    if (got == NULL)
        return -1;
    if (between != Py_None) {
        PyObject *r = PyObject_CallNoArgs(between);
        if (r == NULL) {
            Py_DECREF(got);
            return -1;
        }
        Py_DECREF(r);
    }
    int mine = dlive == NULL ? 1 : same_snap(dlive, did, n, snap);
    if (mine < 0) {
        Py_DECREF(got);
        return -1;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    int code = !mine ? 3 : (load32(slot) != seq || !gens_hold(gens, nblocks, sid, want, n)) ? 2 : 0;
    if (code == 0)
        *digests = got;
    else
        Py_DECREF(got);
    return code;
}

/* What one shm_read or shm_fetch call holds: the mapping, the destination planes, the source
 * ids (checked against the mapped pool), and the arrays it fills; shm_end frees them all. */
typedef struct {
    shmmap_t m;
    planes_t dp;
    int64_t *did, *sid;
    uint32_t *want;
    uint64_t *snap;
    PyObject *digests;
    Py_ssize_t ns;                  /* source ids */
} shmcall_t;

static int shm_begin(shmcall_t *c, PyObject *mapobj, PyObject *dpobj, PyObject *idobj) {
    memset(c, 0, sizeof *c);
    if (shm_map(mapobj, &c->m) < 0 || get_planes(dpobj, &c->dp) < 0)
        return -1;
    if ((c->sid = get_ids(idobj, &c->m.sp, c->m.part, &c->ns)) == NULL)
        return -1;
    c->want = PyMem_Malloc((size_t)(c->ns ? c->ns : 1) * sizeof(uint32_t));
    if (c->want == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void shm_end(shmcall_t *c) {
    Py_XDECREF(c->digests);
    PyMem_Free(c->want);
    PyMem_Free(c->snap);
    PyMem_Free(c->did);
    PyMem_Free(c->sid);
    PyMem_Free(c->dp.p);
    shm_unmap(&c->m);
}

static PyObject *shm_read(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *mapobj, *idobj, *wantobj, *dpobj, *didobj, *expect, *between;
    Py_ssize_t rawlen;
    const char *raw;
    int hash;
    if (!PyArg_ParseTuple(args, "O!y#OOOOpOO", &PyTuple_Type, &mapobj, &raw, &rawlen, &idobj, &wantobj, &dpobj,
                          &didobj, &hash, &expect, &between))
        return NULL;
    shmcall_t c;
    PyObject *res = NULL;
    if (shm_begin(&c, mapobj, dpobj, idobj) < 0)
        goto done;
    if (c.dp.n != c.m.sp.n) {
        PyErr_SetString(PyExc_ValueError, "source and destination have different numbers of planes");
        goto done;
    }
    Py_ssize_t nd = 0, ns = c.ns;
    if ((c.did = get_ids(didobj, &c.dp, c.m.part, &nd)) == NULL)
        goto done;
    if (nd != ns) {
        PyErr_SetString(PyExc_ValueError, "shm_read: ids, generations and destination differ in length");
        goto done;
    }
    int w = shm_wants(wantobj, ns, c.want);
    if (w < 0)
        goto done;
    int code = w == 0 ? 1 : shm_copy(&c.m, raw, rawlen, c.sid, c.want, &c.dp, c.did, nd, hash, expect, NULL, NULL,
                                     between, &c.digests);
    if (code >= 0)
        res = Py_BuildValue("(iO)", code, code == 0 ? c.digests : Py_None);
done:
    shm_end(&c);
    return res;
}

/* shm_fetch(mapping, raw, ids, want, dst_planes, dst_ids, sums, gens, marks, between)
 *     -> None | True | (code, gens, digests)
 * The receiver's usual fetch over shm:// -- all of an unleased raw handle into whole blocks of
 * a host pool of the sender's geometry -- in one call, as fetch_whole does over tcp: the
 * destination ids checked (n distinct ints of the pool: kvb_ids_take) and their generations in
 * the pool's list `gens` taken, the blocks marked as landing (`marks`), then shm_read's steps
 * (hashed where `sums`, the handle's checksums, is a tuple; None: unverified) held to that
 * snapshot (`between`: as shm_read's).
 *   None:  nothing read, nothing marked: the ids are not such ids, or one is landing already
 *          -- the long way says which.
 *   True:  landed, its checksums equal to `sums`, the generations unchanged; marks undone.
 *   (code, gens, digests): it did not end so; the marks are the caller's to undo. code as
 *          shm_read's (0: a checksum differs, digests: each block's as it landed; 1: nothing
 *          written; 2, 3: the bytes landed are not the handle's); gens: the snapshot taken.
 * Any exception undoes the marks first. */
static PyObject *shm_fetch(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *mapobj, *idobj, *wantobj, *dpobj, *didobj, *sums, *gens, *marks, *between;
    Py_ssize_t rawlen;
    const char *raw;
    if (!PyArg_ParseTuple(args, "O!y#OOOOOO!O!O", &PyTuple_Type, &mapobj, &raw, &rawlen, &idobj, &wantobj, &dpobj,
                          &didobj, &sums, &PyList_Type, &gens, &PyByteArray_Type, &marks, &between))
        return NULL;
    shmcall_t c;
    PyObject *res = NULL;
    int marked = 0;
    Py_ssize_t n = PyList_CheckExact(didobj) || PyTuple_CheckExact(didobj) ? PySequence_Fast_GET_SIZE(didobj) : -1;
    if (shm_begin(&c, mapobj, dpobj, idobj) < 0)
        goto done;
    if (n != c.ns || c.dp.n != c.m.sp.n || (sums != Py_None && (!PyTuple_CheckExact(sums) || PyTuple_GET_SIZE(sums) != n)))
        goto refuse;
    c.did = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    c.snap = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (c.did == NULL || c.snap == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int took = kvb_ids_take(didobj, gens, n, c.did, c.snap);
    if (took < 0)
        goto done;
    if (!took)
        goto refuse;
    int64_t hi = -1;
    for (Py_ssize_t k = 0; k < n; k++)
        hi = c.did[k] > hi ? c.did[k] : hi;
    if (n && !ids_fit(&c.dp, c.m.part, hi))
        goto refuse;
    int w = shm_wants(wantobj, n, c.want);
    if (w < 0)
        goto done;
    if (kvb_marks(marks, c.did, n, 1) <= 0)
        goto refuse;
    marked = 1;
    int code = w == 0 ? 1 : shm_copy(&c.m, raw, rawlen, c.sid, c.want, &c.dp, c.did, n, sums != Py_None, sums, gens,
                                     c.snap, between, &c.digests);
    if (code < 0)
        goto done;
    if (code == 0 && c.digests == Py_None) {
        kvb_marks(marks, c.did, n, 0);
        marked = 0;
        res = Py_NewRef(Py_True);
        goto done;
    }
    res = fallback_out(code, c.snap, n, Py_NewRef(code == 0 ? c.digests : Py_None));
    if (res != NULL)
        marked = 0;                              /* the caller's now */
    goto done;
refuse:
    res = Py_NewRef(Py_None);
done:
    if (marked)                                  /* an exception: nothing is the caller's */
        kvb_marks(marks, c.did, n, 0);
    shm_end(&c);
    return res;
}

/* blake2b_128(data) -> 16 bytes: the digest shm_read keys the table with (tests hold it to hashlib's) */
static PyObject *blake2b_128(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer in;
    if (!PyArg_ParseTuple(args, "y*", &in))
        return NULL;
    unsigned char out[16];
    kvb_blake2b(out, sizeof out, in.buf, (size_t)in.len);
    PyBuffer_Release(&in);
    return PyBytes_FromStringAndSize((const char *)out, sizeof out);
}

/* copy_threads(threads=None, spin_us=None) -> (threads, spin_us, jobs, helped, units, helper_units) */
static PyObject *copy_threads(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"threads", "spin_us", NULL};
    PyObject *tobj = Py_None, *sobj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|OO:copy_threads", names, &tobj, &sobj))
        return NULL;
    int threads;
    long spin;
    unsigned long long jobs, helped, units, uh;
    kvb_par_get(&threads, &spin, &jobs, &helped, &units, &uh);
    if (tobj != Py_None || sobj != Py_None) {
        long t = threads, sp = spin;
        if (tobj != Py_None && (!PyLong_Check(tobj) || PyBool_Check(tobj) || (t = PyLong_AsLong(tobj)) == -1)) {
            PyErr_Clear();
            t = -1;
        }
        if (sobj != Py_None && (!PyLong_Check(sobj) || PyBool_Check(sobj) || (sp = PyLong_AsLong(sobj)) == -1)) {
            PyErr_Clear();
            sp = -1;
        }
        if (t < 1 || t > 2 || kvb_par_config((int)t, sp) < 0) {
            PyErr_SetString(PyExc_ValueError, "copy_threads: threads must be 1 or 2 and spin_us an int in [0, 100000]");
            return NULL;
        }
        kvb_par_get(&threads, &spin, &jobs, &helped, &units, &uh);
    }
    return Py_BuildValue("(ilKKKK)", threads, spin, jobs, helped, units, uh);
}

/* stream_from([n]) -> int: the copy size from which copies stream past the caches (copyhash.h);
 * with n (>= 0), set first -- 0 restores the default (four times the L2, or KVBRIDGE_STREAM_FROM) */
static PyObject *stream_from(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t n = -1;
    if (!PyArg_ParseTuple(args, "|n", &n))
        return NULL;
    if (n >= 0)
        kvb_set_stream_from((size_t)n);
    return PyLong_FromSize_t(kvb_stream_from());
}

/* ------------------------------------------------------------------ the usual tcp fetch */
#define FETCH_STACK 256   /* request frames up to this many bytes are built on the stack */

/* fetch_whole(fd, ticket, rid, extra, nbytes, dst_planes, dst_ids, part, sums, gens, marks, timeout[, claim, fence])
 *
 * The receiver's usual fetch -- all of an unleased raw handle into whole host blocks -- in one
 * call: the destination ids checked and their generations taken, the blocks marked as landing
 * (`marks`, the pool's bytearray), the READ frame for handle bytes `ticket` (request id `rid`,
 * `extra` bytes behind it: deferred releases) sent, the reply received by now + `timeout`
 * seconds -- up to FETCH_BUFFERED block bytes in one receive into a private buffer, landed only
 * once its trailer vouched for it; more, header and fence first, then the block bytes straight
 * into the blocks (recv_parts: the deadline is looked at after each receive, which the socket's
 * SO_RCVTIMEO bounds), then the trailer -- each block hashed as it lands, the checksums
 * compared with `sums` (a tuple, or None: no verification), the generations compared again.
 * A large reply's trailer that does not vouch leaves bytes in the blocks: they are the
 * caller's, marked, and its pipeline fails or refetches them, as for any read.
 *
 *   None:  nothing sent, nothing marked: the ids are not `n` distinct ints of the pool, the
 *          blocks do not hold `nbytes`, or one is landing already -- the long way says which.
 *   True:  landed, its checksums equal to `sums`, the generations unchanged; marks undone
 *          (leased: left to the caller, see below).
 *   (code, gens, detail): it did not end so; the marks are the caller's to undo. code 0: a
 *          checksum differs (detail: each block's as it landed); 1, 2, 3: as read_small (detail:
 *          the reply's bytes; of a large reply, those besides its blocks); 4: a destination block's generation changed (detail: None);
 *          5: the deadline passed (detail: the bytes so far); 6: a send or receive failed
 *          (detail: the OSError). `gens`: the snapshot taken.
 * Any other exception (a signal's) undoes the marks first.
 *
 * Leased (optional `claim`, `fence`): `claim` is the request's claim field as the wire encodes it
 * (u64 epoch, u64 counter, u16 length, claimer: CLAIM_ME asks the owner to claim as it serves),
 * sent with flag F_CLAIM; `fence`, a bytearray of 16, receives the reply's fence once its header
 * passed (zeros before): the claim the read was served under, for every outcome but None. A
 * reply's fence of zeros on a leased read, or any other on an unleased one, is code 2. A leased
 * True leaves the marks to the caller, whose validate-after-read and release come next. */
#define FETCH_BUFFERED (64 * 1024)   /* replies with up to this many block bytes: one receive, then a copy */

static PyObject *fetch_whole(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    Py_buffer ticket, extra;
    unsigned long rid;
    long long nbytes, part;
    double timeout;
    Py_buffer claim = {0}, fence = {0};          /* fence held writable: it cannot be resized under the call */
    PyObject *dpobj, *idobj, *sums, *gens, *marks, *detail = NULL;
    if (!PyArg_ParseTuple(args, "iy*ky*LOOLOOO!d|y*w*", &fd, &ticket, &rid, &extra, &nbytes, &dpobj, &idobj, &part,
                          &sums, &gens, &PyByteArray_Type, &marks, &timeout, &claim, &fence))
        return NULL;
    int leased = claim.obj != NULL;
    PyObject *res = NULL;
    char *buf = NULL, *frame = NULL, stack[FETCH_STACK];
    int64_t *ids = NULL;
    uint64_t *snap = NULL;
    planes_t dp = {NULL, 0};
    int marked = 0;
    Py_ssize_t n = PyList_CheckExact(idobj) || PyTuple_CheckExact(idobj) ? PySequence_Fast_GET_SIZE(idobj) : -1;
    if (n < 0 || nbytes < 0 || nbytes > ((int64_t)1 << 50) || !PyList_CheckExact(gens)
            || (sums != Py_None && (!PyTuple_CheckExact(sums) || PyTuple_GET_SIZE(sums) != n))
            || (leased && (fence.obj == NULL || fence.len != FENCE_LEN || claim.len < 18 || claim.len > 18 + 0xFFFF)))
        goto refuse;
    if (leased)
        memset(fence.buf, 0, FENCE_LEN);
    if (get_planes(dpobj, &dp) < 0)
        goto done;
    if ((double)part * (double)n * (double)dp.n != (double)nbytes)
        goto refuse;
    ids = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    snap = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (ids == NULL || snap == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int took = kvb_ids_take(idobj, gens, n, ids, snap);
    if (took < 0)
        goto done;
    if (!took)
        goto refuse;
    int64_t hi = -1;
    for (Py_ssize_t k = 0; k < n; k++)
        hi = ids[k] > hi ? ids[k] : hi;
    if (n && !ids_fit(&dp, part, hi))            /* every block within every plane (get_ids' check) */
        goto refuse;
    int m = kvb_marks(marks, ids, n, 1);
    if (m <= 0)
        goto refuse;
    marked = 1;
    /* the frame: header, u32 ticket length, ticket, flags (0: a whole unleased read; F_CLAIM and
     * the claim: a whole leased one), extra */
    Py_ssize_t plen = 4 + ticket.len + 1 + (leased ? claim.len : 0), flen = HEAD_LEN + plen + extra.len;
    frame = flen <= FETCH_STACK ? stack : PyMem_Malloc((size_t)flen);
    int large = nbytes > FETCH_BUFFERED;        /* its blocks received straight into place */
    Py_ssize_t total = HEAD_LEN + FENCE_LEN + (Py_ssize_t)nbytes + TRAILER_LEN;
    Py_ssize_t want = large ? HEAD_LEN + FENCE_LEN : total;
    buf = PyMem_Malloc((size_t)(want + TRAILER_LEN));
    if (frame == NULL || buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned char *f = (unsigned char *)frame;
    f[0] = 'K';
    f[1] = 'B';
    f[2] = WIRE_VERSION;
    f[3] = KIND_READ;
    put_be(f + 4, (uint64_t)(rid & 0xFFFFFFFFUL), 4);
    put_be(f + 8, (uint64_t)plen, 8);
    put_be(f + HEAD_LEN, (uint64_t)ticket.len, 4);
    memcpy(f + HEAD_LEN + 4, ticket.buf, (size_t)ticket.len);
    f[HEAD_LEN + 4 + ticket.len] = leased ? F_CLAIM : 0;
    if (leased)
        memcpy(f + HEAD_LEN + 4 + ticket.len + 1, claim.buf, (size_t)claim.len);
    memcpy(f + HEAD_LEN + plen, extra.buf, (size_t)extra.len);
    int64_t deadline = mono_ns() + (int64_t)(timeout * 1e9);
    int code = 0, late;
    Py_ssize_t had = 0, got;
    if (io_loop(fd, frame, flen, flen, 1, 0, &late) < 0)
        goto failed;
    got = io_loop(fd, buf, large ? HEAD_LEN : want, HEAD_LEN, 0, deadline, &late);   /* large: the header alone */
    if (got == -1)
        goto failed;
    had = got;
    if (got <= 0) {
        code = late ? 5 : 3;
        had = got == 0 ? 0 : -2 - got;
        goto fallback;
    }
    const unsigned char *h = (const unsigned char *)buf;
    uint32_t got_id = ((uint32_t)h[4] << 24) | ((uint32_t)h[5] << 16) | ((uint32_t)h[6] << 8) | h[7];
    if (h[0] != 'K' || h[1] != 'B' || h[2] != WIRE_VERSION || h[3] != KIND_DATA || got_id != (uint32_t)rid
            || be64(h + 8) != (uint64_t)(total - HEAD_LEN)) {
        code = 1;
        goto fallback;
    }
    if (got < want) {                          /* the rest of a small reply, or a large one's fence */
        Py_ssize_t more = io_loop(fd, buf + got, want - got, want - got, 0, deadline, &late);
        if (more == -1)
            goto failed;
        if (more <= 0) {
            code = late ? 5 : 3;
            had = got + (more == 0 ? 0 : -2 - more);
            goto fallback;
        }
    }
    had = want;
    int fenced = be64(h + HEAD_LEN) || be64(h + HEAD_LEN + 8);
    if (fenced != leased) {                    /* a fence on an unleased read, none on a leased one */
        code = 2;
        goto fallback;
    }
    if (leased)
        memcpy(fence.buf, h + HEAD_LEN, FENCE_LEN);
    PyObject *digests;
    if (large) {
        long long received;
        int lcode = recv_hashed(fd, &dp, ids, n, part, sums != Py_None, Py_None, deadline, &received, &digests);
        if (lcode < 0)
            goto failed;
        if (lcode > 0) {
            code = lcode == 1 ? 3 : 5;
            goto fallback;
        }
        got = io_loop(fd, buf + want, TRAILER_LEN, TRAILER_LEN, 0, deadline, &late);
        if (got <= 0) {
            Py_XDECREF(digests);
            if (got == -1)
                goto failed;
            code = late ? 5 : 3;
            goto fallback;
        }
        had = want + TRAILER_LEN;
    }
    const unsigned char *t = h + had - TRAILER_LEN;   /* a small reply: checked before it lands */
    if (t[0] || t[1] || t[2] || t[3]) {
        if (large)
            Py_XDECREF(digests);
        code = 2;
        goto fallback;
    }
    if (!large) {
        digests = scatter_wire(&dp, ids, n, buf + HEAD_LEN + FENCE_LEN, part, sums != Py_None);
        if (digests == NULL)
            goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {        /* the blocks' generations as the fetch began? */
        PyObject *g = PyList_GET_SIZE(gens) > ids[k] ? PyList_GET_ITEM(gens, ids[k]) : NULL;
        unsigned long long now = g ? PyLong_AsUnsignedLongLong(g) : 0;
        if (g == NULL || (now == (unsigned long long)-1 && PyErr_Occurred()) || now != snap[k]) {
            PyErr_Clear();
            Py_XDECREF(digests);
            code = 4;
            goto fallback;
        }
    }
    if (sums != Py_None) {
        int same = 1;
        for (Py_ssize_t k = 0; k < n && same; k++) {
            unsigned long long want_sum = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(sums, k));
            if (want_sum == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                same = 0;
            } else
                same = want_sum == PyLong_AsUnsignedLongLong(PyList_GET_ITEM(digests, k));
        }
        if (!same) {
            detail = digests;                        /* each block's checksum as it landed */
            code = 0;
            goto fallback;
        }
    }
    Py_XDECREF(digests);
    if (!leased)                                 /* leased: the caller's validate-after-read and release follow */
        kvb_marks(marks, ids, n, 0);
    marked = 0;
    res = Py_NewRef(Py_True);
    goto done;
failed:                                          /* an OSError is the caller's to map; a signal raises */
    if (!PyErr_ExceptionMatches(PyExc_OSError))
        goto done;
    code = 6;
fallback: {
        if (code == 6) {
            PyObject *tb = NULL, *type = NULL;
            PyErr_Fetch(&type, &detail, &tb);
            PyErr_NormalizeException(&type, &detail, &tb);
            Py_XDECREF(type);
            Py_XDECREF(tb);
        } else if (code == 4) {
            detail = Py_NewRef(Py_None);
        } else if (code != 0) {
            detail = PyBytes_FromStringAndSize(buf, had);
        }
        res = fallback_out(code, snap, n, detail);
        if (res != NULL)
            marked = 0;                              /* the caller's now */
        goto done;
    }
refuse:
    res = Py_NewRef(Py_None);
done:
    if (marked)                                      /* an exception: nothing is the caller's */
        kvb_marks(marks, ids, n, 0);
    PyBuffer_Release(&ticket);
    PyBuffer_Release(&extra);
    if (claim.obj != NULL)
        PyBuffer_Release(&claim);
    if (fence.obj != NULL)
        PyBuffer_Release(&fence);
    if (frame != stack)
        PyMem_Free(frame);
    PyMem_Free(buf);
    PyMem_Free(ids);
    PyMem_Free(snap);
    PyMem_Free(dp.p);
    return res;
}

static PyMethodDef methods[] = {
    {"shm_fetch", shm_fetch, METH_VARARGS,
     "shm_fetch(mapping, raw, ids, want, dst_planes, dst_ids, sums, gens, marks, between) -> None | True | (code, gens, "
     "digests): the receiver's usual shm:// fetch in one call: destination ids checked, generations taken, blocks "
     "marked, shm_read's checks and copy held to that snapshot (see kvcopy.c)"},
    {"copy_threads", (PyCFunction)(void (*)(void))copy_threads, METH_VARARGS | METH_KEYWORDS,
     "copy_threads(threads=None, spin_us=None) -> (threads, spin_us, jobs, helped, units, helper_units): the "
     "threads that share a copy of 1 MiB or more in two parts or more (1, or 2: one helper), how long the "
     "helper polls for the next job before it sleeps; copies offered to the helper, those it took part in, "
     "their units, the helper's units"},
    {"stream_from", stream_from, METH_VARARGS,
     "stream_from([n]) -> int: the size of a copy (bytes) from which its stores go past the caches; n sets it "
     "(0: the default, four times this core's L2 or KVBRIDGE_STREAM_FROM)"},
    {"hash_blocks", hash_blocks, METH_VARARGS,
     "hash_blocks(planes, ids, part, group) -> xxh3-64 per (group of planes, block), group-major"},
    {"copy_blocks", copy_blocks, METH_VARARGS,
     "copy_blocks(dst_planes, dst_ids, src_planes, src_ids, part, hash) -> per-block xxh3-64 of the landed "
     "bytes, or None"},
    {"gather_blocks", gather_blocks, METH_VARARGS,
     "gather_blocks(planes, ids, part, head, tail) -> bytearray: head zeros, the blocks in wire order, tail zeros"},
    {"scatter_blocks", scatter_blocks, METH_VARARGS,
     "scatter_blocks(dst_planes, dst_ids, src, offset, part, hash) -> per-block xxh3-64 of the landed bytes, or None"},
    {"read_small", read_small, METH_VARARGS,
     "read_small(fd, frame, rid, nbytes, dst_planes, dst_ids, part, hash, claimed) -> (code, ...): a tcp small "
     "read's request sent and its reply taken and landed in one call"},
    {"fetch_whole", fetch_whole, METH_VARARGS,
     "fetch_whole(fd, ticket, rid, extra, nbytes, dst_planes, dst_ids, part, sums, gens, marks, timeout[, claim, fence]) -> None | "
     "True | (code, gens, detail): the receiver's usual tcp fetch in one call (see native/cpu/kvcopy.c)"},
    {"land", kvb_land, METH_VARARGS,
     "land(marks, ids, on) -> bool: landing marks set (True where none was set; nothing set otherwise) or unset"},
    {"serve_small", serve_small, METH_VARARGS,
     "serve_small(fd, payload, rid, table, id_offset, gens, planes, part) -> int: a whole small read of an "
     "indexed handle answered in one call; -1 where nothing was served"},
    {"serve_next", serve_next, METH_VARARGS,
     "serve_next(fd, buf, table, id_offset, gens, planes, part, pool, pinned, served) -> (served, used, received, "
     "count): receives into buf, answering whole small READs in the same call while each receive brings one"},
    {"recv_blocks", recv_blocks, METH_VARARGS,
     "recv_blocks(fd, dst_planes, dst_ids, part, hash, cancel) -> (code, received, digests): a DATA reply's "
     "block bytes received straight into the blocks, each block hashed as its pieces land"},
    {"blake2b_128", blake2b_128, METH_VARARGS,
     "blake2b_128(data) -> the 16-byte BLAKE2b digest shm_read keys the live-handle table with"},
    {"dst_snapshot", kvb_dst_snapshot, METH_VARARGS,
     "dst_snapshot(ids, gens, n) -> (ids, their generations) as new lists, or None where the ids are not n "
     "distinct ints in [0, len(gens)) (see native/cpu/dstids.c)"},
    {"shm_read", shm_read, METH_VARARGS,
     "shm_read(mapping, raw, ids, want, dst_planes, dst_ids, hash, expect, between) "
     "-> (code, digests): an shm one-sided read checked, copied and checked again in one call"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvbridge._kvcopy",
    "Block copies and xxh3-64 block checksums in one pass (see native/cpu/kvcopy.c).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kvcopy(void) {
    PyObject *m = PyModule_Create(&module);
    /* FUSED: where copies with a hash take one pass (copyhash.c: x86-64), 1 with AVX2, 2 with AVX-512F */
    if (m != NULL && (PyModule_AddIntConstant(m, "FUSED", kvb_copy_hash_fused()) < 0
                      || PyModule_AddIntConstant(m, "WIRE_VERSION", WIRE_VERSION) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
