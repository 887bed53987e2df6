/* kvbridge._kvcopy: copy `np` pieces of `part` bytes each (src[j] -> dst[j], in order) and return
 * the xxh3-64 of their concatenation as it landed, equal to the `xxhash` package's xxh3_64.
 * Where the CPU has AVX2 and the whole is over 240 bytes, one pass: each 64-byte stripe is
 * loaded once, stored and hashed from the same registers (one 512-bit register where the CPU
 * has AVX-512F, `level` is 2 and the whole is 16 KiB or more; else two 256-bit ones). Otherwise (or at level 0)
 * memmove and then xxHash's streaming update, piece by piece. A piece copied into itself (src == dst) is fine; pieces
 * that partly overlap are the caller's to avoid. */
#ifndef KVB_COPYHASH_H
#define KVB_COPYHASH_H

#include <stddef.h>
#include <stdint.h>

uint64_t kvb_copy_hash(char *const *dst, const char *const *src, size_t np, size_t part, int level, int stream);

/* With `stream` (kvb_copy_hash) or always (kvb_stream_copy): stores that go past the caches
 * (x86-64 with AVX2; each piece's 32- or 64-byte-aligned run, fenced before returning), for
 * copies too large for their destination to stay in this core's cache -- they save the read
 * of each destination line that an ordinary store makes first. kvb_stream_copy is a memmove
 * otherwise and for under 256 bytes; its pieces must not partly overlap. */
void kvb_stream_copy(char *dst, const char *src, size_t n);

/* The size (bytes, of one call's whole copy) from which copies stream: twice this core's L2
 * (sysconf; 2 MiB where it is unknown), or KVBRIDGE_STREAM_FROM (a positive integer). */
size_t kvb_stream_from(void);

/* Set it (the tests and benches); 0 goes back to the default. */
void kvb_set_stream_from(size_t n);

/* The highest level kvb_copy_hash runs at here: 2 with AVX-512F, 1 with AVX2 (x86-64), else 0. */
int kvb_copy_hash_fused(void);

#endif
