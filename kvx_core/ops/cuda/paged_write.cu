// KVX fused quantize-and-write of new K/V tokens into paged pools (FP8 E4M3/E5M2, INT8, INT4, NVFP4, MXFP4 16/32
// RCEIL or floor, k8v4), K and V in one launch: CUDA, SM89+.
//
// Why CUDA and not the Triton write (benchmarks/results/write_bandwidth_h100.jsonl: 1.5-1.8x its bandwidth): the
// Triton kernel spends ~60 thread instructions per element (benchmarks/results/ncu_write_nvfp4_32k_h200.txt: NVFP4,
// ALU pipe 78%, DRAM 21%): its layouts route rows through shuffles and shared memory, each element pays a full
// IEEE division and its E2M1 code is a 7-compare ladder. This kernel: 26-28 per element for the 4-bit formats,
// 19 for FP8 (ncu_write_cuda_32k_h100.txt). Here a thread reads 16 consecutive elements of a row (two 16-byte
// words of bf16 / fp16) into registers, so an NVFP4 / MXFP4-16 group is one thread's (MXFP4-32: two lanes, INT
// rows: D / 16 lanes, reduced by xor shuffles); a thread stores its payload as one 8-byte (4-bit formats) or
// 16-byte (byte formats) word; a divisor shared by a row or group is inverted once (see `Divider`).
//
// Exactness: bit-identical to `kvx_core.formats` encode (tests/kernels/test_write_kernel.py runs every case on
// both backends). The same FP32 operations in the same order, each correctly rounded (__fdiv_rn / __fmul_rn /
// __fsub_rn / __fmaf_rn are never contracted). E2M1 codes by exact bit arithmetic (e2m1_code, checked for every
// FP32 input up to 6 by test_cuda_e2m1_code_every_float32). FP32 -> FP8 by the hardware `cvt.rn.satfinite` on
// values already clamped to the format's range: RNE with the sign kept, the rounding of torch's casts (checked
// for every FP32 input of the range, with power-of-two and other global scales, by
// test_cuda_fp8_convert_every_float32).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace kvx_write {

// Encoders (formats/kernel_facts.py `EncoderCode`). The first six are the CUDA decode's format codes (`CudaCode`);
// MXFP4 variants by group and scale rule follow.
enum : int { E_NVFP4 = 0, E_MXFP4 = 1, E_INT4 = 2, E_E4M3 = 3, E_E5M2 = 4, E_INT8 = 5,
             E_MXFP4_32 = 6, E_MXFP4_FLOOR = 7, E_MXFP4_32_FLOOR = 8 };

struct Side {
  const void* x;
  int64_t x_st, x_sh;  // element strides of the [T, H, D] input
  uint8_t* pd;
  int64_t pd_sb, pd_sh, pd_st;  // byte strides of the payload pool
  uint8_t* ps;
  int64_t ps_sb, ps_sh, ps_st;  // byte strides of the scale pool (unused without scales)
  const float* g;               // [H] FP32 global scales (NVFP4 / FP8), else null
};

struct WriteParams {
  Side side[2];          // K, V
  const void* slots;     // [T] int32 or int64; negative = skip
  int32_t slots_64;      // slots are int64
  int32_t tokens;        // T
  int32_t bs;            // block size
  int32_t bs_log2;       // log2(block size) when it is a power of two, else -1
  int32_t lanes_log2;    // log2 of the threads per row (D / 16): 1..4
};

constexpr int THREADS = 256;
constexpr int N = 16;  // elements per thread
constexpr unsigned FULL = 0xFFFFFFFFu;

// ------------------------------------------------------------------ the PTX pieces
// The kernel's only inline PTX. tests/kernels/host_write.cpp compiles this file for the host (KVX_HOST_EMULATION)
// with its own versions of these, so the CPU suite checks the kernel's logic against the formats' encode; the GPU
// tests check these on the hardware, exhaustively where they round.
#ifndef KVX_HOST_EMULATION
// FP32 pair (|x| <= the format's max finite) -> FP8 bytes (lo = first element), RNE, sign kept.
template <bool E5M2>
__device__ __forceinline__ uint32_t f8x2(float lo, float hi) {
  unsigned short d;
  if (E5M2)
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

__device__ __forceinline__ float e4m3_value(uint32_t byte) {  // exact
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)byte));
  return __half2float(__ushort_as_half((unsigned short)(h & 0xFFFF)));
}

__device__ __forceinline__ float rcp_approx(float d) {  // ~1 ulp; ftz: callers pass d in [2^-40, 2^40]
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d));
  return y;
}
#endif

// ------------------------------------------------------------------ loads: 16 elements -> FP32 (exact)
// A thread's 16 elements, their largest magnitude and whether all are finite. For bf16 / fp16 input the last two
// come from the raw 16-bit words, two elements per instruction: |x| bit patterns order as the magnitudes do, and
// inf / NaN patterns lie above every finite one.
struct Chunk {
  float v[N];
  float amax;  // max |v| (meaningful when fin)
  bool fin;
};

template <typename TX>
__device__ __forceinline__ void load16(const TX* p, Chunk& c);

__device__ __forceinline__ uint32_t abs_max_bits16(const uint4& a, const uint4& b) {
  const uint32_t ws[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = __vmaxu2(m, ws[i] & 0x7FFF7FFFu);
  return max(m & 0xFFFFu, m >> 16);
}

template <>
__device__ __forceinline__ void load16<__nv_bfloat16>(const __nv_bfloat16* p, Chunk& c) {
  const uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
  const uint32_t ws[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    c.v[2 * i] = __uint_as_float(ws[i] << 16);
    c.v[2 * i + 1] = __uint_as_float(ws[i] & 0xFFFF0000u);
  }
  const uint32_t m = abs_max_bits16(a, b);
  c.fin = m < 0x7F80u;
  c.amax = __uint_as_float(m << 16);
}

template <>
__device__ __forceinline__ void load16<__half>(const __half* p, Chunk& c) {
  const uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
  const uint32_t ws[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&ws[i]));
    c.v[2 * i] = f.x;
    c.v[2 * i + 1] = f.y;
  }
  const uint32_t m = abs_max_bits16(a, b);
  c.fin = m < 0x7C00u;
  c.amax = __half2float(__ushort_as_half((unsigned short)m));
}

template <>
__device__ __forceinline__ void load16<float>(const float* p, Chunk& c) {
  const float4* q = reinterpret_cast<const float4*>(p);
  c.amax = 0.0f;
  c.fin = true;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 f = q[i];
    const float e[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      c.v[4 * i + j] = e[j];
      c.amax = fmaxf(c.amax, fabsf(e[j]));
      c.fin &= fabsf(e[j]) < __int_as_float(0x7F800000);
    }
  }
}

// ------------------------------------------------------------------ exact scalar pieces
__device__ __forceinline__ bool finite(float x) { return fabsf(x) < __int_as_float(0x7F800000); }

// |y| (NaN: callers' values that saturate, see Divider) -> E2M1 magnitude code 0..7, RNE, saturating at 6
// (formats.codes.e2m1_encode). |y| >= 1: keep one mantissa bit by integer RNE on the FP32 bits (a carry into the
// exponent is the right rounding); the result's (exponent, bit) is the code + 252. |y| < 1: the code is rint(2|y|)
// (0, 0.5, 1.0), read from the low bits of 2|y| + 1.5 * 2^23.
__device__ __forceinline__ uint32_t e2m1_magnitude(float y) {
  const float a = fminf(fabsf(y), 6.0f);
  const uint32_t b = __float_as_uint(a);
  const uint32_t big = ((b + 0x1FFFFFu + ((b >> 22) & 1u)) >> 22) - 252u;
  const uint32_t small = __float_as_uint(__fadd_rn(__fmul_rn(a, 2.0f), 12582912.0f)) - 0x4B400000u;
  return a >= 1.0f ? big : small;
}

__device__ __forceinline__ uint32_t sign_bit3(float x) { return (__float_as_uint(x) >> 28) & 8u; }

__device__ __forceinline__ int floor_log2(float v) {  // positive finite v, subnormals included
  const uint32_t b = __float_as_uint(v);
  const int e = (int)(b >> 23);
  return e ? e - 127 : (31 - __clz((int)(b & 0x7FFFFFu))) - 149;
}

__device__ __forceinline__ int ceil_log2(float v) {
  const uint32_t b = __float_as_uint(v);
  const uint32_t m = b & 0x7FFFFFu;
  const bool pow2 = (b >> 23) ? m == 0 : (m & (m - 1)) == 0;
  return floor_log2(v) + (pow2 ? 0 : 1);
}

// ------------------------------------------------------------------ division by a shared divisor
// q[i] = x[i] / d for the N values of a thread, with the properties each caller relies on:
//  * d in [2^-40, 2^40] (the "fast" range): the sequence of div.rn.f32's own fast path (MUFU reciprocal, one
//    Newton step, quotient, FMA remainder, corrected quotient: the SASS nvcc emits for __fdiv_rn) with the
//    reciprocal computed once. It equals __fdiv_rn(x, d) wherever div.rn's range check (FCHK) takes the fast
//    path, which covers |x| in [2^-60, 2^60] (all intermediates normal). Outside that: |x| < 2^-60 gives
//    |q| < 2^-18 (callers round it to 0 like the exact quotient), |x| > 2^60 gives |q| > 2^19 or NaN (an
//    overflowed x * (1/d) minus itself; the exact quotient is then ~ +-inf); callers take magnitudes through a
//    NaN-absorbing fminf and the sign from x (d > 0: the exact quotient has x's sign, zeros included).
//  * otherwise: __fdiv_rn per value.
// INT rows (whose |x - min| may exceed 2^60 while d is small) use the fast range only when every |x - min| of the
// row is below 2^61 (`encode_int`).
__device__ __forceinline__ bool fast_divisor(float d) { return d >= 0x1p-40f && d <= 0x1p40f; }

__device__ __forceinline__ void divide(const float* x, float d, float* q, bool fast) {
  if (fast) {
    const float y0 = rcp_approx(d);
    const float y = __fmaf_rn(y0, __fmaf_rn(-d, y0, 1.0f), y0);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float q0 = __fmul_rn(x[i], y);
      q[i] = __fmaf_rn(y, __fmaf_rn(-d, q0, x[i]), q0);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) q[i] = __fdiv_rn(x[i], d);
  }
}

// ------------------------------------------------------------------ one thread's 16 elements of one row
struct Row {  // where one thread's row lives
  uint8_t* pd;     // the row's payload bytes
  uint8_t* ps;     // the row's scale bytes
  int c;           // the thread's 16-element chunk in the row
  int lanes_log2;  // threads per row (log2)
  float g;         // the head's global scale (formats with one)
  bool store;      // the row has a slot (else it is encoded with its warp and not stored)
};

template <bool E5M2>
__device__ __forceinline__ void encode_fp8(const Chunk& ch, const Row& r) {
  const float* v = ch.v;
  const float fmax = E5M2 ? 57344.0f : 448.0f;
  float q[N];
  divide(v, r.g, q, fast_divisor(r.g));
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; j += 2) {
      const float x0 = v[4 * i + j], x1 = v[4 * i + j + 1];
      const float y0 = copysignf(fminf(fabsf(q[4 * i + j]), fmax), x0);  // fminf: NaN -> fmax (see divide)
      const float y1 = copysignf(fminf(fabsf(q[4 * i + j + 1]), fmax), x1);
      uint32_t pair = f8x2<E5M2>(y0, y1);
      if (!ch.fin) {  // NaN / inf elements store the NaN byte
        if (!finite(x0)) pair = (pair & 0xFF00u) | 0x7Fu;
        if (!finite(x1)) pair = (pair & 0x00FFu) | 0x7F00u;
      }
      word |= pair << (8 * j);
    }
    w[i] = word;
  }
  if (r.store) *reinterpret_cast<uint4*>(r.pd + N * r.c) = make_uint4(w[0], w[1], w[2], w[3]);
}

// INT8 / INT4: codes (x - min) / scale over the whole row, fp16 scale and min in 4 scale bytes.
template <int LEVELS>
__device__ __forceinline__ void encode_int(const Chunk& ch, const Row& r) {
  const float* v = ch.v;
  float mn = v[0], mx = v[0];
  bool fin = ch.fin;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    mn = fminf(mn, v[i]);
    mx = fmaxf(mx, v[i]);
  }
  for (int o = 1; o < (1 << r.lanes_log2); o <<= 1) {
    mn = fminf(mn, __shfl_xor_sync(FULL, mn, o));
    mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, o));
    fin &= __shfl_xor_sync(FULL, (unsigned)fin, o) != 0;
  }
  // a zero extreme as +0 (formats.integer): which signed zero a min / max returns depends on the reduction order
  mn = __fadd_rn(mn, 0.0f);
  mx = __fadd_rn(mx, 0.0f);
  const __half sc_h = __float2half_rn(fminf(__fdiv_rn(__fsub_rn(mx, mn), (float)LEVELS), 65504.0f));
  const __half mn_h = __float2half_rn(fminf(fmaxf(mn, -65504.0f), 65504.0f));
  const float s_raw = __half2float(sc_h);
  const bool usable = fin && s_raw > 0.0f;
  const float s = usable ? s_raw : 1.0f, m = __half2float(mn_h);
  float d[N], q[N];
#pragma unroll
  for (int i = 0; i < N; ++i) d[i] = __fsub_rn(v[i], m);
  // fp16 scales lie in [2^-24, 65504]; |x - m| <= max(|mn|, |mx|) + 65504 < 2^61 keeps NaN out (see divide)
  divide(d, s, q, fmaxf(fabsf(mn), fabsf(mx)) <= 0x1p60f);
  uint32_t c[N];
#pragma unroll
  for (int i = 0; i < N; ++i)  // fmaxf: NaN -> 0 cannot occur here (no overflowed quotient in the fast range)
    c[i] = usable ? (uint32_t)fminf(fmaxf(rintf(q[i]), 0.0f), (float)LEVELS) : 0u;
  if (!r.store) return;
  if (LEVELS == 255) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = c[4 * i] | (c[4 * i + 1] << 8) | (c[4 * i + 2] << 16) | (c[4 * i + 3] << 24);
    *reinterpret_cast<uint4*>(r.pd + N * r.c) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    uint32_t w[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < N; ++i) w[i / 8] |= c[i] << (4 * (i % 8));
    *reinterpret_cast<uint2*>(r.pd + (N / 2) * r.c) = make_uint2(w[0], w[1]);
  }
  if (r.c == 0) {
    const uint32_t sb = fin ? __half_as_ushort(sc_h) : 0x7E00u, mb = fin ? __half_as_ushort(mn_h) : 0x7E00u;
    r.ps[0] = sb & 0xFF;
    r.ps[1] = sb >> 8;
    r.ps[2] = mb & 0xFF;
    r.ps[3] = mb >> 8;
  }
}

// NVFP4 (group 16: one thread) and MXFP4 (16 / 32: one / two threads): E2M1 codes of x / scale, a scale byte per
// group stored by the group's first thread.
template <int E>
__device__ __forceinline__ void encode_fp4(const Chunk& ch, const Row& r) {
  constexpr bool NV = E == E_NVFP4;
  constexpr int GL = (E == E_MXFP4_32 || E == E_MXFP4_32_FLOOR) ? 2 : 1;  // threads per group
  constexpr bool RCEIL = E == E_MXFP4 || E == E_MXFP4_32;
  const float* v = ch.v;
  float amax = ch.amax;
  bool fin = ch.fin;
  if (GL == 2) {
    amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, 1));
    fin &= __shfl_xor_sync(FULL, (unsigned)fin, 1) != 0;
  }
  amax = fin ? amax : 0.0f;
  uint32_t sbyte;
  float y[N];
  if (NV) {
    float s = __fdiv_rn(amax, __fmul_rn(6.0f, r.g));
    s = s == 0.0f ? 1.0f : s;
    s = fminf(fmaxf(s, 0.001953125f), 448.0f);
    sbyte = f8x2<false>(s, 0.0f) & 0xFFu;
    const float big_s = __fmul_rn(e4m3_value(sbyte), r.g);
    divide(v, big_s, y, fast_divisor(big_s));
    if (big_s == 0.0f) {  // a global scale below ~2^-140: 0 / 0 is NaN, whose code is 0 (e2m1_encode)
#pragma unroll
      for (int i = 0; i < N; ++i) y[i] = v[i] == 0.0f ? 0.0f : y[i];
    }
  } else {
    int e;
    if (RCEIL) {
      const float dd = __fdiv_rn(amax, 6.0f);
      e = dd > 0.0f ? ceil_log2(dd) : -127;
    } else {
      e = floor_log2(amax > 0.0f ? amax : 1.0f) - 2;
    }
    e = amax > 0.0f ? e : -127;
    e = min(max(e, -127), 127);
    sbyte = (uint32_t)(e + 127);
    const uint32_t k = (uint32_t)(127 - e);  // 2^-e as FP32: exact (k = 0 is the subnormal 2^-127)
    const float inv = __uint_as_float(k ? k << 23 : 0x00400000u);
#pragma unroll
    for (int i = 0; i < N; ++i) y[i] = __fmul_rn(v[i], inv);
  }
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < N; ++i) w[i / 8] |= (e2m1_magnitude(y[i]) | sign_bit3(v[i])) << (4 * (i % 8));
  if (!r.store) return;
  *reinterpret_cast<uint2*>(r.pd + (N / 2) * r.c) = fin ? make_uint2(w[0], w[1]) : make_uint2(0u, 0u);
  if (r.c % GL == 0) r.ps[r.c / GL] = (uint8_t)(fin ? sbyte : (NV ? 0x7Fu : 0xFFu));
}

template <int E>
__device__ __forceinline__ void encode(const Chunk& c, const Row& r) {
  if constexpr (E == E_E4M3 || E == E_E5M2) encode_fp8<E == E_E5M2>(c, r);
  else if constexpr (E == E_INT8) encode_int<255>(c, r);
  else if constexpr (E == E_INT4) encode_int<15>(c, r);
  else encode_fp4<E>(c, r);
}

// One CTA: THREADS / lanes token rows of one (head, side); grid = (cdiv(T, rows per CTA), H, 2). Every lane
// encodes (rows past T or with a negative slot encode zeros and store nothing), so shuffles run on full warps.
template <typename TX, int EK, int EV>
__global__ void __launch_bounds__(THREADS) write_kernel(const WriteParams p) {
  const int h = blockIdx.y, sd = blockIdx.z;
  const Side& s = p.side[sd];
  const int t = blockIdx.x * (THREADS >> p.lanes_log2) + (threadIdx.x >> p.lanes_log2);
  Row r;
  r.c = threadIdx.x & ((1 << p.lanes_log2) - 1);
  r.lanes_log2 = p.lanes_log2;
  r.g = s.g ? s.g[h] : 1.0f;
  int64_t slot = -1;
  Chunk c;
  if (t < p.tokens) {
    slot = p.slots_64 ? static_cast<const int64_t*>(p.slots)[t] : static_cast<const int32_t*>(p.slots)[t];
    load16<TX>(static_cast<const TX*>(s.x) + t * s.x_st + h * s.x_sh + N * r.c, c);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) c.v[i] = 0.0f;
    c.amax = 0.0f;
    c.fin = true;
  }
  r.store = slot >= 0;
  int64_t blk = 0, off = 0;
  if (p.bs_log2 >= 0) {
    blk = slot >> p.bs_log2;
    off = slot & ((1 << p.bs_log2) - 1);
  } else if (r.store) {
    blk = slot / p.bs;
    off = slot - blk * p.bs;
  }
  r.pd = s.pd + blk * s.pd_sb + h * s.pd_sh + off * s.pd_st;
  r.ps = s.ps + blk * s.ps_sb + h * s.ps_sh + off * s.ps_st;
  if (sd == 0) encode<EK>(c, r);
  else encode<EV>(c, r);
}

template <typename TX, int EK, int EV>
cudaError_t launch(const WriteParams& p, int heads, cudaStream_t stream) {
  const int rows = THREADS >> p.lanes_log2;
  const dim3 grid((p.tokens + rows - 1) / rows, heads, 2);
#ifdef KVX_HOST_EMULATION
  return host_launch(write_kernel<TX, EK, EV>, grid, THREADS, p);  // the grid on CPU threads (host_write.cpp)
#else
  write_kernel<TX, EK, EV><<<grid, THREADS, 0, stream>>>(p);
  return cudaGetLastError();
#endif
}

template <int EK, int EV>
cudaError_t by_input(const WriteParams& p, int x_dtype, int heads, cudaStream_t s) {
  switch (x_dtype) {
    case 0: return launch<float, EK, EV>(p, heads, s);
    case 1: return launch<__half, EK, EV>(p, heads, s);
    case 2: return launch<__nv_bfloat16, EK, EV>(p, heads, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kvx_write

extern "C" {

int kvx_write_params_size(void) { return (int)sizeof(kvx_write::WriteParams); }

// kenc / venc: encoder codes (enum above); K and V share one, or K is E4M3 and V NVFP4 (k8v4). x_dtype: 0 fp32,
// 1 fp16, 2 bf16. Returns a cudaError_t (0 = launched); cudaErrorInvalidValue for an unsupported combination.
int kvx_paged_write(const kvx_write::WriteParams* p, int kenc, int venc, int x_dtype, int heads, void* stream) {
  using namespace kvx_write;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (p->lanes_log2 < 1 || p->lanes_log2 > 4 || heads < 1 || heads > 65535 || p->bs < 1 || p->tokens < 0 ||
      (p->bs_log2 >= 0 && (1 << p->bs_log2) != p->bs))
    return (int)cudaErrorInvalidValue;
  if (p->tokens == 0) return 0;
  if (kenc == E_E4M3 && venc == E_NVFP4) return (int)by_input<E_E4M3, E_NVFP4>(*p, x_dtype, heads, s);
  if (kenc != venc) return (int)cudaErrorInvalidValue;
  switch (kenc) {
    case E_NVFP4: return (int)by_input<E_NVFP4, E_NVFP4>(*p, x_dtype, heads, s);
    case E_MXFP4: return (int)by_input<E_MXFP4, E_MXFP4>(*p, x_dtype, heads, s);
    case E_MXFP4_32: return (int)by_input<E_MXFP4_32, E_MXFP4_32>(*p, x_dtype, heads, s);
    case E_MXFP4_FLOOR: return (int)by_input<E_MXFP4_FLOOR, E_MXFP4_FLOOR>(*p, x_dtype, heads, s);
    case E_MXFP4_32_FLOOR: return (int)by_input<E_MXFP4_32_FLOOR, E_MXFP4_32_FLOOR>(*p, x_dtype, heads, s);
    case E_INT4: return (int)by_input<E_INT4, E_INT4>(*p, x_dtype, heads, s);
    case E_INT8: return (int)by_input<E_INT8, E_INT8>(*p, x_dtype, heads, s);
    case E_E4M3: return (int)by_input<E_E4M3, E_E4M3>(*p, x_dtype, heads, s);
    case E_E5M2: return (int)by_input<E_E5M2, E_E5M2>(*p, x_dtype, heads, s);
    default: return (int)cudaErrorInvalidValue;
  }
}

}  // extern "C"
