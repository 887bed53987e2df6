/* kvbridge._kvcopy: one helper thread that takes part of a large copy (see helper.c).
 *
 * A job is `n` independent units. The calling thread runs units 0 .. from-1; the helper, once
 * it has taken the job, runs units from `from` upwards, and the caller, done with its own,
 * takes the rest from the last unit downwards until the two meet: each unit of that range
 * claimed by one atomic compare-and-swap, so every unit runs exactly once and neither waits
 * while the other falls behind. `run(ctx, u, on_helper)` must only touch its own unit's
 * memory and the running thread's share of `ctx`. The caller returns only once no unit is
 * running on the helper. Without a helper (configured off, not on Linux, busy with another
 * thread's job, or the thread could not be started) the caller runs every unit itself; a helper
 * that wakes too late finds the units taken, and the caller never waits for a helper that has
 * not taken the job. */
#ifndef KVB_HELPER_H
#define KVB_HELPER_H

#include <stddef.h>

typedef void (*kvb_unit_fn)(void *ctx, size_t u, int on_helper);

/* Returns how many units the helper ran. `late_ns` > 0: a helper that takes the job more than
 * that long after it was posted runs none of it (0: it takes what is left, however late).
 * `wake` 0: the job is offered only to a helper that is polling for one (not started or asleep:
 * the caller runs it alone, with no system call -- but for a helper that fell asleep between
 * that look and the post, which is woken). */
size_t kvb_par_run(void *ctx, size_t n, size_t from, kvb_unit_fn run, long long late_ns, int wake);

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
