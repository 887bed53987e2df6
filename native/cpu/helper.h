/* kvbridge._kvcopy: one helper thread that takes part of a large copy (see helper.c).
 *
 * A job is `n` units. The calling thread runs them in order from unit 0; the helper, once it
 * has taken the job, runs the units from `from` on that the caller has not reached, each
 * claimed by one atomic compare-and-swap, so that every unit runs exactly once. The caller
 * then meets each of the helper's units in order, waits until it is done and calls
 * `fold(ctx, u)` for it (may be NULL). `run(ctx, u, on_helper)` must only touch memory of its
 * own unit and the helper's share of `ctx`. Without a helper (configured off, not on Linux,
 * busy with another thread's job, or the thread could not be started) the caller runs every
 * unit itself; a helper that wakes too late finds the units taken and does nothing, and the
 * caller never waits for a helper that has not taken the job. */
#ifndef KVB_HELPER_H
#define KVB_HELPER_H

#include <stddef.h>

typedef void (*kvb_unit_fn)(void *ctx, size_t u, int on_helper);
typedef void (*kvb_fold_fn)(void *ctx, size_t u);

/* Returns how many units the helper ran. */
size_t kvb_par_run(void *ctx, size_t n, size_t from, kvb_unit_fn run, kvb_fold_fn fold);

/* 1 where a job may be shared now (configured on; Linux). */
int kvb_par_on(void);

/* Configure: threads 1 (off) or 2 (one helper); spin_us, how long the helper polls for the next
 * job before it sleeps (0..100000). Returns 0, or -1 for values out of range. */
int kvb_par_config(int threads, long spin_us);
/* The settings, and since the process started: jobs shared, jobs the helper took part in,
 * their units, the helper's units. */
void kvb_par_get(int *threads, long *spin_us, unsigned long long *jobs, unsigned long long *helped,
                 unsigned long long *units, unsigned long long *units_helper);

#endif
