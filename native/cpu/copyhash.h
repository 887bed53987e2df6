/* kvbridge._kvcopy: copy `len` bytes (src -> dst) and return the xxh3-64 of them as they landed,
 * equal to the `xxhash` package's xxh3_64. Where the CPU has AVX2 and `len` is over 240 bytes,
 * one pass: each 64-byte stripe is loaded once, stored and hashed from the same registers (one
 * 512-bit register where the CPU has AVX-512F, `level` is 2 and `len` is 16 KiB or more; else two
 * 256-bit ones). Otherwise (or at level 0) memmove and then xxHash. A copy into itself
 * (src == dst) is fine; a partly overlapping one is the caller's to avoid. */
#ifndef KVB_COPYHASH_H
#define KVB_COPYHASH_H

#include <stddef.h>
#include <stdint.h>

uint64_t kvb_copy_hash(char *dst, const char *src, size_t len, int level, int stream);

/* kvbridge's checksum of a block (or of one layer of it) from its parts' own xxh3-64 digests:
 * the xxh3-64 of those digests, each as 8 little-endian bytes, in (layer, part) order --
 * pd[0], pd[step], pd[2 * step], ...: `np` of them (0: the xxh3-64 of no bytes). Each part is
 * hashed on its own, so the parts of one block can be copied and hashed on two threads. */
uint64_t kvb_combine(const uint64_t *pd, size_t np, size_t step);

/* With `stream` (kvb_copy_hash) or always (kvb_stream_copy): stores that go past the caches
 * (x86-64 with AVX2; each piece's 32- or 64-byte-aligned run, fenced before returning), for
 * copies too large for their destination to stay in this core's cache -- they save the read
 * of each destination line that an ordinary store makes first. kvb_stream_copy is a memmove
 * otherwise and for under 256 bytes; its pieces must not partly overlap. */
void kvb_stream_copy(char *dst, const char *src, size_t n);

/* The size (bytes, of one call's whole copy) from which copies stream: four times this core's
 * L2 (sysconf; 4 MiB where it is unknown), or KVBRIDGE_STREAM_FROM (a positive integer). */
size_t kvb_stream_from(void);

/* Set it (the tests and benches); 0 goes back to the default. */
void kvb_set_stream_from(size_t n);

/* The highest level kvb_copy_hash runs at here: 2 with AVX-512F, 1 with AVX2 (x86-64), else 0. */
int kvb_copy_hash_fused(void);

#endif
