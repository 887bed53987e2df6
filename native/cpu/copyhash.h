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

uint64_t kvb_copy_hash(char *const *dst, const char *const *src, size_t np, size_t part, int level);

/* The highest level kvb_copy_hash runs at here: 2 with AVX-512F, 1 with AVX2 (x86-64), else 0. */
int kvb_copy_hash_fused(void);

#endif
