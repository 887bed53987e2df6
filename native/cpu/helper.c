/* kvbridge._kvcopy: one helper thread that takes part of a large copy (see helper.h).
 *
 * One job at a time (a mutex, tried, never waited for: a second caller runs alone). The job
 * word goes IDLE -> POSTED (the caller) -> RUNNING (the helper took it) -> FINISHED (the
 * helper let go of it) -> IDLE; a caller that finishes before the helper took the job takes
 * it back (POSTED -> IDLE) and returns at once. The units from `from` on are claimed with one
 * compare-and-swap each (FREE -> MINE by the caller, FREE -> TAKEN by the helper,
 * which stops at the first unit it cannot claim: the caller's, from the end). After a job the
 * helper polls for the next one for `spin_us` (with the CPU's pause instruction), then sleeps
 * on a futex; a caller wakes it only when it sleeps, and only for a job worth it (`wake`: else
 * the job is shared only with a helper already polling). A helper that takes a job later than its
 * caller's `late_ns` after it was posted leaves it to the caller (a job of few large units: the
 * caller would otherwise wait for the helper's last unit past the time it needed alone). The helper blocks every signal, and a
 * forked child starts without one (a new one is started there on its first shared job). */
#define _GNU_SOURCE
#include "helper.h"

#include <stdint.h>
#include <string.h>

#if defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define KVB_PAR 1
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

#define LD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define ST(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

static int cfg_threads = 1;
static long cfg_spin_us = 50;
static unsigned long long n_jobs, n_helped, n_units, n_units_helper;

#ifdef KVB_PAR
enum { FREE = 0, MINE = 1, TAKEN = 2 };                      /* a unit */
enum { IDLE = 0, POSTED = 1, RUNNING = 2, FINISHED = 3 };    /* the job */
#define MAX_UNITS 4096

static struct {
    pthread_mutex_t mu;
    int started, atfork, failed;
    uint32_t bell;              /* the futex word: bumped on every post */
    int sleeping, job;
    void *ctx;
    size_t n, from, did;
    long long start_by;         /* CLOCK_MONOTONIC ns past which the helper leaves the job alone; 0: none */
    kvb_unit_fn run;
    unsigned char state[MAX_UNITS];
} H = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0, 0, IDLE, NULL, 0, 0, 0, 0, NULL, {0}};

static void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Spin until the job is `want`; after a while let others run (a helper preempted mid-unit). */
static void await_job(int want) {
    for (unsigned i = 0; LD(&H.job) != want; i++) {
        if (i < 20000)
            relax();
        else
            sched_yield();
    }
}

static void *helper_main(void *arg) {
    (void)arg;
    for (;;) {
        long long deadline = now_ns() + __atomic_load_n(&cfg_spin_us, __ATOMIC_RELAXED) * 1000LL;
        for (unsigned poll = 1; LD(&H.job) != POSTED; poll++) {
            relax();
            if ((poll & 63) == 0 && now_ns() > deadline) {
                __atomic_store_n(&H.sleeping, 1, __ATOMIC_SEQ_CST);
                uint32_t b = __atomic_load_n(&H.bell, __ATOMIC_SEQ_CST);
                if (__atomic_load_n(&H.job, __ATOMIC_SEQ_CST) != POSTED)
                    syscall(SYS_futex, &H.bell, FUTEX_WAIT_PRIVATE, b, NULL, NULL, 0);
                __atomic_store_n(&H.sleeping, 0, __ATOMIC_SEQ_CST);
                deadline = now_ns() + __atomic_load_n(&cfg_spin_us, __ATOMIC_RELAXED) * 1000LL;
            }
        }
        int expect = POSTED;
        if (!__atomic_compare_exchange_n(&H.job, &expect, RUNNING, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;                                   /* taken back by its caller */
        size_t did = 0;
        if (H.start_by && now_ns() > H.start_by) {     /* too late to help: the caller is well into it */
            H.did = 0;
            ST(&H.job, FINISHED);
            continue;
        }
        for (size_t u = H.from; u < H.n; u++) {
            unsigned char f = FREE;
            if (!__atomic_compare_exchange_n(&H.state[u], &f, TAKEN, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                break;                                  /* the caller's, and all above it */
            H.run(H.ctx, u, 1);
            did++;
        }
        H.did = did;
        ST(&H.job, FINISHED);
    }
    return NULL;
}

static void after_fork_child(void) {
    pthread_mutex_init(&H.mu, NULL);
    H.started = 0;
    H.failed = 0;
    H.sleeping = 0;
    H.job = IDLE;
}

/* The child's reset is registered when the library is loaded, before the one-job lock can first
 * be taken: registered on the first shared job instead, a fork while that job's thread held the
 * lock and had not yet registered left the child a lock no one would release (never shared). */
__attribute__((constructor)) static void register_fork_reset(void) {
    H.atfork = pthread_atfork(NULL, NULL, after_fork_child) == 0;
}

static int ensure_started(void) {
    if (H.started)
        return 1;
    if (!H.atfork || H.failed)  /* no reset for a forked child, or no thread to be had: no helper */
        return 0;
    pthread_attr_t attr;
    pthread_t t;
    sigset_t all, old;
    cpu_set_t cpus;
    if (pthread_attr_init(&attr) != 0)
        return 0;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 << 10);
    /* the CPUs of the process's main thread, not those of the thread whose copy starts it (a
     * thread pinned to one CPU would otherwise pin its helper beside it) */
    if (sched_getaffinity(getpid(), sizeof cpus, &cpus) == 0)
        pthread_attr_setaffinity_np(&attr, sizeof cpus, &cpus);
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);            /* the helper inherits a full mask */
    int rc = pthread_create(&t, &attr, helper_main, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        H.failed = 1;           /* not tried again on every copy (a forked child tries afresh) */
        return 0;
    }
    pthread_setname_np(t, "kvbridge-copy");
    H.started = 1;
    return 1;
}
#endif

int kvb_par_on(void) {
#ifdef KVB_PAR
    return __atomic_load_n(&cfg_threads, __ATOMIC_RELAXED) > 1;
#else
    return 0;
#endif
}

size_t kvb_par_run(void *ctx, size_t n, size_t from, kvb_unit_fn run, long long late_ns, int wake) {
#ifdef KVB_PAR
    if (from == 0)
        from = 1;
    if (!wake && (!H.started || __atomic_load_n(&H.sleeping, __ATOMIC_SEQ_CST)))
        goto alone;                                     /* not worth waking it for */
    if (kvb_par_on() && n >= 2 && n <= MAX_UNITS && from < n && pthread_mutex_trylock(&H.mu) == 0) {
        if (!ensure_started()) {
            pthread_mutex_unlock(&H.mu);
            goto alone;
        }
        memset(H.state, FREE, n);
        H.ctx = ctx, H.n = n, H.from = from, H.run = run, H.did = 0;
        H.start_by = late_ns > 0 ? now_ns() + late_ns : 0;
        __atomic_store_n(&H.job, POSTED, __ATOMIC_SEQ_CST);
        __atomic_add_fetch(&H.bell, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&H.sleeping, __ATOMIC_SEQ_CST))
            syscall(SYS_futex, &H.bell, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
        for (size_t u = 0; u < from; u++)             /* never the helper's */
            run(ctx, u, 0);
        for (size_t u = n; u-- > from;) {               /* then from the end down to the helper */
            unsigned char f = FREE;
            if (!__atomic_compare_exchange_n(&H.state[u], &f, MINE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                break;
            run(ctx, u, 0);
        }
        int expect = POSTED;
        size_t did = 0;
        if (!__atomic_compare_exchange_n(&H.job, &expect, IDLE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            await_job(FINISHED);                        /* taken: it lets go once past its last unit */
            did = H.did;
            ST(&H.job, IDLE);
        }
        __atomic_add_fetch(&n_jobs, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&n_units, n, __ATOMIC_RELAXED);
        __atomic_add_fetch(&n_units_helper, did, __ATOMIC_RELAXED);
        if (did)
            __atomic_add_fetch(&n_helped, 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&H.mu);
        return did;
    }
alone:
#endif
    for (size_t u = 0; u < n; u++)
        run(ctx, u, 0);
    return 0;
}

int kvb_par_config(int threads, long spin_us) {
    if (threads < 1 || threads > 2 || spin_us < 0 || spin_us > 100000)
        return -1;
#ifndef KVB_PAR
    threads = 1;                /* nothing is shared here (no helper off Linux): say so */
#endif
    __atomic_store_n(&cfg_threads, threads, __ATOMIC_RELAXED);
    __atomic_store_n(&cfg_spin_us, spin_us, __ATOMIC_RELAXED);
    return 0;
}

void kvb_par_get(int *threads, long *spin_us, unsigned long long *jobs, unsigned long long *helped,
                 unsigned long long *units, unsigned long long *units_helper) {

    *units = __atomic_load_n(&n_units, __ATOMIC_RELAXED);
    *units_helper = __atomic_load_n(&n_units_helper, __ATOMIC_RELAXED);
    *threads = __atomic_load_n(&cfg_threads, __ATOMIC_RELAXED);
    *spin_us = __atomic_load_n(&cfg_spin_us, __ATOMIC_RELAXED);
    *jobs = __atomic_load_n(&n_jobs, __ATOMIC_RELAXED);
    *helped = __atomic_load_n(&n_helped, __ATOMIC_RELAXED);
}
