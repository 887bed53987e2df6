/* kvbridge._kvcopy: BLAKE2b (RFC 7693), unkeyed, for the shm:// live-handle table's keys: the
 * same bytes as Python's hashlib.blake2b(data, digest_size=outlen).digest(). Sequential
 * reference code (a handle is a few hundred bytes; one call costs well under a microsecond). */
#ifndef KVB_BLAKE2B_H
#define KVB_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>

/* out[0..outlen) = BLAKE2b-(8*outlen) of in[0..len); 1 <= outlen <= 64. */
void kvb_blake2b(unsigned char *out, size_t outlen, const void *in, size_t len);

#endif
