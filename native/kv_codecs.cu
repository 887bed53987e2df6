// Fused gather+quantize and dequantize+scatter kernels for kvbridge's lossy codecs.
//
// Each kernel mirrors a torch definition in kvbridge/codecs/quant.py (the CPU twin):
//
//   amax  = max |x| over a group (a row of head_dim values, or a whole part for "block")
//   scale = amax * (1/QMAX)                  float32, QMAX = 127 (int8) or 448 (fp8 e4m3)
//   inv   = QMAX / amax, 0 when amax == 0 (0 < amax < 2^-96: x and amax scaled by 2^64 first, kvb_up)
//   q     = rint(x * inv) clamped to +-127     (int8)
//   q     = e4m3_rne(clamp(x * inv, +-448))     (fp8)
//   x'    = float(q) * scale, rounded to nearest even into the destination dtype
//
// The source/destination blocks are scattered in the pool: the host passes one device
// address per part (canonical order: layer, part, block), computed from KVLayout's byte
// offsets. The staging side is contiguous: q[part][row][d], scales[part][row] (or [part]).
//
// Loaded at run time by CuPy RawModule (NVRTC), so no CUDA headers are included: half and
// bfloat16 are handled as 16-bit patterns. Non-finite input sets *bad (the host refuses it).
// The element conversions are __host__ __device__ so a host build can check them bit for bit.

#define KVB_HD __host__ __device__ __forceinline__

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

struct f16 { u16 x; };
struct bf16 { u16 x; };

KVB_HD float kvb_bits_to_float(u32 u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f; __builtin_memcpy(&f, &u, 4); return f;
#endif
}

KVB_HD u32 kvb_float_to_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  u32 u; __builtin_memcpy(&u, &f, 4); return u;
#endif
}

// ---- 16-bit floats ------------------------------------------------------------------
KVB_HD float kvb_bf16_to_f32(u16 h) { return kvb_bits_to_float(((u32)h) << 16); }

KVB_HD u16 kvb_f32_to_bf16(float f) {  // round to nearest even, as c10::BFloat16
  u32 u = kvb_float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u32 bias = ((u >> 16) & 1u) + 0x7fffu;
  return (u16)((u + bias) >> 16);
}

__device__ __forceinline__ float kvb_f16_to_f32(u16 h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ u16 kvb_f32_to_f16(float f) {
  u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}

// ---- fp8 e4m3fn (bias 7, no infinities, 0x7f/0xff NaN, max 448) -----------------------
KVB_HD u8 kvb_f32_to_e4m3(float x) {  // round to nearest even, saturating to +-448
  u32 u = kvb_float_to_bits(x);
  u8 sign = (u8)((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return (u8)(sign | 0x7f);
  if (u >= 0x43e00000u) return (u8)(sign | 0x7e);           // >= 448
  if (u < 0x3c800000u) {                                     // below 2^-6: subnormal steps of 2^-9
    float a = kvb_bits_to_float(u) * 512.0f;                 // exact (power of two)
    return (u8)(sign | (u8)rintf(a));                        // 8 rounds up into the smallest normal
  }
  u32 mant = u & 0x7fffffu;
  u32 v = ((((u >> 23) & 0xffu) - 120u) << 3) | (mant >> 20);  // exponent rebias 127 -> 7
  u32 rem = mant & 0xfffffu;
  if (rem > 0x80000u || (rem == 0x80000u && (v & 1u))) v += 1u;
  if (v > 0x7eu) v = 0x7eu;
  return (u8)(sign | v);
}

KVB_HD float kvb_e4m3_to_f32(u8 v) {
  u32 sign = ((u32)(v & 0x80)) << 24;
  u32 e = (v >> 3) & 0xfu, m = v & 7u;
  if (e == 0xfu && m == 7u) return kvb_bits_to_float(sign | 0x7fc00000u);
  if (e == 0) return kvb_bits_to_float(sign | kvb_float_to_bits((float)m * 0.001953125f));
  return kvb_bits_to_float(sign | ((e + 120u) << 23) | (m << 20));
}

// 1/127 and 1/448 as float32 (the same constants the torch twin multiplies by).
#define KVB_INV_I8 0x1.020408p-7f
#define KVB_INV_F8 0x1.24924ap-9f

KVB_HD bool kvb_finite(float f) { return (kvb_float_to_bits(f) & 0x7f800000u) != 0x7f800000u; }

// Subnormals are kept whatever flush-to-zero setting the kernels are compiled with (a tiny group's
// scale is often subnormal, and the twin keeps it): products through PTX mul.rn.f32 without .ftz,
// absolute values and comparisons on the bits.
KVB_HD float kvb_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
#else
  return a * b;
#endif
}
KVB_HD float kvb_abs(float x) { return kvb_bits_to_float(kvb_float_to_bits(x) & 0x7fffffffu); }
// max of two non-negative values (|x|) as their bits, as the twin's integer max: NaN bits are the largest
KVB_HD float kvb_nanmax(float m, float a) { return kvb_float_to_bits(a) > kvb_float_to_bits(m) ? a : m; }

// QMAX / amax overflows float32 below ~1e-36 (subnormal or tiny normal groups: x * inf is inf,
// 0 * inf NaN): a group with 0 < amax < 2^-96 and its values are scaled by 2^64 first, as the
// torch twin does (kvbridge/codecs/quant.py). Powers of two are exact, so x * inv rounds as it
// would without the overflow; the scale written stays amax * (1/QMAX).
KVB_HD float kvb_up(float m) {   // m >= 0; 0x0f800000 is 2^-96
  u32 b = kvb_float_to_bits(m);
  return (b != 0u && b < 0x0f800000u) ? 0x1p64f : 1.0f;
}
KVB_HD float kvb_inv(float m, float up, float qmax) { return kvb_float_to_bits(m) != 0u ? qmax / kvb_mul(m, up) : 0.0f; }

KVB_HD signed char kvb_q_int8(float x, float inv) {
  float r = rintf(kvb_mul(x, inv));
  r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
  return (signed char)(int)r;
}

KVB_HD u8 kvb_q_fp8(float x, float inv) {
  float y = kvb_mul(x, inv);
  y = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y);
  return kvb_f32_to_e4m3(y);
}

// ---- loads and stores per element type --------------------------------------------------
__device__ __forceinline__ float kvb_load(const float* p) { return *p; }
__device__ __forceinline__ float kvb_load(const f16* p) { return kvb_f16_to_f32(p->x); }
__device__ __forceinline__ float kvb_load(const bf16* p) { return kvb_bf16_to_f32(p->x); }
__device__ __forceinline__ void kvb_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void kvb_store(f16* p, float v) { p->x = kvb_f32_to_f16(v); }
__device__ __forceinline__ void kvb_store(bf16* p, float v) { p->x = kvb_f32_to_bf16(v); }

struct QInt8 {
  static constexpr float QMAX = 127.0f;
  __device__ static float inv_qmax() { return KVB_INV_I8; }
  __device__ static u8 enc(float x, float inv) { return (u8)kvb_q_int8(x, inv); }
  __device__ static float dec(u8 q) { return (float)(signed char)q; }
};
struct QFp8 {
  static constexpr float QMAX = 448.0f;
  __device__ static float inv_qmax() { return KVB_INV_F8; }
  __device__ static u8 enc(float x, float inv) { return kvb_q_fp8(x, inv); }
  __device__ static float dec(u8 q) { return kvb_e4m3_to_f32(q); }
};

__device__ __forceinline__ float kvb_warp_max(float m) {
  for (int o = 16; o > 0; o >>= 1) m = kvb_nanmax(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// One warp per row (a token of a head): gather from the pool, quantize into staging.
template <typename T, typename Q>
__device__ void kvb_gather_quant_rows(const u64* parts, long long num_rows, int rows_per_part, int dim,
                                      u8* q, float* scales, int* bad) {
  long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (row >= num_rows) return;
  const T* src = reinterpret_cast<const T*>(parts[row / rows_per_part]) + (row % rows_per_part) * (long long)dim;
  float m = 0.0f;
  for (int i = lane; i < dim; i += 32) m = kvb_nanmax(m, kvb_abs(kvb_load(src + i)));
  m = kvb_warp_max(m);
  if (!kvb_finite(m)) { if (lane == 0) *bad = 1; }
  float up = kvb_up(m), inv = kvb_inv(m, up, Q::QMAX);
  u8* out = q + row * (long long)dim;
  for (int i = lane; i < dim; i += 32) out[i] = Q::enc(kvb_mul(kvb_load(src + i), up), inv);
  if (lane == 0) scales[row] = kvb_mul(m, Q::inv_qmax());
}

// One warp per row: dequantize from staging, scatter into the pool in its dtype.
template <typename T, typename Q>
__device__ void kvb_dequant_scatter_rows(const u64* parts, long long num_rows, int rows_per_part, int dim,
                                         const u8* q, const float* scales) {
  long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (row >= num_rows) return;
  T* dst = reinterpret_cast<T*>(parts[row / rows_per_part]) + (row % rows_per_part) * (long long)dim;
  float s = scales[row];
  const u8* in = q + row * (long long)dim;
  for (int i = lane; i < dim; i += 32) kvb_store(dst + i, kvb_mul(Q::dec(in[i]), s));
}

// One thread block per part (fp8-block): block-wide amax, then quantize the part.
template <typename T, typename Q>
__device__ void kvb_gather_quant_parts(const u64* parts, int part_elems, u8* q, float* scales, int* bad) {
  __shared__ float red[32];
  const T* src = reinterpret_cast<const T*>(parts[blockIdx.x]);
  float m = 0.0f;
  for (int i = threadIdx.x; i < part_elems; i += blockDim.x) m = kvb_nanmax(m, kvb_abs(kvb_load(src + i)));
  m = kvb_warp_max(m);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.0f;
    m = kvb_warp_max(m);
    if (threadIdx.x == 0) red[0] = m;
  }
  __syncthreads();
  m = red[0];
  if (threadIdx.x == 0 && !kvb_finite(m)) *bad = 1;
  float up = kvb_up(m), inv = kvb_inv(m, up, Q::QMAX);
  u8* out = q + (long long)blockIdx.x * part_elems;
  for (int i = threadIdx.x; i < part_elems; i += blockDim.x) out[i] = Q::enc(kvb_mul(kvb_load(src + i), up), inv);
  if (threadIdx.x == 0) scales[blockIdx.x] = kvb_mul(m, Q::inv_qmax());
}

template <typename T, typename Q>
__device__ void kvb_dequant_scatter_parts(const u64* parts, int part_elems, const u8* q, const float* scales) {
  T* dst = reinterpret_cast<T*>(parts[blockIdx.x]);
  float s = scales[blockIdx.x];
  const u8* in = q + (long long)blockIdx.x * part_elems;
  for (int i = threadIdx.x; i < part_elems; i += blockDim.x) kvb_store(dst + i, kvb_mul(Q::dec(in[i]), s));
}

// ---- vectorized variants: 16-byte loads, a row held in registers -------------------------
// Used when head_dim is a multiple of the vector width, head_dim / width lanes (a power of two
// <= 32) cover a row, and every part address is 16-byte aligned (the host checks).
template <typename T> struct KvbVec;
template <> struct KvbVec<float> {
  static constexpr int N = 4;
  __device__ static void load(const float* p, float* o) {
    float4 v = *reinterpret_cast<const float4*>(p);
    o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
  }
  __device__ static void store(float* p, const float* o) {
    float4 v;  // aggregate stores: no make_float4, which needs headers NVRTC may not have
    v.x = o[0]; v.y = o[1]; v.z = o[2]; v.w = o[3];
    *reinterpret_cast<float4*>(p) = v;
  }
};
template <typename H, u16 (*ENC)(float), float (*DEC)(u16)> struct KvbVec16 {
  static constexpr int N = 8;
  __device__ static void load(const H* p, float* o) {
    uint4 v = *reinterpret_cast<const uint4*>(p);
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) { o[2 * i] = DEC((u16)(w[i] & 0xffffu)); o[2 * i + 1] = DEC((u16)(w[i] >> 16)); }
  }
  __device__ static void store(H* p, const float* o) {
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = (u32)ENC(o[2 * i]) | ((u32)ENC(o[2 * i + 1]) << 16);
    uint4 v;
    v.x = w[0]; v.y = w[1]; v.z = w[2]; v.w = w[3];
    *reinterpret_cast<uint4*>(p) = v;
  }
};
__device__ __forceinline__ u16 kvb_enc_bf16(float f) { return kvb_f32_to_bf16(f); }
__device__ __forceinline__ float kvb_dec_bf16(u16 h) { return kvb_bf16_to_f32(h); }
template <> struct KvbVec<bf16> : KvbVec16<bf16, kvb_enc_bf16, kvb_dec_bf16> {};
template <> struct KvbVec<f16> : KvbVec16<f16, kvb_f32_to_f16, kvb_f16_to_f32> {};

template <int N> struct KvbCodes;  // N one-byte codes as one store
template <> struct KvbCodes<4> {
  __device__ static void store(u8* p, const u8* c) {
    *reinterpret_cast<u32*>(p) = (u32)c[0] | ((u32)c[1] << 8) | ((u32)c[2] << 16) | ((u32)c[3] << 24);
  }
  __device__ static void load(const u8* p, u8* c) {
    u32 w = *reinterpret_cast<const u32*>(p);
    for (int i = 0; i < 4; ++i) c[i] = (u8)(w >> (8 * i));
  }
};
template <> struct KvbCodes<8> {
  __device__ static void store(u8* p, const u8* c) {
    u32 a = (u32)c[0] | ((u32)c[1] << 8) | ((u32)c[2] << 16) | ((u32)c[3] << 24);
    u32 b = (u32)c[4] | ((u32)c[5] << 8) | ((u32)c[6] << 16) | ((u32)c[7] << 24);
    uint2 v;
    v.x = a; v.y = b;
    *reinterpret_cast<uint2*>(p) = v;
  }
  __device__ static void load(const u8* p, u8* c) {
    uint2 w = *reinterpret_cast<const uint2*>(p);
    for (int i = 0; i < 4; ++i) { c[i] = (u8)(w.x >> (8 * i)); c[4 + i] = (u8)(w.y >> (8 * i)); }
  }
};

// lanes_per_row threads (a power of two <= 32) per row; out-of-range rows still join the shuffles.
template <typename T, typename Q>
__device__ void kvb_gather_quant_rows_vec(const u64* parts, long long num_rows, int rows_per_part, int dim,
                                          int lanes_per_row, u8* q, float* scales, int* bad) {
  constexpr int N = KvbVec<T>::N;
  long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long row = t / lanes_per_row;
  int sub = (int)(t % lanes_per_row);
  bool valid = row < num_rows;
  float v[N];
  float m = 0.0f;
  if (valid) {
    const T* src = reinterpret_cast<const T*>(parts[row / rows_per_part]) + (row % rows_per_part) * (long long)dim;
    KvbVec<T>::load(src + sub * N, v);
#pragma unroll
    for (int i = 0; i < N; ++i) m = kvb_nanmax(m, kvb_abs(v[i]));
  }
  for (int o = lanes_per_row >> 1; o > 0; o >>= 1) m = kvb_nanmax(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (!valid) return;
  if (sub == 0 && !kvb_finite(m)) *bad = 1;
  float up = kvb_up(m), inv = kvb_inv(m, up, Q::QMAX);
  u8 c[N];
#pragma unroll
  for (int i = 0; i < N; ++i) c[i] = Q::enc(kvb_mul(v[i], up), inv);
  KvbCodes<N>::store(q + row * (long long)dim + sub * N, c);
  if (sub == 0) scales[row] = kvb_mul(m, Q::inv_qmax());
}

template <typename T, typename Q>
__device__ void kvb_dequant_scatter_rows_vec(const u64* parts, long long num_rows, int rows_per_part, int dim,
                                             int lanes_per_row, const u8* q, const float* scales) {
  constexpr int N = KvbVec<T>::N;
  long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long row = t / lanes_per_row;
  int sub = (int)(t % lanes_per_row);
  if (row >= num_rows) return;
  T* dst = reinterpret_cast<T*>(parts[row / rows_per_part]) + (row % rows_per_part) * (long long)dim;
  float s = scales[row];
  u8 c[N];
  KvbCodes<N>::load(q + row * (long long)dim + sub * N, c);
  float v[N];
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = kvb_mul(Q::dec(c[i]), s);
  KvbVec<T>::store(dst + sub * N, v);
}

#define KVB_ROW_KERNELS(QN, Q, TN, T)                                                                    \
  extern "C" __global__ void gather_quant_rows_##QN##_##TN(const u64* parts, long long num_rows,           \
      int rows_per_part, int dim, u8* q, float* scales, int* bad) {                                      \
    kvb_gather_quant_rows<T, Q>(parts, num_rows, rows_per_part, dim, q, scales, bad);                    \
  }                                                                                                      \
  extern "C" __global__ void dequant_scatter_rows_##QN##_##TN(const u64* parts, long long num_rows,        \
      int rows_per_part, int dim, const u8* q, const float* scales) {                                    \
    kvb_dequant_scatter_rows<T, Q>(parts, num_rows, rows_per_part, dim, q, scales);                      \
  }                                                                                                      \
  extern "C" __global__ void gather_quant_parts_##QN##_##TN(const u64* parts, int part_elems, u8* q,      \
      float* scales, int* bad) {                                                                         \
    kvb_gather_quant_parts<T, Q>(parts, part_elems, q, scales, bad);                                     \
  }                                                                                                      \
  extern "C" __global__ void dequant_scatter_parts_##QN##_##TN(const u64* parts, int part_elems,         \
      const u8* q, const float* scales) {                                                                \
    kvb_dequant_scatter_parts<T, Q>(parts, part_elems, q, scales);                                       \
  }                                                                                                      \
  extern "C" __global__ void gather_quant_vrows_##QN##_##TN(const u64* parts, long long num_rows,          \
      int rows_per_part, int dim, int lanes_per_row, u8* q, float* scales, int* bad) {                   \
    kvb_gather_quant_rows_vec<T, Q>(parts, num_rows, rows_per_part, dim, lanes_per_row, q, scales, bad); \
  }                                                                                                      \
  extern "C" __global__ void dequant_scatter_vrows_##QN##_##TN(const u64* parts, long long num_rows,       \
      int rows_per_part, int dim, int lanes_per_row, const u8* q, const float* scales) {                 \
    kvb_dequant_scatter_rows_vec<T, Q>(parts, num_rows, rows_per_part, dim, lanes_per_row, q, scales);   \
  }

KVB_ROW_KERNELS(int8, QInt8, f32, float)
KVB_ROW_KERNELS(int8, QInt8, f16, f16)
KVB_ROW_KERNELS(int8, QInt8, bf16, bf16)
KVB_ROW_KERNELS(fp8, QFp8, f32, float)
KVB_ROW_KERNELS(fp8, QFp8, f16, f16)
KVB_ROW_KERNELS(fp8, QFp8, bf16, bf16)
