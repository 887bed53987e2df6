// Batched copies: one launch moves a list of byte chunks between addresses one device can reach
// (its own memory, and a peer process's memory opened through CUDA IPC), so a block-shaped
// handle of thousands of scattered pieces is one kernel rather than a gather and a scatter per
// run of blocks.
//
// chunks[3*i] = source address, chunks[3*i+1] = destination address, chunks[3*i+2] = length in
// bytes. The host (kvbridge/transports/gpucopy.py) cuts pieces into chunks of at most 64 KiB and
// checks every piece against its buffer before launching. One thread block per chunk (grid-stride
// when there are more chunks than blocks); 16-, 8- or 4-byte words when both addresses and the
// length allow, bytes otherwise. Chunks never overlap their destinations (distinct blocks).

typedef unsigned long long u64;

extern "C" __global__ void kvb_copy_chunks(const u64* chunks, long long n) {
  for (long long c = blockIdx.x; c < n; c += gridDim.x) {
    const u64 s = chunks[3 * c], d = chunks[3 * c + 1], len = chunks[3 * c + 2];
    const u64 align = s | d | len;
    if ((align & 15) == 0) {
      const uint4* src = reinterpret_cast<const uint4*>(s);
      uint4* dst = reinterpret_cast<uint4*>(d);
      for (u64 i = threadIdx.x; i < len / 16; i += blockDim.x) dst[i] = src[i];
    } else if ((align & 7) == 0) {
      const u64* src = reinterpret_cast<const u64*>(s);
      u64* dst = reinterpret_cast<u64*>(d);
      for (u64 i = threadIdx.x; i < len / 8; i += blockDim.x) dst[i] = src[i];
    } else if ((align & 3) == 0) {
      const unsigned int* src = reinterpret_cast<const unsigned int*>(s);
      unsigned int* dst = reinterpret_cast<unsigned int*>(d);
      for (u64 i = threadIdx.x; i < len / 4; i += blockDim.x) dst[i] = src[i];
    } else {
      const unsigned char* src = reinterpret_cast<const unsigned char*>(s);
      unsigned char* dst = reinterpret_cast<unsigned char*>(d);
      for (u64 i = threadIdx.x; i < len; i += blockDim.x) dst[i] = src[i];
    }
  }
}
