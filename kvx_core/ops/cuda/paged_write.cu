// KVX fused quantize-and-write of new K/V tokens into paged pools (FP8 E4M3/E5M2, INT8, INT4, NVFP4, MXFP4 16/32
// RCEIL or floor, k8v4), K and V in one launch: CUDA, SM89+.
//
// Why CUDA and not the Triton write (benchmarks/results/write_bandwidth_h100.jsonl: 1.5-1.8x its bandwidth): the
// Triton kernel spends ~60 thread instructions per element (benchmarks/results/ncu_write_nvfp4_32k_h200.txt: NVFP4,
// ALU pipe 78%, DRAM 21%): its layouts route rows through shuffles and shared memory, each element pays a full
// IEEE division and its E2M1 code is a 7-compare ladder. Here a thread reads 32 consecutive elements of a row
// (four 16-byte words of bf16 / fp16) into registers, so its per-thread work (slot, addresses, scales) is spread
// over 32 elements and an NVFP4 / MXFP4 group is one thread's (two groups of 16 or one of 32; INT rows: D / 32
// lanes, reduced by xor shuffles); a divisor shared by a row or group is inverted once (see `divide`). The ALU
// pipe bounded the first version (ncu_write_cuda_32k_h100.txt: 26-28 instructions per element for the 4-bit
// formats), so the rounding to E2M1 / INT codes runs on the FMA pipe (`e2m1_biased`, `MAGIC`). The `_rot` formats'
// Hadamard rotation runs on the loaded registers (`rotate`: butterfly stages in the thread, then between the row's
// lanes), not as a separate pass over memory.
//
// Exactness: bit-identical to `kvx_core.formats` encode (tests/kernels/test_write_kernel.py runs every case on
// both backends). The same FP32 operations in the same order, each correctly rounded (__fdiv_rn / __fmul_rn /
// __fsub_rn / __fmaf_rn are never contracted). E2M1 codes by exact saturated FMAs (e2m1_biased, checked for every
// FP32 input up to 6 by test_cuda_e2m1_code_every_float32). FP32 -> FP8 by the hardware `cvt.rn.satfinite` on
// values already clamped to the format's range: RNE with the sign kept, the rounding of torch's casts (checked
// for every FP32 input of the range, with power-of-two and other global scales, by
// test_cuda_fp8_convert_every_float32).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

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
  int32_t lanes_log2;    // log2 of the threads per row (D / 32): 0..3
  float rotate_scale;    // `_rot` formats: 1 / sqrt(D) in FP32 (formats.rotation.inv_sqrt), rows rotated before
                         // their encode; 0: no rotation
};

constexpr int THREADS = 128;  // 1-3% over 256 on the H200 (write_cta_size_h200.jsonl)
constexpr int N = 32;      // elements per thread: two 16-element halves (the fixed per-thread work over 32)
constexpr int HALVES = N / 16;
constexpr unsigned FULL = 0xFFFFFFFFu;

// ------------------------------------------------------------------ the PTX pieces
// The kernel's only inline PTX. tests/kernels/host_write.cpp compiles this file for the host (KVX_HOST_EMULATION)
// with its own versions of these four, so the CPU suite checks the kernel's logic against the formats' encode; the
// GPU tests check these on the hardware, exhaustively where they round.
#ifndef KVX_HOST_EMULATION
// prmt.b32 in its default mode: a selector nibble with bit 3 set gives 0xFF or 0x00 by the chosen byte's top bit.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

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

// ------------------------------------------------------------------ loads: 32 elements -> FP32 (exact)
// A thread's 32 elements and, per 16-element half, their largest magnitude and whether all are finite. For bf16 /
// fp16 input the last two come from the raw 16-bit words, two elements per instruction: |x| bit patterns order as
// the magnitudes do, and inf / NaN patterns lie above every finite one.
struct Chunk {
  float v[N];
  float amax[HALVES];    // max |v| of each half (meaningful when fin)
  bool fin[HALVES];
  uint32_t signs[N / 8];  // element i's sign bit at bit 4 (i % 8) + 3 of word i / 8: E2M1's nibble order
};

__device__ __forceinline__ uint32_t abs_max_bits16(const uint32_t* ws) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = __vmaxu2(m, ws[i] & 0x7FFF7FFFu);
  return max(m & 0xFFFFu, m >> 16);
}

// The sign bits of 16 16-bit values (two per word, bits 15 and 31) in E2M1's nibble order (Chunk::signs): six
// ALU instructions per eight elements where shifting each bit into place takes two per element.
__device__ __forceinline__ void signs16(const uint32_t* ws, uint32_t* signs) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    // bytes 0xFF where negative: x = elements (0, 2, 1, 3) of the word's eight, y = (4, 6, 5, 7)
    const uint32_t x = prmt(ws[4 * j], ws[4 * j + 1], 0xFBD9u), y = prmt(ws[4 * j + 2], ws[4 * j + 3], 0xFBD9u);
    const uint32_t even = prmt(x, y, 0x5410u), odd = prmt(x, y, 0x7632u);  // elements (0, 2, 4, 6), (1, 3, 5, 7)
    signs[j] = (even & 0x08080808u) | (odd & 0x80808080u);
  }
}

// Half h (elements 16 h .. 16 h + 15) of the chunk from eight words of 16-bit values (element 2 i in the low half
// of word i), as loaded or as the rotation rounds them.
template <typename TX>
__device__ __forceinline__ void from_words(const uint32_t* ws, Chunk& c, int h);

template <>
__device__ __forceinline__ void from_words<__nv_bfloat16>(const uint32_t* ws, Chunk& c, int h) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    c.v[16 * h + 2 * i] = __uint_as_float(ws[i] << 16);
    c.v[16 * h + 2 * i + 1] = __uint_as_float(ws[i] & 0xFFFF0000u);
  }
  signs16(ws, c.signs + 2 * h);
  const uint32_t m = abs_max_bits16(ws);
  c.fin[h] = m < 0x7F80u;
  c.amax[h] = __uint_as_float(m << 16);
}

template <>
__device__ __forceinline__ void from_words<__half>(const uint32_t* ws, Chunk& c, int h) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&ws[i]));
    c.v[16 * h + 2 * i] = f.x;
    c.v[16 * h + 2 * i + 1] = f.y;
  }
  signs16(ws, c.signs + 2 * h);
  const uint32_t m = abs_max_bits16(ws);
  c.fin[h] = m < 0x7C00u;
  c.amax[h] = __half2float(__ushort_as_half((unsigned short)m));
}

// Half h of the chunk from 16 FP32 values.
__device__ __forceinline__ void from_floats(const float* e, Chunk& c, int h) {
  c.amax[h] = 0.0f;
  c.fin[h] = true;
  c.signs[2 * h] = c.signs[2 * h + 1] = 0u;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    c.v[16 * h + i] = e[i];
    c.signs[2 * h + i / 8] |= (__float_as_uint(e[i]) >> 31) << (4 * (i % 8) + 3);
    c.amax[h] = fmaxf(c.amax[h], fabsf(e[i]));
    c.fin[h] &= fabsf(e[i]) < __int_as_float(0x7F800000);
  }
}

// Half h of the chunk from p (its first element): 16-byte loads.
template <typename TX>
__device__ __forceinline__ void load16(const TX* p, Chunk& c, int h) {
  if constexpr (sizeof(TX) == 4) {
    const float4 f[4] = {reinterpret_cast<const float4*>(p)[0], reinterpret_cast<const float4*>(p)[1],
                         reinterpret_cast<const float4*>(p)[2], reinterpret_cast<const float4*>(p)[3]};
    const float e[16] = {f[0].x, f[0].y, f[0].z, f[0].w, f[1].x, f[1].y, f[1].z, f[1].w,
                         f[2].x, f[2].y, f[2].z, f[2].w, f[3].x, f[3].y, f[3].z, f[3].w};
    from_floats(e, c, h);
  } else {
    const uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
    const uint32_t ws[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    from_words<TX>(ws, c, h);
  }
}

// ------------------------------------------------------------------ exact scalar pieces
__device__ __forceinline__ bool finite(float x) { return fabsf(x) < __int_as_float(0x7F800000); }

// Small integers by FP32 rounding: x + 1.5 * 2^23 (whose last place is 1) is rint(x) (RNE) in its low mantissa bits
// for |x| < 2^22, on the FMA pipe (this kernel is bound by the ALU pipe, and FRND / F2I run at a quarter rate).
constexpr float MAGIC = 12582912.0f;
constexpr uint32_t MAGIC_BITS = 0x4B400000u;  // its bits; the low 22 are zero

// |y| (not NaN; inf saturates) -> MAGIC_BITS + its E2M1 magnitude code 0..7, RNE, saturating at 6
// (formats.codes.e2m1_encode), in six FMA-pipe instructions: codes 0..4 are rint(2 min(|y|, 2)), 4..6 add
// rint(clamp(|y|, 2, 4) - 2) and 6..7 add rint((clamp(|y|, 4, 6) - 4) / 2). Each clamp is a saturated FMA of
// |y| / 2, exact where unsaturated (|y| / 2 - 1 and |y| / 2 - 2 are multiples of 2^-23 and 2^-22 in [0, 1]), and
// each piece is rounded by adding it to the running sum MAGIC + code: a tie of a later piece (|y| = 2.5, 3.5, 5)
// meets an even sum (code 4 or 6), so rounding the sum is rounding the piece to even. Checked against the
// threshold ladder for every FP32 value (a host loop of these operations) and on the GPU
// (test_cuda_e2m1_code_every_float32).
__device__ __forceinline__ uint32_t e2m1_biased(float y) {
  const float a = fabsf(y);
  const float lo = __fmaf_rn(__saturatef(__fmul_rn(a, 0.5f)), 4.0f, MAGIC);
  const float mid = __fmaf_rn(__saturatef(__fmaf_rn(a, 0.5f, -1.0f)), 2.0f, lo);
  return __float_as_uint(__fadd_rn(__saturatef(__fmaf_rn(a, 0.5f, -2.0f)), mid));
}

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
// q[i] = x[i] / d for values of a thread, with the properties each caller relies on:
//  * d in [2^-40, 2^40] (the "fast" range): the sequence of div.rn.f32's own fast path (MUFU reciprocal, one
//    Newton step, quotient, FMA remainder, corrected quotient: the SASS nvcc emits for __fdiv_rn) with the
//    reciprocal computed once. It equals __fdiv_rn(x, d) wherever div.rn's range check (FCHK) takes the fast
//    path, which covers |x| in [2^-60, 2^60] (all intermediates normal). Outside that: |x| < 2^-60 gives
//    |q| < 2^-18 (callers round it to 0 like the exact quotient), |x| > 2^60 gives |q| > 2^19 or NaN (an
//    overflowed x * (1/d) minus itself; the exact quotient is then ~ +-inf); callers take the sign from x (d > 0:
//    the exact quotient has x's sign, zeros included) and either take magnitudes through a NaN-absorbing fminf
//    (FP8) or use the fast range only when every |x| is at most 2^60 (NVFP4, whose E2M1 rounding needs no NaN).
//  * otherwise: __fdiv_rn per value.
// INT rows (whose |x - min| may exceed 2^60 while d is small) use the fast range only when every |x - min| of the
// row is below 2^61 (`encode_int`).
// The divisor is prepared once per row or group (`divisor`) and applied a few values at a time (`divide`), so a
// thread never holds all 32 quotients next to its 32 values: sm_90a, bf16 input, fp8 62 registers, nvfp4 71, k8v4 71
// (80 each when they divided all 32 at once: fewer warps per SM for a kernel that waits on its loads).
__device__ __forceinline__ bool fast_divisor(float d) { return d >= 0x1p-40f && d <= 0x1p40f; }

struct Divisor {
  float d;
  float y;    // the refined reciprocal (fast)
  bool fast;  // the fast range (see above)
};

__device__ __forceinline__ Divisor divisor(float d, bool fast) {
  float y = 0.0f;
  if (fast) {
    const float y0 = rcp_approx(d);
    y = __fmaf_rn(y0, __fmaf_rn(-d, y0, 1.0f), y0);
  }
  return {d, y, fast};
}

template <int M>  // values
__device__ __forceinline__ void divide(const float* x, const Divisor& dv, float* q) {
  if (dv.fast) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const float q0 = __fmul_rn(x[i], dv.y);
      q[i] = __fmaf_rn(dv.y, __fmaf_rn(-dv.d, q0, x[i]), q0);
    }
  } else {
#pragma unroll
    for (int i = 0; i < M; ++i) q[i] = __fdiv_rn(x[i], dv.d);
  }
}

// ------------------------------------------------------------------ stores of a thread's codes
// Byte formats: 32 bytes as two 16-byte words; 4-bit formats: 16 bytes as two 8-byte words (pool rows are 16- /
// 8-byte aligned: write.py `reason`).
__device__ __forceinline__ void store_bytes(uint8_t* p, const uint32_t* w) {
  reinterpret_cast<uint4*>(p)[0] = make_uint4(w[0], w[1], w[2], w[3]);
  reinterpret_cast<uint4*>(p)[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

__device__ __forceinline__ void store_nibbles(uint8_t* p, const uint32_t* w) {
  reinterpret_cast<uint2*>(p)[0] = make_uint2(w[0], w[1]);
  reinterpret_cast<uint2*>(p)[1] = make_uint2(w[2], w[3]);
}

__device__ __forceinline__ bool all_finite(const Chunk& c) {
  bool fin = true;
#pragma unroll
  for (int h = 0; h < HALVES; ++h) fin &= c.fin[h];
  return fin;
}

// ------------------------------------------------------------------ one thread's 32 elements of one row
struct Row {  // where one thread's row lives
  uint8_t* pd;     // the row's payload bytes
  uint8_t* ps;     // the row's scale bytes
  int c;           // the thread's 32-element chunk in the row
  int lanes_log2;  // threads per row (log2)
  float g;         // the head's global scale (formats with one)
  bool store;      // the row has a slot (else it is encoded with its warp and not stored)
};

template <bool E5M2>
__device__ __forceinline__ void encode_fp8(const Chunk& ch, const Row& r) {
  const float* v = ch.v;
  const float fmax = E5M2 ? 57344.0f : 448.0f;
  const Divisor dv = divisor(r.g, fast_divisor(r.g));
  const bool fin = all_finite(ch);
  uint32_t w[N / 4];
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    float q[4];
    divide<4>(v + 4 * i, dv, q);
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; j += 2) {
      const float x0 = v[4 * i + j], x1 = v[4 * i + j + 1];
      const float y0 = copysignf(fminf(fabsf(q[j]), fmax), x0);  // fminf: NaN -> fmax (see divide)
      const float y1 = copysignf(fminf(fabsf(q[j + 1]), fmax), x1);
      uint32_t pair = f8x2<E5M2>(y0, y1);
      if (!fin) {  // NaN / inf elements store the NaN byte
        if (!finite(x0)) pair = (pair & 0xFF00u) | 0x7Fu;
        if (!finite(x1)) pair = (pair & 0x00FFu) | 0x7F00u;
      }
      word |= pair << (8 * j);
    }
    w[i] = word;
  }
  if (r.store) store_bytes(r.pd + N * r.c, w);
}

// INT8 / INT4: codes (x - min) / scale over the whole row, fp16 scale and min in 4 scale bytes.
template <int LEVELS>
__device__ __forceinline__ void encode_int(const Chunk& ch, const Row& r) {
  const float* v = ch.v;
  float mn = v[0], mx = v[0];
  bool fin = all_finite(ch);
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
  // fp16 scales lie in [2^-24, 65504]; |x - m| <= max(|mn|, |mx|) + 65504 < 2^61 keeps NaN out (see divide)
  const Divisor dv = divisor(s, fmaxf(fabsf(mn), fabsf(mx)) <= 0x1p60f);
  // clamp(rint(q), 0, LEVELS) = rint(clamp(q, 0, LEVELS)) (integer bounds); the lower clamp is a saturated multiply
  // by 1 / (LEVELS + 1) (a power of two: exact), the rounding MAGIC's, and the codes are packed with their biases,
  // taken off once per word (see encode_fp4). q is never NaN: the fast range has no overflowed quotient, and
  // __fdiv_rn of a finite or infinite x - m by s > 0 is not NaN.
  constexpr int PER_WORD = LEVELS == 255 ? 4 : 8, BITS = 32 / PER_WORD;
  constexpr uint32_t BIAS = MAGIC_BITS * (LEVELS == 255 ? 0x01010101u : 0x11111111u);
  uint32_t w[N / PER_WORD];
#pragma unroll
  for (int j = 0; j < N / PER_WORD; ++j) {
    float d[PER_WORD], q[PER_WORD];
#pragma unroll
    for (int k = 0; k < PER_WORD; ++k) d[k] = __fsub_rn(v[PER_WORD * j + k], m);
    divide<PER_WORD>(d, dv, q);
    uint32_t word = 0u - BIAS;
#pragma unroll
    for (int k = 0; k < PER_WORD; ++k)
      word += __float_as_uint(__fmaf_rn(
                  __saturatef(__fmul_rn(fminf(q[k], (float)LEVELS), 1.0f / (LEVELS + 1))),
                  (float)(LEVELS + 1), MAGIC)) << (BITS * k);
    w[j] = usable ? word : 0u;
  }
  if (!r.store) return;
  if (LEVELS == 255)
    store_bytes(r.pd + N * r.c, w);
  else
    store_nibbles(r.pd + (N / 2) * r.c, w);
  if (r.c == 0) {
    const uint32_t sb = fin ? __half_as_ushort(sc_h) : 0x7E00u, mb = fin ? __half_as_ushort(mn_h) : 0x7E00u;
    r.ps[0] = sb & 0xFF;
    r.ps[1] = sb >> 8;
    r.ps[2] = mb & 0xFF;
    r.ps[3] = mb >> 8;
  }
}

// NVFP4 (group 16) and MXFP4 (16 / 32): E2M1 codes of x / scale, a scale byte per group; a thread's 32 elements
// are two groups of 16 or one of 32.
template <int E>
__device__ __forceinline__ void encode_fp4(const Chunk& ch, const Row& r) {
  constexpr bool NV = E == E_NVFP4;
  constexpr int GS = (E == E_MXFP4_32 || E == E_MXFP4_32_FLOOR) ? 32 : 16;  // group size
  constexpr int G = N / GS;                                                 // groups per thread
  constexpr bool RCEIL = E == E_MXFP4 || E == E_MXFP4_32;
  uint32_t w[N / 8];
  uint8_t sbytes[G];
#pragma unroll
  for (int gi = 0; gi < G; ++gi) {
    const float* v = ch.v + GS * gi;
    float amax = ch.amax[GS / 16 * gi];
    bool fin = ch.fin[GS / 16 * gi];
    if (GS == 32) {
      amax = fmaxf(amax, ch.amax[1]);
      fin &= ch.fin[1];
    }
    amax = fin ? amax : 0.0f;
    uint32_t sbyte;
    Divisor dv{};  // NVFP4: the group's scale times g
    float inv = 0.0f;  // MXFP4: 2^-e
    if (NV) {
      float s = __fdiv_rn(amax, __fmul_rn(6.0f, r.g));
      s = s == 0.0f ? 1.0f : s;
      s = fminf(fmaxf(s, 0.001953125f), 448.0f);
      sbyte = f8x2<false>(s, 0.0f) & 0xFFu;
      const float big_s = __fmul_rn(e4m3_value(sbyte), r.g);
      dv = divisor(big_s, fast_divisor(big_s) && amax <= 0x1p60f);
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
      inv = __uint_as_float(k ? k << 23 : 0x00400000u);
    }
    // Each code sits in the low bits of its MAGIC_BITS-biased word: the eight biases leave the packed sum as one
    // constant, taken off once (mod 2^32).
#pragma unroll
    for (int j = 0; j < GS / 8; ++j) {
      float y[8];
      if (NV) {
        divide<8>(v + 8 * j, dv, y);
        if (dv.d == 0.0f) {  // a global scale below ~2^-140: 0 / 0 is NaN, whose code is 0 (e2m1_encode)
#pragma unroll
          for (int i = 0; i < 8; ++i) y[i] = v[8 * j + i] == 0.0f ? 0.0f : y[i];
        }
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(v[8 * j + i], inv);
      }
      uint32_t word = ch.signs[GS / 8 * gi + j] - MAGIC_BITS * 0x11111111u;
#pragma unroll
      for (int k = 0; k < 8; ++k) word += e2m1_biased(y[k]) << (4 * k);
      w[GS / 8 * gi + j] = fin ? word : 0u;
    }
    sbytes[gi] = (uint8_t)(fin ? sbyte : (NV ? 0x7Fu : 0xFFu));
  }
  if (!r.store) return;
  store_nibbles(r.pd + (N / 2) * r.c, w);
#pragma unroll
  for (int gi = 0; gi < G; ++gi) r.ps[G * r.c + gi] = sbytes[gi];
}

template <int E>
__device__ __forceinline__ void encode(const Chunk& c, const Row& r) {
  if constexpr (E == E_E4M3 || E == E_E5M2) encode_fp8<E == E_E5M2>(c, r);
  else if constexpr (E == E_INT8) encode_int<255>(c, r);
  else if constexpr (E == E_INT4) encode_int<15>(c, r);
  else encode_fp4<E>(c, r);
}

// ------------------------------------------------------------------ the `_rot` formats' rotation, in registers
// formats/rotation.py's Hadamard rotation of each row before its encode, the same bits as ops.rotation.rotate (the
// torch butterfly, the fused Triton kernel, the decode's rotate_row), so the encode sees the reference's rotated
// input: finite values saturated to FP32_MAX / D; stage h = 1, 2, 4, ... maps each pair (a, b) = (y[i], y[i + h]) of
// a 2h-block to (a + b, a - b) -- stages 1..16 inside a thread's 32 elements, stage 32 * 2^k with lane c ^ 2^k of the
// row (the lower lane holds a) --; then times s = 1 / sqrt(D) rounded to FP32, finite results saturated to TX's largest
// value and rounded to TX (nearest even), from which the chunk is made as from loaded words.
__device__ __forceinline__ float saturate_finite(float y, float lim) {
  return finite(y) ? fminf(fmaxf(y, -lim), lim) : y;
}

template <typename TX>
__device__ __forceinline__ uint32_t round_pair(float lo, float hi);  // two values rounded to TX, lo in bits 0..15

template <>
__device__ __forceinline__ uint32_t round_pair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

template <>
__device__ __forceinline__ uint32_t round_pair<__half>(float lo, float hi) {
  const __half2 b = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

template <typename TX>
__device__ __forceinline__ void rotate(Chunk& c, const Row& r, float s) {
  float* v = c.v;
  const float lim = __uint_as_float(0x7F7FFFFFu - ((uint32_t)(5 + r.lanes_log2) << 23));  // FP32_MAX / D, exact
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = saturate_finite(v[i], lim);
#pragma unroll
  for (int h = 1; h < N; h <<= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (i & h) continue;
      const float a = v[i], b = v[i + h];
      v[i] = __fadd_rn(a, b);
      v[i + h] = __fsub_rn(a, b);
    }
  }
  for (int k = 0; k < r.lanes_log2; ++k) {
    const bool upper = (r.c >> k) & 1;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float o = __shfl_xor_sync(FULL, v[i], 1 << k);
      v[i] = upper ? __fsub_rn(o, v[i]) : __fadd_rn(v[i], o);
    }
  }
#pragma unroll
  for (int h = 0; h < HALVES; ++h) {
    if constexpr (sizeof(TX) == 4) {
      float e[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) e[i] = saturate_finite(__fmul_rn(v[16 * h + i], s), 0x1.fffffep127f);
      from_floats(e, c, h);
    } else {
      const float top = std::is_same<TX, __half>::value ? 65504.0f : 0x1.fep127f;  // the largest fp16 / bf16
      uint32_t ws[8];
#pragma unroll
      for (int i = 0; i < 8; ++i)
        ws[i] = round_pair<TX>(saturate_finite(__fmul_rn(v[16 * h + 2 * i], s), top),
                               saturate_finite(__fmul_rn(v[16 * h + 2 * i + 1], s), top));
      from_words<TX>(ws, c, h);
    }
  }
}

// One CTA: THREADS / lanes token rows of one (head, side); grid = (cdiv(T, rows per CTA), H, 2). Every lane
// encodes (rows past T or with a negative slot encode zeros and store nothing), so shuffles run on full warps.
template <typename TX, int EK, int EV, bool ROT>
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
    const TX* x = static_cast<const TX*>(s.x) + t * s.x_st + h * s.x_sh + N * r.c;
#pragma unroll
    for (int hf = 0; hf < HALVES; ++hf) load16<TX>(x + 16 * hf, c, hf);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) c.v[i] = 0.0f;
#pragma unroll
    for (int hf = 0; hf < HALVES; ++hf) {
      c.amax[hf] = 0.0f;
      c.fin[hf] = true;
    }
#pragma unroll
    for (int i = 0; i < N / 8; ++i) c.signs[i] = 0u;
  }
  if constexpr (ROT) rotate<TX>(c, r, p.rotate_scale);
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

template <typename TX, int EK, int EV, bool ROT>
cudaError_t launch(const WriteParams& p, int heads, cudaStream_t stream) {
  const int rows = THREADS >> p.lanes_log2;
  const dim3 grid((p.tokens + rows - 1) / rows, heads, 2);
#ifdef KVX_HOST_EMULATION
  return host_launch(write_kernel<TX, EK, EV, ROT>, grid, THREADS, p);  // the grid on CPU threads (host_write.cpp)
#else
  write_kernel<TX, EK, EV, ROT><<<grid, THREADS, 0, stream>>>(p);
  return cudaGetLastError();
#endif
}

template <int EK, int EV, bool ROT>
cudaError_t by_input(const WriteParams& p, int x_dtype, int heads, cudaStream_t s) {
  switch (x_dtype) {
    case 0: return launch<float, EK, EV, ROT>(p, heads, s);
    case 1: return launch<__half, EK, EV, ROT>(p, heads, s);
    case 2: return launch<__nv_bfloat16, EK, EV, ROT>(p, heads, s);
    default: return cudaErrorInvalidValue;
  }
}

// ROT: the `_rot` formats' encoders (FP4 / INT4, and k8v4), rows rotated in the kernel.
template <bool ROT>
cudaError_t by_format(const WriteParams& p, int kenc, int venc, int x_dtype, int heads, cudaStream_t s) {
  if (kenc == E_E4M3 && venc == E_NVFP4) return by_input<E_E4M3, E_NVFP4, ROT>(p, x_dtype, heads, s);
  if (kenc != venc) return cudaErrorInvalidValue;
  switch (kenc) {
    case E_NVFP4: return by_input<E_NVFP4, E_NVFP4, ROT>(p, x_dtype, heads, s);
    case E_MXFP4: return by_input<E_MXFP4, E_MXFP4, ROT>(p, x_dtype, heads, s);
    case E_MXFP4_32: return by_input<E_MXFP4_32, E_MXFP4_32, ROT>(p, x_dtype, heads, s);
    case E_INT4: return by_input<E_INT4, E_INT4, ROT>(p, x_dtype, heads, s);
    default: break;
  }
  if constexpr (!ROT) {
    switch (kenc) {
      case E_MXFP4_FLOOR: return by_input<E_MXFP4_FLOOR, E_MXFP4_FLOOR, false>(p, x_dtype, heads, s);
      case E_MXFP4_32_FLOOR: return by_input<E_MXFP4_32_FLOOR, E_MXFP4_32_FLOOR, false>(p, x_dtype, heads, s);
      case E_INT8: return by_input<E_INT8, E_INT8, false>(p, x_dtype, heads, s);
      case E_E4M3: return by_input<E_E4M3, E_E4M3, false>(p, x_dtype, heads, s);
      case E_E5M2: return by_input<E_E5M2, E_E5M2, false>(p, x_dtype, heads, s);
      default: break;
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvx_write

extern "C" {

int kvx_write_params_size(void) { return (int)sizeof(kvx_write::WriteParams); }

// kenc / venc: encoder codes (enum above); K and V share one, or K is E4M3 and V NVFP4 (k8v4); with a nonzero
// p->rotate_scale only the `_rot` formats' (NVFP4, MXFP4 16 / 32 RCEIL, INT4, k8v4). x_dtype: 0 fp32, 1 fp16, 2 bf16.
// Returns a cudaError_t (0 = launched); cudaErrorInvalidValue for an unsupported combination.
int kvx_paged_write(const kvx_write::WriteParams* p, int kenc, int venc, int x_dtype, int heads, void* stream) {
  using namespace kvx_write;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (p->lanes_log2 < 0 || p->lanes_log2 > 3 || heads < 1 || heads > 65535 || p->bs < 1 || p->tokens < 0 ||
      (p->bs_log2 >= 0 && (1 << p->bs_log2) != p->bs))
    return (int)cudaErrorInvalidValue;
  if (p->tokens == 0) return 0;
  return (int)(p->rotate_scale != 0.0f ? by_format<true>(*p, kenc, venc, x_dtype, heads, s)
                         : by_format<false>(*p, kenc, venc, x_dtype, heads, s));
}

}  // extern "C"
