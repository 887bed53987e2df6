/* kvbridge._kvcopy: a copy and its xxh3-64 in one pass over the bytes (see copyhash.h).
 *
 * XXH3-64 (seed 0, default secret) of an input longer than 240 bytes, as xxHash computes it
 * (XXH3_hashLong_64b_internal): accumulators start at XXH3_INIT_ACC; each of the
 * R = (len - 1) / 64 leading 64-byte stripes is accumulated with the secret at (k % 16) * 8 and
 * the accumulators are scrambled after every 16th; the last 64 bytes of the input (which
 * overlap the stripes before them) are accumulated once more with the secret at 121; the
 * accumulators merge into the digest with len * PRIME64_1. Here each stripe is loaded once,
 * stored to the destination and accumulated from the same registers (AVX2, or AVX-512F in one
 * register where the CPU has it: half the instructions, which decides the speed once the bytes
 * are in cache), so the copy costs
 * no second read of the bytes and its loads and stores overlap the hash's arithmetic. Everything
 * but the fused stripe loop is xxHash's own code (XXH_INLINE_ALL: private to this file).
 */
#define XXH_INLINE_ALL
#include "xxhash.h"
#include "copyhash.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVB_AVX2 1
#include <immintrin.h>
#endif

#define STRIPE 64
#define STRIPES_PER_BLOCK 16                       /* (secret size 192 - 64) / 8 */
#define SECRET_SCRAMBLE (XXH_SECRET_DEFAULT_SIZE - STRIPE)
/* Blocks from this size take the 512-bit pass where there is one. Below it the two passes
 * measured the same (bench/copyhash.py, 4 and 16 KiB, within its noise), so small blocks keep
 * the 256-bit one; the 512-bit pass pays off from 64 KiB up, most at 1 MiB. */
#define WIDE_FROM (16u << 10)
/* The 512-bit pass asks for the source's line this far ahead of the stripe it copies, into L1
 * (one prefetch per line). On the AMD EPYC (Zen 5) VM measured, reading a 1 MiB block (two 512 KiB
 * parts) out of another process's /dev/shm mapping after a 1 MiB memmove elsewhere: 22.6 -> 19.6 us
 * in C alone, and the whole one-sided shm_read call 25.7-26.9 -> 23.0-23.8 us in five of eight
 * in-process runs alternated with the build without it (25.3, 28.4 and 30.0 us in busy spells). 1, 2 and 4 KiB ahead measured the same; into L2
 * (T1) was slower than none. bench/copyhash.py (private buffers) did not change, at any size.
 * It also asks for the destination's line as far ahead, for writing (PREFETCHW: the store finds
 * its line owned), and sums a block's stripes before the one lane swap (below): 1 MiB from a
 * shared mapping after a 1 MiB memmove elsewhere, one process alternating both builds per call,
 * 7 x 800 calls, three runs: 0.93-0.96x -> 0.94-0.98x memmove (the same digests). */
#define PREFETCH_AHEAD 1024

#ifdef KVB_AVX2
/* `n` stripes from src to dst, accumulated as xxHash's AVX2 XXH3_accumulate_512 does, the
 * accumulators scrambled after every 16th stripe of the whole input (`k`: stripes before).
 * `nt`: streaming stores past the caches (dst 32-byte aligned; the caller fences). */
__attribute__((target("avx2"))) static void stripes_avx2(uint64_t *acc, char *dst, const char *src, size_t n,
                                                         size_t k, int nt) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    const unsigned char *secret = XXH3_kSecret;
    const __m256i prime32 = _mm256_set1_epi32((int)XXH_PRIME32_1);
    for (size_t i = 0; i < n; i++, k++, src += STRIPE, dst += STRIPE) {
        const unsigned char *key = secret + (k % STRIPES_PER_BLOCK) * 8;
        __m256i d0 = _mm256_loadu_si256((const __m256i *)src);
        __m256i d1 = _mm256_loadu_si256((const __m256i *)(src + 32));
        if (nt) {
            _mm_prefetch(src + PREFETCH_AHEAD, _MM_HINT_NTA);
            _mm256_stream_si256((__m256i *)dst, d0);
            _mm256_stream_si256((__m256i *)(dst + 32), d1);
        } else {
            _mm256_storeu_si256((__m256i *)dst, d0);
            _mm256_storeu_si256((__m256i *)(dst + 32), d1);
        }
        __m256i dk0 = _mm256_xor_si256(d0, _mm256_loadu_si256((const __m256i *)key));
        __m256i dk1 = _mm256_xor_si256(d1, _mm256_loadu_si256((const __m256i *)(key + 32)));
        __m256i p0 = _mm256_mul_epu32(dk0, _mm256_srli_epi64(dk0, 32));
        __m256i p1 = _mm256_mul_epu32(dk1, _mm256_srli_epi64(dk1, 32));
        a0 = _mm256_add_epi64(p0, _mm256_add_epi64(a0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2))));
        a1 = _mm256_add_epi64(p1, _mm256_add_epi64(a1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2))));
        if (k % STRIPES_PER_BLOCK == STRIPES_PER_BLOCK - 1) {          /* XXH3_scrambleAcc_avx2 */
            const unsigned char *s = secret + SECRET_SCRAMBLE;
            __m256i x0 = _mm256_xor_si256(_mm256_xor_si256(a0, _mm256_srli_epi64(a0, 47)),
                                          _mm256_loadu_si256((const __m256i *)s));
            __m256i x1 = _mm256_xor_si256(_mm256_xor_si256(a1, _mm256_srli_epi64(a1, 47)),
                                          _mm256_loadu_si256((const __m256i *)(s + 32)));
            a0 = _mm256_add_epi64(_mm256_mul_epu32(x0, prime32),
                                  _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x0, 32), prime32), 32));
            a1 = _mm256_add_epi64(_mm256_mul_epu32(x1, prime32),
                                  _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x1, 32), prime32), 32));
        }
    }
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
}

/* stripes_avx2 with one 512-bit register per stripe, as xxHash's XXH3_accumulate_512_avx512
 * and XXH3_scrambleAcc_avx512 do: half the instructions per stripe, the same results. Whole
 * xxh3 blocks (16 stripes from a scramble) are unrolled, so their secret offsets are constants. */
/* One stripe: loaded, stored, and its product lo32(d ^ key) * hi32(d ^ key) added to `a`; the
 * stripe itself comes back in `*d` (its lanes go to the accumulator swapped, see below). */
__attribute__((target("avx512f,prfchw"))) static inline __m512i stripe_avx512(__m512i a, char *dst, const char *src,
                                                                             const unsigned char *key, __m512i *d,
                                                                             int nt) {
    if (nt) {                         /* dst 64-byte aligned; nothing of it is wanted in cache */
        _mm_prefetch(src + PREFETCH_AHEAD, _MM_HINT_NTA);
        *d = _mm512_loadu_si512((const void *)src);
        _mm512_stream_si512((void *)dst, *d);
    } else {
        _mm_prefetch(src + PREFETCH_AHEAD, _MM_HINT_T0);
        __builtin_prefetch(dst + PREFETCH_AHEAD, 1, 3);
        *d = _mm512_loadu_si512((const void *)src);
        _mm512_storeu_si512((void *)dst, *d);
    }
    __m512i dk = _mm512_xor_si512(*d, _mm512_loadu_si512((const void *)key));
    return _mm512_add_epi64(a, _mm512_mul_epu32(dk, _mm512_srli_epi64(dk, 32)));
}

/* xxh3 adds each stripe to the accumulator with its 64-bit lanes swapped in pairs; the swap is a
 * lane permutation, so the stripes of a block are summed as they are and swapped once. */
__attribute__((target("avx512f"))) static inline __m512i swapped(__m512i d) {
    return _mm512_shuffle_epi32(d, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2));
}

__attribute__((target("avx512f,prfchw"))) static void stripes_avx512(uint64_t *acc, char *dst, const char *src,
                                                             size_t n, size_t k, int nt) {
    __m512i a = _mm512_loadu_si512((const void *)acc);
    const unsigned char *secret = XXH3_kSecret;
    const __m512i prime32 = _mm512_set1_epi32((int)XXH_PRIME32_1);
    const __m512i scramble = _mm512_loadu_si512((const void *)(secret + SECRET_SCRAMBLE));
    while (n) {
        size_t m = 1;
        __m512i d;
        if (k % STRIPES_PER_BLOCK == 0 && n >= STRIPES_PER_BLOCK) {
            m = STRIPES_PER_BLOCK;
            __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 16
            for (int j = 0; j < STRIPES_PER_BLOCK; j++) {
                a = stripe_avx512(a, dst + j * STRIPE, src + j * STRIPE, secret + j * 8, &d, nt);
                sum = _mm512_add_epi64(sum, d);
            }
            a = _mm512_add_epi64(a, swapped(sum));
        } else {
            a = stripe_avx512(a, dst, src, secret + (k % STRIPES_PER_BLOCK) * 8, &d, nt);
            a = _mm512_add_epi64(a, swapped(d));
        }
        k += m, n -= m, src += m * STRIPE, dst += m * STRIPE;
        if (k % STRIPES_PER_BLOCK == 0) {                       /* XXH3_scrambleAcc_avx512 */
            __m512i x = _mm512_xor_si512(_mm512_xor_si512(a, _mm512_srli_epi64(a, 47)), scramble);
            a = _mm512_add_epi64(_mm512_mul_epu32(x, prime32),
                                 _mm512_slli_epi64(_mm512_mul_epu32(_mm512_srli_epi64(x, 32), prime32), 32));
        }
    }
    _mm512_storeu_si512((void *)acc, a);
}
#endif

#ifdef KVB_AVX2
__attribute__((target("avx2"))) static void stream_avx2(char *dst, const char *src, size_t n) {
    size_t head = (size_t)(-(uintptr_t)dst & 31);      /* to dst's first 32-byte boundary */
    if (head > n)
        head = n;
    memmove(dst, src, head);
    dst += head, src += head, n -= head;
    size_t body = n & ~(size_t)127;
    for (size_t i = 0; i < body; i += 128) {
        _mm_prefetch(src + i + PREFETCH_AHEAD, _MM_HINT_NTA);
        _mm_prefetch(src + i + PREFETCH_AHEAD + 64, _MM_HINT_NTA);
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), e);
    }
    _mm_sfence();
    memmove(dst + body, src + body, n - body);
}
#endif

void kvb_stream_copy(char *dst, const char *src, size_t n) {
#ifdef KVB_AVX2
    if (kvb_copy_hash_fused() >= 1 && n >= 256) {
        stream_avx2(dst, src, n);
        return;
    }
#endif
    memmove(dst, src, n);
}

static size_t from = 0;

void kvb_set_stream_from(size_t n) {
    from = n;
}

size_t kvb_stream_from(void) {
    if (from == 0) {
        const char *env = getenv("KVBRIDGE_STREAM_FROM");
        char *end = NULL;
        int digits = env && *env >= '0' && *env <= '9';   /* strtoull would take "-5" as 2^64 - 5 */
        unsigned long long v = digits ? strtoull(env, &end, 10) : 0;
        if (digits && end && *end == 0 && v > 0) {
            from = (size_t)v;
        } else {
            long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
            from = l2 > 0 ? 4 * (size_t)l2 : (size_t)4 << 20;
        }
    }
    return from;
}

int kvb_copy_hash_fused(void) {
#ifdef KVB_AVX2
    static int have = -1;
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return have;
#else
    return 0;
#endif
}

#define COMBINE_BATCH 128

uint64_t kvb_combine(const uint64_t *pd, size_t np, size_t step) {
    unsigned char buf[8 * COMBINE_BATCH];
    if (np <= COMBINE_BATCH) {
        for (size_t i = 0; i < np; i++)
            XXH_writeLE64(buf + 8 * i, pd[i * step]);
        return XXH3_64bits(buf, 8 * np);
    }
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    for (size_t i = 0; i < np;) {
        size_t m = np - i < COMBINE_BATCH ? np - i : COMBINE_BATCH;
        for (size_t q = 0; q < m; q++)
            XXH_writeLE64(buf + 8 * q, pd[(i + q) * step]);
        XXH3_64bits_update(&st, buf, 8 * m);
        i += m;
    }
    return XXH3_64bits_digest(&st);
}

uint64_t kvb_copy_hash(char *dst, const char *src, size_t len, int level, int stream) {
    if (level > kvb_copy_hash_fused())
        level = kvb_copy_hash_fused();
    if (len <= 240 || level <= 0) {   /* xxHash's short paths need the whole input */
        memmove(dst, src, len);
        return XXH3_64bits(dst, len);
    }
#ifdef KVB_AVX2
    XXH_ALIGN(64) uint64_t acc[8] = XXH3_INIT_ACC;
    const size_t whole = (len - 1) / STRIPE;           /* stripes accumulated in order */
    int wide = level >= 2 && len >= WIDE_FROM;
    int nt = stream && ((uintptr_t)dst & (wide ? 63 : 31)) == 0;
    if (wide)
        stripes_avx512(acc, dst, src, whole, 0, nt);
    else
        stripes_avx2(acc, dst, src, whole, 0, nt);
    size_t done = whole * STRIPE;
    memmove(dst + done, src + done, len - done);       /* the tail: under a stripe, or a whole last one */
    if (nt)
        _mm_sfence();                                  /* the streamed stores before anything after */
    /* the last 64 bytes of the input, from where they landed */
    XXH3_accumulate_512_scalar(acc, (const unsigned char *)dst + len - STRIPE,
                               XXH3_kSecret + XXH_SECRET_DEFAULT_SIZE - STRIPE - XXH_SECRET_LASTACC_START);
    return XXH3_mergeAccs(acc, XXH3_kSecret + XXH_SECRET_MERGEACCS_START, (uint64_t)len * XXH_PRIME64_1);
#else
    return 0;   /* unreachable: kvb_copy_hash_fused() is 0 */
#endif
}
