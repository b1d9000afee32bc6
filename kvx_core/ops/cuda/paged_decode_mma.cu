// KVX paged decode attention over 4-bit and 8-bit KV caches (NVFP4, MXFP4, INT4, INT8, FP8 E4M3/E5M2, K8V4):
// CUDA, SM89+.
//
// Why CUDA and not Triton (benchmarks/results/ncu_decode_triton_b64_32k_h200.txt): Triton's mma-v2 path
// routes the 4-bit payload through shared memory and layout conversions; its NVFP4 decode used 20%
// of DRAM bandwidth, bound on L1/TEX. Here a thread loads its payload as 32-bit words straight into
// registers and decodes them *into the tensor-core fragment layout*: the contraction index of QK^T is
// permuted so that a thread's K fragment is whole words of one token row, and the output columns of PV
// are permuted so that a thread's V fragment comes from the same word of two tokens (one PRMT). Q and
// O carry the same permutations, which is free (Q is loaded once, O stored once).
//
// Exactness: every dequantized operand is exact in the mma operand type (f16, or bf16 for MXFP4).
//   NVFP4: f16 operands (bf16 queries scaled into the f16 range, QB below). e2m1 placed in the f16 bit pattern reads
//          as e2m1 * 2^-14; times the E4M3 group scale (one cvt) it is e2m1 * s * 2^-14 exactly (<= 6 significant
//          bits, a multiple of 2^-24, the smallest f16 subnormal). 2^14 and the FP32 global scale are applied to
//          scores / output.
//   MXFP4: (raw * 2^126) * 2^(E-127) in bf16, the exponent range of the fp32 reference (bf16 queries).
//   INT4 / INT8: f16 operands (INT4's values bf16 for bf16 queries); codes c via the magic-number trick ((c | M) - M,
//          exact); the fp16 per-token scale and min are applied in fp32: s = sc * (q . c) + mn * sum(q);
//          o = sum_t (p_t sc_t) c_t + sum_t p_t mn_t.
//   FP8:   cvt.rn.f16x2.e4m3x2 / e5m2x2 (exact). f16 operands.
//   bf16 queries on f16 key operands are scaled by a power of two into the f16 range (QB) and the scores undo it.
//   K8V4:  K and V are template parameters apart (KF / VF, operand types TK / TV): E4M3 keys as FP8 above,
//          NVFP4 values as NVFP4 above.
//   Why f16 keys for bf16 queries on NVFP4 / INT4 (they were bf16): an NVFP4 scale pair is one cvt instead of six
//   instructions, and INT4's odd nibbles need no shift (the H200's decode is issue-bound).
// One CTA = (split, KV head, query row; a row is one query token, `rows_per_seq` rows share a block-table row). Its warps take 16-token tiles round-robin, each with its own
// online softmax (a warp's next tile's words are loaded while its current tile is computed), and are merged through
// shared memory. The CTA writes the split's normalised output and log2-sum-exp in the layout of the
// Triton split merge (kvx_core/ops/triton/merge.py); `merge_kernel` below merges them (the Triton merge does for
// the Triton decode), launched by the same entry point.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <type_traits>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

namespace kvx {

enum : int { F_NVFP4 = 0, F_MXFP4 = 1, F_INT4 = 2, F_E4M3 = 3, F_E5M2 = 4, F_INT8 = 5 };

template <int FMT>
constexpr bool kByte = FMT == F_E4M3 || FMT == F_E5M2 || FMT == F_INT8;  // one byte per element
template <int FMT>
constexpr bool kAffine = FMT == F_INT4 || FMT == F_INT8;  // fp16 scale + min per token-head (4 bytes)
template <int FMT>
constexpr bool kGroup = FMT == F_NVFP4 || FMT == F_MXFP4;  // one scale byte per group of 16 / 32

// Grouped by lifetime, so a caller can fill each group once: the cache (one layer, bound once), the step (one
// decode plan: tables, workspace, options), the call (query, output). The ctypes mirror (decode.py) copies the
// first two groups as byte ranges and fills the third per call.
struct DecodeParams {
  // ---- the layer's cache
  const uint8_t* kd;
  int64_t kd_sb, kd_sh, kd_st;  // byte strides
  const uint8_t* ks;
  int64_t ks_sb, ks_sh, ks_st;
  const uint8_t* vd;
  int64_t vd_sb, vd_sh, vd_st;
  const uint8_t* vs;
  int64_t vs_sb, vs_sh, vs_st;
  const float* kg;  // [H_kv] FP32 global scales (NVFP4) or null
  const float* vg;
  const float* qs;  // [H_kv, D] FP32 key smoothing (queries times it, ops/smoothing.py) or null
  // ---- the step
  const int32_t* bt;
  int64_t bt_sb;
  const int32_t* seq;  // [rows] the keys each query row attends (its causal prefix)
  float* mo;
  int64_t mo_sb, mo_sh, mo_ss;
  float* ml;
  int64_t ml_sb, ml_sh;
  const float* sinks;  // [Hq] FP32 attention-sink logits (natural log, merged as a value-less term) or null
  float sm_scale;
  float softcap;   // <= 0: off
  int32_t window;  // < 0: off
  int32_t qh;      // query heads per KV head, 1..16
  int32_t bs;      // block size, a multiple of 16
  int32_t num_splits;
  int32_t rotate_out;  // 1: the merge rotates the output back (Hadamard `_rot` formats: formats/rotation.py's math)
  int32_t rows_per_seq;  // >= 1 query rows per block-table row (speculative decoding: 1 + k); seq holds each row's length
  void* q_rot;  // `_rot` formats: [B, Hq, D] scratch of the query dtype the entry rotates q into first, or null (q
                // comes rotated)
  // ---- the call
  const void* q;
  int64_t q_sb, q_sh;  // element strides
  void* o;  // merged output [B, Hq, D] (o_dtype), or null: the caller merges the splits
  int64_t o_sb, o_sh;
  float* lse;  // [B, Hq] FP32 natural-log LSE of the merge (with o)
  int64_t lse_sb, lse_sh;
  int32_t o_dtype;  // 0 fp32, 1 fp16, 2 bf16
};

constexpr float LOG2E = 1.4426950408889634f;
constexpr int NW = 4;  // warps per CTA (decode.py WARPS); launch bounds and splits were tuned for it

// ------------------------------------------------------------------ the PTX pieces
// The kernels' only inline PTX. tests/kernels/host_decode.cpp compiles this file for the host (KVX_HOST_EMULATION)
// with its own versions of these (the tensor-core product and MOVMATRIX as warp-wide exchanges, the dynamic shared
// memory as one buffer per block), so the CPU suite checks the kernels' logic against the float64 oracle; the GPU
// tests run these on the hardware.
#ifndef KVX_HOST_EMULATION
__device__ __forceinline__ float ex2(float x) {  // 2^x, -inf -> 0 (MUFU.EX2 without the denormal fix-ups)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t fma_f16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
template <bool E5M2>  // two FP8 bytes -> f16x2, exact
__device__ __forceinline__ uint32_t fp8x2_f16x2(unsigned short v) {
  uint32_t d;
  if constexpr (E5M2) asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(d) : "h"(v));
  else asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(v));
  return d;
}
#define KVX_MMA_16816(T)                                                                                   \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
               "{%0,%1,%2,%3};"                                                                        \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <bool BF16>  // C += A B: f16 or bf16 operands, FP32 accumulators
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF16) KVX_MMA_16816("bf16");
  else KVX_MMA_16816("f16");
}
#undef KVX_MMA_16816
// 16 bytes of shared memory, loaded at every call (volatile: the compiler may not keep the values in registers).
__device__ __forceinline__ ulonglong2 lds_u64x2(const ulonglong2* p) {
  ulonglong2 v;
  asm volatile("ld.shared.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "r"((uint32_t)__cvta_generic_to_shared(p)));
  return v;
}
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {  // 8x8 b16 fragment -> its transpose
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]  // the launch's dynamic shared memory
#endif

constexpr uint32_t NEG_ZERO2 = 0x80008000u;  // fma(a, b, -0) == a * b exactly (signed zeros kept)

// ------------------------------------------------------------------ operand types (f16 / bf16)
template <typename T>
struct Op;

template <>
struct Op<__half> {
  static constexpr int EM_POS = 9;  // e2m1 {e1 e0 m} -> f16 bits [11:9]: reads as e2m1 * 2^-14
  static constexpr uint32_t EM_MASK = 0x0E000E00u;
  static constexpr uint32_t MAGIC = 0x64006400u;      // 1024.0: (c | MAGIC) reads as 1024 + c
  static constexpr uint32_t NEG_MAGIC = 0xE400E400u;  // -1024.0
  static constexpr uint32_t ONE = 0x3C003C00u;
  static __device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) { return fma_f16x2(a, b, c); }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return pack_f16x2(lo, hi); }
  static __device__ __forceinline__ float to_f32(uint32_t bits16) {
    return __half2float(__ushort_as_half((unsigned short)bits16));
  }
  // E4M3 scale pair (two bytes) -> operand pair s: one cvt, exact (E4M3 is a subset of f16). Times the raw e2m1
  // operand (e2m1 * 2^-14) the product e2m1 * s * 2^-14 is exact too: <= 6 significant bits, a multiple of 2^-24
  // (the smallest f16 subnormal: 0.5 * 2^-9 * 2^-14), at most 6 * 448 * 2^-14; NV_FAC = 2^14 comes back in the scores
  // and the output.
  static __device__ __forceinline__ uint32_t nv_scale2(uint32_t two_bytes) {
    return fp8x2_f16x2<false>((unsigned short)two_bytes);
  }
  static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    mma_16816<false>(c, a, b0, b1);
  }
};

template <>
struct Op<__nv_bfloat16> {
  static constexpr int EM_POS = 6;  // -> bf16 bits [8:6]: reads as e2m1 * 2^-126
  static constexpr uint32_t EM_MASK = 0x01C001C0u;
  static constexpr uint32_t MAGIC = 0x43004300u;      // 128.0
  static constexpr uint32_t NEG_MAGIC = 0xC300C300u;  // -128.0
  static constexpr uint32_t ONE = 0x3F803F80u;
  static __device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) { return fma_bf16x2(a, b, c); }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return pack_bf16x2(lo, hi); }
  static __device__ __forceinline__ float to_f32(uint32_t bits16) { return __uint_as_float(bits16 << 16); }
  static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    mma_16816<true>(c, a, b0, b1);
  }
};

// UE8M0 byte pair -> bf16 pair 2^(E-127) (E=0: the bf16 subnormal 2^-127; E=255: NaN).
__device__ __forceinline__ uint32_t e8m0_bf16(uint32_t e) {
  return e == 0 ? 0x0040u : (e == 255 ? 0x7FC0u : e << 7);
}
__device__ __forceinline__ uint32_t mx_scale2(uint32_t two_bytes) {
  return e8m0_bf16(two_bytes & 0xFFu) | (e8m0_bf16((two_bytes >> 8) & 0xFFu) << 16);
}
constexpr uint32_t BF16_TWO_POW_126 = 0x7E807E80u;

// Two e2m1 codes at nibble R of each 16-bit half of `u` -> the raw operand pair (see header).
// f16: every code is first rebuilt as the high byte of its f16 (sign at bit 7, e1 e0 m at bits 3..1), in place: the
// even nibbles of `u` (R = 0, 2) in one word, the odd ones (R = 1, 3) in another (seven instructions per word,
// shared by its four pairs once unrolled); a pair is then one byte permute that puts two such bytes over zero low
// bytes. 2.75 instructions per pair instead of 4 (shift, mask, shift, merge). bf16 (MXFP4): the code straddles the
// high byte's boundary, so it is shifted into place.
template <typename T, int R>
__device__ __forceinline__ uint32_t e2m1_pair(uint32_t u) {
  if constexpr (std::is_same_v<T, __half>) {
    const uint32_t v = R % 2 == 0 ? ((u << 4) & 0x80808080u) | ((u << 1) & 0x0E0E0E0Eu)
                                  : (u & 0x80808080u) | ((u >> 3) & 0x0E0E0E0Eu);
    return __byte_perm(v, 0u, R < 2 ? 0x2404u : 0x3414u);  // bytes (0, 2) or (1, 3) of v over zeros
  } else {
    constexpr int es = Op<T>::EM_POS - 4 * R;
    uint32_t em;
    if constexpr (es >= 0) em = u << es; else em = u >> (-es);
    const uint32_t sg = u << (12 - 4 * R);
    return (em & Op<T>::EM_MASK) | (sg & 0x80008000u);
  }
}

// Two u4 codes at nibble R of each half -> the exact operand pair (c_lo, c_hi): (c | MAGIC) reads as MAGIC + c.
// f16: odd nibbles stay in place, (16 c | MAGIC) reads as 1024 + 16 c, times 1/16 minus 64 (one exact fma); nibbles
// 2 / 3 shift by a byte first: one shift per two pairs. bf16 (INT4 values for bf16 queries: P * sc keeps bf16's
// range) has 7 mantissa bits, so every nibble shifts down.
template <typename T, int R>
__device__ __forceinline__ uint32_t u4_pair(uint32_t u) {
  if constexpr (std::is_same_v<T, __half>) {
    const uint32_t y = R >= 2 ? u >> 8 : u;
    if constexpr (R % 2 == 0)
      return Op<T>::fma2((y & 0x000F000Fu) | Op<T>::MAGIC, Op<T>::ONE, Op<T>::NEG_MAGIC);
    else
      return Op<T>::fma2((y & 0x00F000F0u) | Op<T>::MAGIC, 0x2C002C00u /* 1/16 */, 0xD400D400u /* -64 */);
  } else {
    return Op<T>::fma2(((u >> (4 * R)) & 0x000F000Fu) | Op<T>::MAGIC, Op<T>::ONE, Op<T>::NEG_MAGIC);
  }
}

template <int FMT, typename T, int R>
__device__ __forceinline__ uint32_t code_pair(uint32_t u) {
  if constexpr (FMT == F_INT4) return u4_pair<T, R>(u); else return e2m1_pair<T, R>(u);
}

// The two byte codes of one 16-bit half of `u` (hi = 0 | 1) -> exact f16x2 (byte formats run f16
// operands): FP8 by cvt; u8 c by the magic-number trick ((0x64 << 8 | c) reads as 1024 + c).
template <int FMT>
__device__ __forceinline__ uint32_t byte_pair(uint32_t u, int hi) {
  if constexpr (FMT == F_INT8) {
    const uint32_t x = __byte_perm(u, 0x64646464u, hi ? 0x4342u : 0x4140u);
    return Op<__half>::fma2(x, Op<__half>::ONE, Op<__half>::NEG_MAGIC);
  } else {
    return fp8x2_f16x2<FMT == F_E5M2>((unsigned short)(hi ? u >> 16 : u & 0xFFFFu));
  }
}

template <int FMT, typename T>
__device__ __forceinline__ uint32_t code_pair_r(uint32_t u, int r) {  // r folds to a constant when unrolled
  switch (r) {
    case 0: return code_pair<FMT, T, 0>(u);
    case 1: return code_pair<FMT, T, 1>(u);
    case 2: return code_pair<FMT, T, 2>(u);
    default: return code_pair<FMT, T, 3>(u);
  }
}

// Scale a raw pair into the operand (NVFP4: s*2^7|2^119 pair; MXFP4: 2^(E-127) pair; INT4: untouched).
template <int FMT, typename T>
__device__ __forceinline__ uint32_t apply_scale(uint32_t raw, uint32_t sc2) {
  if constexpr (FMT == F_NVFP4) return Op<T>::fma2(raw, sc2, NEG_ZERO2);
  else if constexpr (FMT == F_MXFP4) return Op<T>::fma2(Op<T>::fma2(raw, BF16_TWO_POW_126, NEG_ZERO2), sc2, NEG_ZERO2);
  else return raw;
}

template <int FMT, typename T>
__device__ __forceinline__ uint32_t scale2(uint32_t two_bytes) {
  if constexpr (FMT == F_NVFP4) return Op<T>::nv_scale2(two_bytes);
  else if constexpr (FMT == F_MXFP4) return mx_scale2(two_bytes);
  else return 0u;
}

// One token's group scale bytes (N of them, in `bytes`) -> N operand pairs (s_e, s_e) for its K rows. NVFP4 converts
// two scales per cvt and spreads each over both halves.
template <int FMT, typename T, int N>
__device__ __forceinline__ void row_scales(uint32_t bytes, uint32_t (&out)[N]) {
#pragma unroll
  for (int e = 0; e < N; e += (FMT == F_NVFP4 ? 2 : 1)) {
    if constexpr (FMT == F_NVFP4) {
      const uint32_t h = Op<T>::nv_scale2((bytes >> (8 * e)) & 0xFFFFu);  // (s_e, s_e+1)
      out[e] = __byte_perm(h, 0u, 0x1010u);
      if (e + 1 < N) out[e + 1] = __byte_perm(h, 0u, 0x3232u);
    } else {
      const uint32_t byte = (bytes >> (8 * e)) & 0xFFu;
      out[e] = scale2<FMT, T>(byte | (byte << 8));
    }
  }
}

template <int N>
__device__ __forceinline__ void ld_words(const uint8_t* p, uint32_t* w) {  // N 32-bit words, 4N-aligned
  if constexpr (N == 1) {
    w[0] = __ldg(reinterpret_cast<const uint32_t*>(p));
  } else if constexpr (N == 2) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x; w[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
      w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
  }
}

template <int N>
__device__ __forceinline__ uint32_t ld_bytes(const uint8_t* p) {  // N in {1, 2, 4}, N-aligned
  if constexpr (N == 1) return __ldg(p);
  else if constexpr (N == 2) return __ldg(reinterpret_cast<const unsigned short*>(p));
  else return __ldg(reinterpret_cast<const uint32_t*>(p));
}

// ------------------------------------------------------------------ per-thread tile of raw words
// Dynamic shared memory of a decode CTA: the warps' merge (floats; a multiple of 4, so what follows is 16-byte
// aligned), then each thread's pool bases: (K payload, V payload), (K scales, V scales), (block-table row, -).
__host__ __device__ constexpr int merge_floats(int qh, int d) { return NW * (32 + qh * d); }
using ThreadBases = ulonglong2[3];
constexpr int THREAD_BASES_BYTES = NW * 32 * (int)sizeof(ThreadBases);

template <int KF, int VF, int D, int GROUP>
struct Tile {
  static constexpr int KW = kByte<KF> ? D / 16 : D / 32;  // K words per thread per token (a quarter row)
  static constexpr int VW = kByte<VF> ? D / 32 : D / 64;  // V words per thread per token (an eighth row)
  static constexpr int KSB = kAffine<KF> ? 4 : ((D / 4) >= GROUP ? (D / 4) / GROUP : 1);
  static constexpr int VSB = kAffine<VF> ? 1 : ((D / 8) >= GROUP ? (D / 8) / GROUP : 1);
  uint32_t k[2][KW];  // K rows of tokens g, g+8 (quarter t)
  uint32_t v[4][VW];  // V rows of tokens 2t, 2t+1, 2t+8, 2t+9 (eighth g)
  uint32_t ksc[2];    // K scale bytes of tokens g, g+8 (INT4: fp16 sc | mn)
  uint32_t vsc[4];    // NVFP4/MXFP4: V scale bytes of tokens 2t, 2t+1, 2t+8, 2t+9
  uint32_t vint[2];   // INT4: V fp16 sc | mn of tokens g, g+8
};

// Both products run "swapped" so the 16 mma rows are tokens / head dims and the 8 columns are query
// heads (GQA groups of up to 8 need no padding rows): S^T = K Q^T (A = K tile, B = Q^T), then
// O^T += V^T P^T (A = V^T tile, B = P^T, moved from the S^T accumulator layout by MOVMATRIX).
// NH = blocks of 8 query heads (1 when qh <= 8, else 2).
// QB: the query is bf16 while the key operands are f16 (every format but MXFP4): q is scaled by a power of two that
// keeps it inside the f16 range (exact for every element >= 2^-14 of the largest) and the scores undo it.
template <int KF, int VF, typename TK, typename TV, int D, int GROUP, int NH, bool QB>
__global__ void __launch_bounds__(NW * 32, (D <= 128 && NH == 1) ? (kByte<KF> || kByte<VF> ? 3 : 4) : 1)
    decode_kernel(const DecodeParams p) {
  constexpr bool KBYTE = kByte<KF>, KAFF = kAffine<KF>, KGRP = kGroup<KF>;
  constexpr bool VBYTE = kByte<VF>, VAFF = kAffine<VF>, VGRP = kGroup<VF>;
  using TileT = Tile<KF, VF, D, GROUP>;
  constexpr int KW = TileT::KW, VW = TileT::VW, KSTEPS = D / 16, MT = D / 16;
  constexpr int KSB = TileT::KSB, VSB = TileT::VSB;
  const int sp = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int qh = p.qh;
  DYNAMIC_SHARED(float, smem);  // m [NW][16], l [NW][16], o [NW][qh][D] (the warps' merge), then the thread bases

  // ---- this split's token range
  const int seq_len = p.seq[b];
  const int tok_lo = p.window >= 0 ? max(seq_len - 1 - p.window, 0) : 0;
  const int n_tok = max(seq_len - tok_lo, 0);
  const int chunk = (((n_tok + p.num_splits - 1) / p.num_splits) + 15) / 16 * 16;
  const int lo = tok_lo + sp * chunk;
  const int hi = min(lo + chunk, seq_len);

  // ---- Q^T fragments (B operand: k = permuted head dim, n = head 8 nh + g)
  // logical k = 2t -> dim base, 2t+1 -> base+4, 2t+8 -> base+1, 2t+9 -> base+5 (see the K decode)
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(p.q) + (int64_t)b * p.q_sb + (int64_t)h * qh * p.q_sh;
  // 4-bit: k = 2t, 2t+1, 2t+8, 2t+9 -> dims base, base+4, base+1, base+5; 8-bit: base .. base+3
  constexpr int O1 = KBYTE ? 1 : 4, O2 = KBYTE ? 2 : 1, O3 = KBYTE ? 3 : 5;
  auto q_base = [&](int kk) { return KBYTE ? t * (D / 4) + 4 * kk : t * (D / 4) + 8 * (kk / 2) + 2 * (kk & 1); };
  const float* sq = p.qs ? p.qs + (int64_t)h * D : nullptr;  // key smoothing of this KV head
  auto q_f32 = [&](uint32_t raw, int dim) -> float {  // a stored query element (bf16 for QB), times s[dim]
    const float f = QB ? __uint_as_float(raw << 16) : Op<TK>::to_f32(raw);
    return sq ? f * __ldg(sq + dim) : f;
  };
  float q_mul = 1.f;  // QB: 2^-e with amax(q) * 2^-e < 2^15
  if constexpr (QB) {
    float amax = 0.f;
#pragma unroll
    for (int nh = 0; nh < NH; ++nh)
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk)
        if (8 * nh + g < qh) {
          const int d0 = q_base(kk);
          const uint16_t* qr = qp + (int64_t)(8 * nh + g) * p.q_sh + d0;
          amax = fmaxf(amax, fmaxf(fmaxf(fabsf(q_f32(qr[0], d0)), fabsf(q_f32(qr[O1], d0 + O1))),
                                   fmaxf(fabsf(q_f32(qr[O2], d0 + O2)), fabsf(q_f32(qr[O3], d0 + O3)))));
        }
#pragma unroll
    for (int x = 1; x < 32; x <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, x));
    int ex = 0;
    frexpf(amax, &ex);  // amax < 2^ex
    q_mul = ldexpf(1.f, -max(ex - 15, 0));
  }
  auto q_bits = [&](uint32_t raw, int dim) -> uint32_t {  // one stored query element -> operand bits
    if constexpr (QB) return (uint32_t)__half_as_ushort(__float2half_rn(q_f32(raw, dim) * q_mul));
    else return sq ? (Op<TK>::pack(q_f32(raw, dim), 0.f) & 0xFFFFu) : raw;
  };
  uint32_t qb[NH][KSTEPS][2];
  float qsum[NH][2];  // INT4: sum(q) of heads 8 nh + 2t + c
#pragma unroll
  for (int nh = 0; nh < NH; ++nh) {
    const int row = 8 * nh + g;
    float own = 0.f;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      const int base = q_base(kk);
      uint32_t e0 = 0, e1 = 0, e2 = 0, e3 = 0;
      if (row < qh) {
        const uint16_t* qr = qp + (int64_t)row * p.q_sh;
        e0 = q_bits(qr[base], base); e1 = q_bits(qr[base + O1], base + O1);
        e2 = q_bits(qr[base + O2], base + O2); e3 = q_bits(qr[base + O3], base + O3);
      }
      qb[nh][kk][0] = e0 | (e1 << 16);
      qb[nh][kk][1] = e2 | (e3 << 16);
      if constexpr (KAFF) own += Op<TK>::to_f32(e0) + Op<TK>::to_f32(e1) + Op<TK>::to_f32(e2) + Op<TK>::to_f32(e3);
    }
    if constexpr (KAFF) {
      own += __shfl_xor_sync(0xffffffffu, own, 1);
      own += __shfl_xor_sync(0xffffffffu, own, 2);  // sum(q) of head 8 nh + g, in every lane of quad g
      qsum[nh][0] = __shfl_sync(0xffffffffu, own, (2 * t) * 4);
      qsum[nh][1] = __shfl_sync(0xffffffffu, own, (2 * t + 1) * 4);
    }
  }

  float k_fac = p.sm_scale / q_mul, v_fac = 1.f;  // NVFP4: the 2^14 of the operands (Op<__half>::nv_scale2); FP8: global scales
  if constexpr (KF == F_NVFP4) k_fac *= 16384.f * (p.kg ? p.kg[h] : 1.f);
  if constexpr (KBYTE) k_fac *= p.kg ? p.kg[h] : 1.f;
  if constexpr (VF == F_NVFP4) v_fac = 16384.f * (p.vg ? p.vg[h] : 1.f);
  if constexpr (VBYTE) v_fac = p.vg ? p.vg[h] : 1.f;
  const bool softcap = p.softcap > 0.f;
  if (softcap) k_fac /= p.softcap; else k_fac *= LOG2E;  // scores go to the log2 domain
  const float cap_log2 = p.softcap * LOG2E;

  // Token rows inside a page are dense (row stride = row bytes; `supports` checks it), so a thread's loads are its
  // base in each pool (the CTA's head + the thread's rows) + page offset + compile-time row offsets. The bases and the
  // block-table row are kept in shared memory, one 16-byte load per two: in registers (128 per thread for 4 CTAs per
  // SM) the compiler recomputed them in every tile, ~55 instructions. Page strides are below 2^31 (`pool_reason`), so
  // a page's offset is one 32 x 32 -> 64-bit multiply-add per pool.
  constexpr int KROW = KBYTE ? D : D / 2, VROW = VBYTE ? D : D / 2;
  constexpr int KSROW = KAFF ? 4 : D / GROUP, VSROW = VAFF ? 4 : D / GROUP;
  auto thread_bases = reinterpret_cast<ThreadBases*>(smem + merge_floats(qh, D));  // 16-byte aligned (merge_floats)
  {
    const int koff = g * KROW + t * (KROW / 4), voff = 2 * t * VROW + g * (VROW / 8);
    const int ksoff = g * KSROW + (KAFF ? 0 : (t * (D / 4)) / GROUP);
    const int vsoff = VAFF ? g * VSROW : 2 * t * VSROW + (g * (D / 8)) / GROUP;
    ulonglong2* mine = thread_bases[threadIdx.x];  // written and read by this thread only
    mine[0] = make_ulonglong2((uint64_t)(p.kd + (int64_t)h * p.kd_sh + koff), (uint64_t)(p.vd + (int64_t)h * p.vd_sh + voff));
    mine[1] = make_ulonglong2((uint64_t)(p.ks + (int64_t)h * p.ks_sh + ksoff),
                              (uint64_t)(p.vs + (int64_t)h * p.vs_sh + vsoff));
    // row b is token b % rows_per_seq of its sequence
    mine[2] = make_ulonglong2((uint64_t)(p.bt + (int64_t)(b / p.rows_per_seq) * p.bt_sb), 0ull);
  }
  const int bs_log2 = (p.bs & (p.bs - 1)) == 0 ? __ffs(p.bs) - 1 : -1;

  // EDGE (a compile-time bool_constant): the tile has tokens outside [lo, hi), whose V rows load as zeros (p = 0
  // must not meet a NaN); interior tiles (all but a split's first and last) skip the checks.
  auto load_tile = [&](TileT& x, int start, auto edge_tile) {
    constexpr bool EDGE = decltype(edge_tile)::value;
    int pidx, off;
    if (bs_log2 >= 0) { pidx = start >> bs_log2; off = start & (p.bs - 1); }
    else { pidx = start / p.bs; off = start - pidx * p.bs; }
    const ulonglong2* mine = thread_bases[threadIdx.x];
    const ulonglong2 data = lds_u64x2(mine), scales = lds_u64x2(mine + 1);
    const uint32_t page = (uint32_t)__ldg(reinterpret_cast<const int32_t*>(lds_u64x2(mine + 2).x) + pidx);  // >= 0
    const uint32_t uoff = (uint32_t)off;  // >= 0: unsigned, so the 64-bit adds need no sign extension
    const uint8_t* kp = reinterpret_cast<const uint8_t*>(data.x + (uint64_t)page * (uint32_t)p.kd_sb) + uoff * KROW;
    const uint8_t* vp = reinterpret_cast<const uint8_t*>(data.y + (uint64_t)page * (uint32_t)p.vd_sb) + uoff * VROW;
    const uint8_t* ksp = reinterpret_cast<const uint8_t*>(scales.x + (uint64_t)page * (uint32_t)p.ks_sb) + uoff * KSROW;
    const uint8_t* vsp = reinterpret_cast<const uint8_t*>(scales.y + (uint64_t)page * (uint32_t)p.vs_sb) + uoff * VSROW;
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // K rows (and INT4 V scale rows) of tokens g + 8j
      ld_words<KW>(kp + 8 * j * KROW, x.k[j]);
      if constexpr (KGRP || KAFF) x.ksc[j] = ld_bytes<KSB>(ksp + 8 * j * KSROW);
      if constexpr (VAFF) {
        x.vint[j] = ld_bytes<4>(vsp + 8 * j * VSROW);
        const int tok = start + g + 8 * j;
        if (EDGE && (tok < lo || tok >= hi)) x.vint[j] = 0u;  // masked token: finite zeros (p = 0)
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // V rows of tokens 2t + (i & 1) + 8 (i >> 1)
      const int r = (i & 1) + 8 * (i >> 1);
      ld_words<VW>(vp + r * VROW, x.v[i]);
      if constexpr (VGRP) x.vsc[i] = ld_bytes<VSB>(vsp + r * VSROW);
      const int tok = start + 2 * t + r;
      if (EDGE && (tok < lo || tok >= hi)) {
#pragma unroll
        for (int w = 0; w < VW; ++w) x.v[i][w] = 0u;
        x.vsc[i] = 0u;
      }
    }
  };

  float o[NH][MT][4];  // O^T: (dim row g | g+8 of m-tile i, head 8 nh + 2t | 2t+1)
#pragma unroll
  for (int nh = 0; nh < NH; ++nh)
#pragma unroll
    for (int i = 0; i < MT; ++i) o[nh][i][0] = o[nh][i][1] = o[nh][i][2] = o[nh][i][3] = 0.f;
  float m_r[NH][2], l_r[NH][2], pm[NH][2];  // per head 8 nh + 2t + c
#pragma unroll
  for (int nh = 0; nh < NH; ++nh)
#pragma unroll
    for (int c = 0; c < 2; ++c) { m_r[nh][c] = -INFINITY; l_r[nh][c] = 0.f; pm[nh][c] = 0.f; }

  auto compute_tile = [&](const TileT& x, int start) {
    // ---- S^T = K Q^T: C(token g | g+8, head 2t | 2t+1)
    uint32_t ks2[2][kGroup<KF> ? TileT::KSB : 1];  // Tile's: g++ 12 fails on captured ones
    if constexpr (KGRP) {
#pragma unroll
      for (int j = 0; j < 2; ++j) row_scales<KF, TK>(x.ksc[j], ks2[j]);
    }
    float s[NH][4];
#pragma unroll
    for (int nh = 0; nh < NH; ++nh) s[nh][0] = s[nh][1] = s[nh][2] = s[nh][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      const int wi = kk / 2, r0 = 2 * (kk & 1);
      uint32_t a[4];
      if constexpr (KBYTE) {  // word kk: its low half is k = 2t, 2t+1, its high half 2t+8, 2t+9
        a[0] = byte_pair<KF>(x.k[0][kk], 0); a[1] = byte_pair<KF>(x.k[1][kk], 0);
        a[2] = byte_pair<KF>(x.k[0][kk], 1); a[3] = byte_pair<KF>(x.k[1][kk], 1);
      } else {
        a[0] = code_pair_r<KF, TK>(x.k[0][wi], r0); a[1] = code_pair_r<KF, TK>(x.k[1][wi], r0);
        a[2] = code_pair_r<KF, TK>(x.k[0][wi], r0 + 1); a[3] = code_pair_r<KF, TK>(x.k[1][wi], r0 + 1);
      }
      if constexpr (KGRP) {
        const int gi = (D / 4) >= GROUP ? (8 * wi) / GROUP : 0;
        a[0] = apply_scale<KF, TK>(a[0], ks2[0][gi]);
        a[1] = apply_scale<KF, TK>(a[1], ks2[1][gi]);
        a[2] = apply_scale<KF, TK>(a[2], ks2[0][gi]);
        a[3] = apply_scale<KF, TK>(a[3], ks2[1][gi]);
      }
#pragma unroll
      for (int nh = 0; nh < NH; ++nh) Op<TK>::mma(s[nh], a, qb[nh][kk][0], qb[nh][kk][1]);
    }
    // ---- scores (log2 domain): INT4 affine, scale, soft-cap; tokens outside [lo, hi) -> -inf
    const bool interior = start >= lo && start + 16 <= hi;
#pragma unroll
    for (int nh = 0; nh < NH; ++nh)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[nh][e];
        if constexpr (KAFF) {
          const uint32_t sm = x.ksc[e >> 1];
          v = v * Op<__half>::to_f32(sm & 0xFFFFu) + qsum[nh][e & 1] * Op<__half>::to_f32(sm >> 16);
        }
        v *= k_fac;
        if (softcap) v = cap_log2 * (1.f - 2.f * __frcp_rn(ex2(2.f * LOG2E * v) + 1.f));
        if (!interior) {
          const int tok = start + g + 8 * (e >> 1);
          v = (tok >= lo && tok < hi) ? v : -INFINITY;
        }
        s[nh][e] = v;
      }
    // ---- online softmax per head (a head's 16 tokens live in lanes t, t+4, ..., t+28)
    float alpha[NH][2];
    bool rescale = false;
#pragma unroll
    for (int nh = 0; nh < NH; ++nh)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float mx = fmaxf(s[nh][c], s[nh][2 + c]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m_r[nh][c], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        alpha[nh][c] = ex2(m_r[nh][c] - m_use);
        rescale |= alpha[nh][c] != 1.f;
        m_r[nh][c] = m_new;
        s[nh][c] = ex2(s[nh][c] - m_use);
        s[nh][2 + c] = ex2(s[nh][2 + c] - m_use);
        l_r[nh][c] = l_r[nh][c] * alpha[nh][c] + s[nh][c] + s[nh][2 + c];
      }
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int nh = 0; nh < NH; ++nh) {
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          o[nh][i][0] *= alpha[nh][0]; o[nh][i][1] *= alpha[nh][1];
          o[nh][i][2] *= alpha[nh][0]; o[nh][i][3] *= alpha[nh][1];
        }
        pm[nh][0] *= alpha[nh][0];
        pm[nh][1] *= alpha[nh][1];
      }
    }
    // ---- P^T as the B operand (INT4: p * sc folded in, p * mn summed per head)
    uint32_t pb[NH][2];
#pragma unroll
    for (int nh = 0; nh < NH; ++nh) {
      if constexpr (VAFF) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float sc = Op<__half>::to_f32(x.vint[j] & 0xFFFFu), mn = Op<__half>::to_f32(x.vint[j] >> 16);
          pm[nh][0] += s[nh][2 * j] * mn;
          pm[nh][1] += s[nh][2 * j + 1] * mn;
          s[nh][2 * j] *= sc;
          s[nh][2 * j + 1] *= sc;
        }
      }
      pb[nh][0] = transpose8x8(Op<TV>::pack(s[nh][0], s[nh][1]));  // (head g, tokens 2t, 2t+1)
      pb[nh][1] = transpose8x8(Op<TV>::pack(s[nh][2], s[nh][3]));  // (head g, tokens 2t+8, 2t+9)
    }
    // ---- O^T += V^T P^T: m-tile i rows g / g+8 = this thread's dims 2i / 2i+1 of its eighth
    uint32_t vs01[TileT::VSB], vs23[TileT::VSB];
    if constexpr (VGRP) {
#pragma unroll
      for (int e = 0; e < VSB; ++e) {
        const uint32_t sh = 8 * e;
        vs01[e] = scale2<VF, TV>(((x.vsc[0] >> sh) & 0xFFu) | (((x.vsc[1] >> sh) & 0xFFu) << 8));
        vs23[e] = scale2<VF, TV>(((x.vsc[2] >> sh) & 0xFFu) | (((x.vsc[3] >> sh) & 0xFFu) << 8));
      }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      uint32_t a[4];
      const int wi = VBYTE ? i / 2 : i / 4;
      if constexpr (VBYTE) {  // dims 2i, 2i+1 = bytes b, b+1 of word wi; halves pair tokens (2t, 2t+1)
        const uint32_t sel = (2 * i) % 4 == 0 ? 0x5140u : 0x7362u;
        const uint32_t u01 = __byte_perm(x.v[0][wi], x.v[1][wi], sel);
        const uint32_t u23 = __byte_perm(x.v[2][wi], x.v[3][wi], sel);
        a[0] = byte_pair<VF>(u01, 0); a[1] = byte_pair<VF>(u01, 1);
        a[2] = byte_pair<VF>(u23, 0); a[3] = byte_pair<VF>(u23, 1);
      } else {  // dims 2i, 2i+1 = nibbles nib, nib+1 of word wi; halves pair tokens (2t, 2t+1)
        const int nib = (2 * i) % 8;
        const uint32_t sel = nib < 4 ? 0x5410u : 0x7632u;
        const uint32_t u01 = __byte_perm(x.v[0][wi], x.v[1][wi], sel);
        const uint32_t u23 = __byte_perm(x.v[2][wi], x.v[3][wi], sel);
        a[0] = code_pair_r<VF, TV>(u01, nib & 3); a[1] = code_pair_r<VF, TV>(u01, (nib & 3) + 1);
        a[2] = code_pair_r<VF, TV>(u23, nib & 3); a[3] = code_pair_r<VF, TV>(u23, (nib & 3) + 1);
      }
      if constexpr (VGRP) {
        const int gi = (D / 8) >= GROUP ? (8 * wi) / GROUP : 0;
        a[0] = apply_scale<VF, TV>(a[0], vs01[gi]);
        a[1] = apply_scale<VF, TV>(a[1], vs01[gi]);
        a[2] = apply_scale<VF, TV>(a[2], vs23[gi]);
        a[3] = apply_scale<VF, TV>(a[3], vs23[gi]);
      }
#pragma unroll
      for (int nh = 0; nh < NH; ++nh) Op<TV>::mma(o[nh][i], a, pb[nh][0], pb[nh][1]);
    }
  };

  // ---- main loop: warp w takes tiles w, w + NW, ...; the next tile's words load during this one
  constexpr int STEP = 16 * NW;
  int start = (lo & ~15) + 16 * warp;
  TileT ta, tb;  // ping-pong: one tile computes while the next one's words are in flight
  auto load = [&](TileT& x, int at) {
    if (at < lo || at + 16 > hi) load_tile(x, at, std::true_type{});
    else load_tile(x, at, std::false_type{});
  };
  if (start < hi) load(ta, start);
  while (start < hi) {
    if (start + STEP < hi) load(tb, start + STEP);
    compute_tile(ta, start);
    start += STEP;
    if (start >= hi) break;
    if (start + STEP < hi) load(ta, start + STEP);
    compute_tile(tb, start);
    start += STEP;
  }

  // ---- merge the warps: reduce l (and INT4's p * mn) over the 8 token lanes, stage in shared memory
  float* sm_m = smem;
  float* sm_l = smem + NW * 16;
  float* sm_o = smem + NW * 32;
#pragma unroll
  for (int nh = 0; nh < NH; ++nh)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int x = 4; x < 32; x <<= 1) {
        l_r[nh][c] += __shfl_xor_sync(0xffffffffu, l_r[nh][c], x);
        pm[nh][c] += __shfl_xor_sync(0xffffffffu, pm[nh][c], x);
      }
      const int head = 8 * nh + 2 * t + c;
      if (head < qh) {
        if (g == 0) {
          sm_m[warp * 16 + head] = m_r[nh][c];
          sm_l[warp * 16 + head] = l_r[nh][c];
        }
        float* orow = sm_o + ((int64_t)warp * qh + head) * D + g * (D / 8);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          orow[2 * i] = o[nh][i][c] * v_fac + pm[nh][c];
          orow[2 * i + 1] = o[nh][i][2 + c] * v_fac + pm[nh][c];
        }
      }
    }
  __syncthreads();
  for (int e = threadIdx.x; e < qh * D; e += NW * 32) {
    const int row = e / D, d = e % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, sm_m[w * 16 + row]);
    float L = 0.f, acc = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float f = exp2f(sm_m[w * 16 + row] - mx);
        L += sm_l[w * 16 + row] * f;
        acc += sm_o[((int64_t)w * qh + row) * D + d] * f;
      }
    }
    const int64_t hq = (int64_t)h * qh + row;
    // empty split: 0 and -inf; NaN scores (L is NaN) stay NaN in both, as in the reference attention
    const bool empty = L == 0.f;
    p.mo[(int64_t)b * p.mo_sb + hq * p.mo_sh + (int64_t)sp * p.mo_ss + d] = empty ? 0.f : acc / L;
    if (d == 0) p.ml[(int64_t)b * p.ml_sb + hq * p.ml_sh + sp] = empty ? -INFINITY : mx + log2f(L);
  }
}

// Every launch of this file (the host build runs the grid on CPU threads instead: tests/kernels/host_decode.cpp).
cudaError_t launch_kernel(void (*kernel)(DecodeParams), dim3 grid, int threads, size_t smem, cudaStream_t stream,
                          const DecodeParams& p) {
#ifdef KVX_HOST_EMULATION
  return host_launch(kernel, grid, threads, smem, p);
#else
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  kernel<<<grid, threads, smem, stream>>>(p);
  return cudaGetLastError();
#endif
}

template <int KF, int VF, typename TK, typename TV, int D, int GROUP, bool QB>
cudaError_t launch(const DecodeParams& p, int batch, int hkv, cudaStream_t stream) {
  const size_t smem = (size_t)merge_floats(p.qh, D) * sizeof(float) + THREAD_BASES_BYTES;
  auto kern = p.qh > 8 ? decode_kernel<KF, VF, TK, TV, D, GROUP, 2, QB> : decode_kernel<KF, VF, TK, TV, D, GROUP, 1, QB>;
  return launch_kernel(kern, dim3(p.num_splits, hkv, batch), NW * 32, smem, stream, p);
}

// KF / VF: K and V formats; TK / TV: the operand types of the QK^T and PV products.
template <int KF, int VF, typename TK, typename TV, int GROUP, bool QB = false>
cudaError_t by_dim(const DecodeParams& p, int d, int batch, int hkv, cudaStream_t s) {
  switch (d) {
    case 64: return launch<KF, VF, TK, TV, 64, GROUP, QB>(p, batch, hkv, s);
    case 128: return launch<KF, VF, TK, TV, 128, GROUP, QB>(p, batch, hkv, s);
    case 256: return launch<KF, VF, TK, TV, 256, GROUP, QB>(p, batch, hkv, s);
    default: return cudaErrorInvalidValue;
  }
}

// One format for K and V, operands of type T.
template <int FMT, typename T, int GROUP, bool QB = false>
cudaError_t same(const DecodeParams& p, int d, int batch, int hkv, cudaStream_t s) {
  return by_dim<FMT, FMT, T, T, GROUP, QB>(p, d, batch, hkv, s);
}

// ---- split merge: o = sum_s w_s o_s / sum_s w_s with w_s = 2^ml_s (+ the sink's 2^(sink log2 e), no value), the
// LSE in natural log; the math of the Triton merge (ops/triton/merge.py), which merges for the Triton decode. Block
// (32 columns, MW warps): warp w folds splits w, w + MW, ... online, then warp 0 folds the warps and the sink.
constexpr int MW = 4;

__device__ __forceinline__ void fold(float& m, float& l, float& acc, float m2, float l2, float acc2) {
  const float mn = fmaxf(m, m2);  // NaN log-sum-exps are dropped here and come back through l (NaN weight)
  const float ms = mn == -INFINITY ? 0.f : mn;
  const float a = exp2f(m - ms), b = exp2f(m2 - ms);
  l = l * a + l2 * b;
  acc = acc * a + acc2 * b;
  m = mn;
}

template <typename TO>
__device__ __forceinline__ TO to_out(float x);
template <>
__device__ __forceinline__ float to_out<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half to_out<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 to_out<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename TO>
__device__ __forceinline__ float out_max();
template <>
__device__ __forceinline__ float out_max<float>() { return 3.402823466e38f; }
template <>
__device__ __forceinline__ float out_max<__half>() { return 65504.f; }
template <>
__device__ __forceinline__ float out_max<__nv_bfloat16>() { return 3.38953139e38f; }

__device__ __forceinline__ float saturate_finite(float y, float limit) {  // NaN and +-inf pass through
  return isfinite(y) ? fminf(fmaxf(y, -limit), limit) : y;
}

// The merged value of column `col` of row (b, hq): warps fold their splits, warp 0 folds the warps and the sink
// (all threads return it; `sm` is reused, so callers sync before the next column).
__device__ __forceinline__ float merge_column(const DecodeParams& p, int64_t b, int64_t hq, int col, float& m_out,
                                              float& l_out, float (*sm)[MW][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* ml = p.ml + b * p.ml_sb + hq * p.ml_sh;
  const float* mo = p.mo + b * p.mo_sb + hq * p.mo_sh + col;
  float m = -INFINITY, l = 0.f, acc = 0.f;
  for (int s = warp; s < p.num_splits; s += MW) fold(m, l, acc, ml[s], 1.f, mo[(int64_t)s * p.mo_ss]);
  sm[0][warp][lane] = m;
  sm[1][warp][lane] = l;
  sm[2][warp][lane] = acc;
  __syncthreads();
  m = sm[0][0][lane], l = sm[1][0][lane], acc = sm[2][0][lane];
#pragma unroll
  for (int w = 1; w < MW; ++w) fold(m, l, acc, sm[0][w][lane], sm[1][w][lane], sm[2][w][lane]);
  if (p.sinks) fold(m, l, acc, p.sinks[hq] * LOG2E, 1.f, 0.f);
  m_out = m, l_out = l;
  return acc / (l > 0.f ? l : 1.f);  // empty: 0; NaN scores: NaN
}

__device__ __forceinline__ void store_lse(const DecodeParams& p, int64_t b, int64_t hq, float m, float l) {
  p.lse[b * p.lse_sb + hq * p.lse_sh] = l > 0.f ? (m + log2f(l)) * 0.6931471805599453f : (l == 0.f ? -INFINITY : NAN);
}

// Block (32 columns, MW warps) per 32 output columns of a row.
template <typename TO>
__global__ void __launch_bounds__(MW * 32) merge_kernel(const DecodeParams p) {
  __shared__ float sm[3][MW][32];
  const int col = blockIdx.x * 32 + (threadIdx.x & 31);
  const int64_t hq = blockIdx.y, b = blockIdx.z;
  float m, l;
  const float out = merge_column(p, b, hq, col, m, l, sm);
  if (threadIdx.x >= 32) return;
  reinterpret_cast<TO*>(p.o)[b * p.o_sb + hq * p.o_sh + col] = to_out<TO>(out);
  if (col == 0) store_lse(p, b, hq, m, l);
}

// formats/rotation.py's Hadamard rotation of one row held in shared memory (FP32, finite values already saturated to
// FP32_MAX / D): stage h maps each pair (a, b) = (y[i], y[i + h]) of a 2h-block to (a + b, a - b), then times the FP32
// value of 1 / sqrt(D), finite results saturated to TO's largest value and rounded to nearest even into `dst`. The
// same bits as the torch butterfly and the fused Triton kernel (ops/triton/hadamard.py). Called by a whole block.
template <typename TO, int D>
__device__ __forceinline__ void rotate_row(float* row, TO* dst) {
  for (int h = 1; h < D; h <<= 1) {
    for (int i = threadIdx.x; i < D / 2; i += blockDim.x) {
      const int a = (i / h) * 2 * h + i % h;
      const float x = row[a], y = row[a + h];
      row[a] = x + y;
      row[a + h] = x - y;
    }
    __syncthreads();
  }
  const float inv_sqrt = (float)(1.0 / sqrt((double)D));
  for (int i = threadIdx.x; i < D; i += blockDim.x) dst[i] = to_out<TO>(saturate_finite(row[i] * inv_sqrt, out_max<TO>()));
}

// `_rot` formats: one block per row merges its D columns into shared memory in FP32, then rotates the row back
// (`rotate_row`): the same bits as merging to FP32 and rotating after.
template <typename TO, int D>
__global__ void __launch_bounds__(MW * 32) merge_rotate_kernel(const DecodeParams p) {
  __shared__ float sm[3][MW][32];
  __shared__ float row[D];
  const int64_t hq = blockIdx.y, b = blockIdx.z;
  float m = 0.f, l = 0.f;
  for (int c0 = 0; c0 < D; c0 += 32) {
    float mc, lc;
    const float v = merge_column(p, b, hq, c0 + (threadIdx.x & 31), mc, lc, sm);
    if (threadIdx.x < 32) row[c0 + threadIdx.x] = saturate_finite(v, 3.402823466e38f / D);
    if (c0 == 0) m = mc, l = lc;
    __syncthreads();
  }
  rotate_row<TO, D>(row, reinterpret_cast<TO*>(p.o) + b * p.o_sb + hq * p.o_sh);
  if (threadIdx.x == 0) store_lse(p, b, hq, m, l);
}

// `_rot` formats: the queries rotated into the step's scratch `q_rot` ([B, Hq, D] contiguous, the query dtype T),
// one block per (head, sequence), as ops.rotation.rotate would (the same bits): the decode then reads them.
template <typename T, int D>
__global__ void __launch_bounds__(MW * 32) rotate_q_kernel(const DecodeParams p) {
  __shared__ float row[D];
  const int64_t hq = blockIdx.x, b = blockIdx.y;
  const T* q = reinterpret_cast<const T*>(p.q) + b * p.q_sb + hq * p.q_sh;
  for (int i = threadIdx.x; i < D; i += blockDim.x) row[i] = saturate_finite(to_float(q[i]), 3.402823466e38f / D);
  __syncthreads();
  rotate_row<T, D>(row, reinterpret_cast<T*>(p.q_rot) + (b * gridDim.x + hq) * D);
}

template <typename T>
cudaError_t rotate_q_by_dim(const DecodeParams& p, int d, int batch, int hq, cudaStream_t stream) {
  const dim3 grid(hq, batch);
  switch (d) {
    case 64: return launch_kernel(rotate_q_kernel<T, 64>, grid, MW * 32, 0, stream, p);
    case 128: return launch_kernel(rotate_q_kernel<T, 128>, grid, MW * 32, 0, stream, p);
    case 256: return launch_kernel(rotate_q_kernel<T, 256>, grid, MW * 32, 0, stream, p);
    default: return cudaErrorInvalidValue;
  }
}

template <typename TO>
cudaError_t merge_by_dim(const DecodeParams& p, int d, int batch, int hq, cudaStream_t stream) {
  if (!p.rotate_out) return launch_kernel(merge_kernel<TO>, dim3(d / 32, hq, batch), MW * 32, 0, stream, p);
  const dim3 grid(1, hq, batch);
  switch (d) {
    case 64: return launch_kernel(merge_rotate_kernel<TO, 64>, grid, MW * 32, 0, stream, p);
    case 128: return launch_kernel(merge_rotate_kernel<TO, 128>, grid, MW * 32, 0, stream, p);
    case 256: return launch_kernel(merge_rotate_kernel<TO, 256>, grid, MW * 32, 0, stream, p);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_merge(const DecodeParams& p, int d, int batch, int hq, cudaStream_t stream) {
  switch (p.o_dtype) {
    case 0: return merge_by_dim<float>(p, d, batch, hq, stream);
    case 1: return merge_by_dim<__half>(p, d, batch, hq, stream);
    case 2: return merge_by_dim<__nv_bfloat16>(p, d, batch, hq, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kvx

extern "C" {

// Size of DecodeParams, for the ctypes mirror to check itself against.
int kvx_decode_params_size(void) { return (int)sizeof(kvx::DecodeParams); }

// DecodeParams' fields in declaration order as "name@offset ..." (the ctypes mirror checks its layout by name, which a
// size check cannot: two swapped pointers have the same size).
const char* kvx_decode_params_layout(void) {
  static char buf[1024];
  using P = kvx::DecodeParams;
  int n = 0;
#define F(f) n += snprintf(buf + n, sizeof(buf) - n, "%s%s@%d", n ? " " : "", #f, (int)offsetof(P, f));
  F(kd) F(kd_sb) F(kd_sh) F(kd_st) F(ks) F(ks_sb) F(ks_sh) F(ks_st)
  F(vd) F(vd_sb) F(vd_sh) F(vd_st) F(vs) F(vs_sb) F(vs_sh) F(vs_st)
  F(kg) F(vg) F(qs) F(bt) F(bt_sb) F(seq) F(mo) F(mo_sb)
  F(mo_sh) F(mo_ss) F(ml) F(ml_sb) F(ml_sh) F(sinks) F(sm_scale) F(softcap)
  F(window) F(qh) F(bs) F(num_splits) F(rotate_out) F(rows_per_seq) F(q_rot) F(q) F(q_sb) F(q_sh) F(o)
  F(o_sb) F(o_sh) F(lse) F(lse_sb) F(lse_sh) F(o_dtype)
#undef F
  return buf;
}

// kfmt / vfmt: 0 NVFP4 (group 16), 1 MXFP4 (group 16 | 32, bf16 queries), 2 INT4, 3 FP8 E4M3, 4 FP8 E5M2,
// 5 INT8; K and V share a format, or K is E4M3 and V NVFP4 (k8v4). bf16: the query dtype is bf16 (else f16).
// 4 warps per CTA. With p->q_rot set, the queries are rotated into it first; with p->o set, the split merge follows
// on the same stream (rotation, decode and merge: one call).
// Returns a cudaError_t (0 = launched); cudaErrorInvalidValue for an unsupported combination. The entry point below
// checks the parameters first.
static int decode_only(const kvx::DecodeParams* p, int kfmt, int vfmt, int bf16, int head_dim, int group,
                       int num_warps, int batch, int num_kv_heads, void* stream) {
  using namespace kvx;
  using bf = __nv_bfloat16;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int d = head_dim, b = batch, hkv = num_kv_heads;
  if (kfmt == F_E4M3 && vfmt == F_NVFP4 && group == 16)  // k8v4: f16 operands for both products
    return bf16 ? (int)by_dim<F_E4M3, F_NVFP4, __half, __half, 16, true>(*p, d, b, hkv, s)
                : (int)by_dim<F_E4M3, F_NVFP4, __half, __half, 16>(*p, d, b, hkv, s);
  if (kfmt != vfmt) return (int)cudaErrorInvalidValue;
  const int fmt = kfmt;
  if (fmt == F_NVFP4 && group == 16)
    return bf16 ? (int)same<F_NVFP4, __half, 16, true>(*p, d, b, hkv, s) : (int)same<F_NVFP4, __half, 16>(*p, d, b, hkv, s);
  if (fmt == F_MXFP4 && bf16 && group == 16) return (int)same<F_MXFP4, bf, 16>(*p, d, b, hkv, s);
  if (fmt == F_MXFP4 && bf16 && group == 32) return (int)same<F_MXFP4, bf, 32>(*p, d, b, hkv, s);
  if (fmt == F_INT4)
    return bf16 ? (int)by_dim<F_INT4, F_INT4, __half, bf, 16, true>(*p, d, b, hkv, s)
                : (int)same<F_INT4, __half, 16>(*p, d, b, hkv, s);
  if (fmt == F_INT8)
    return bf16 ? (int)same<F_INT8, __half, 16, true>(*p, d, b, hkv, s) : (int)same<F_INT8, __half, 16>(*p, d, b, hkv, s);
  if (fmt == F_E4M3)
    return bf16 ? (int)same<F_E4M3, __half, 16, true>(*p, d, b, hkv, s) : (int)same<F_E4M3, __half, 16>(*p, d, b, hkv, s);
  if (fmt == F_E5M2)
    return bf16 ? (int)same<F_E5M2, __half, 16, true>(*p, d, b, hkv, s) : (int)same<F_E5M2, __half, 16>(*p, d, b, hkv, s);
  return (int)cudaErrorInvalidValue;
}

// The split merge alone (the step group's mo / ml / num_splits / sinks, the call group's o / lse / o_dtype): the
// merge that kvx_paged_decode launches after the decode, for callers and tests that hold partials of their own.
int kvx_merge_splits(const kvx::DecodeParams* p, int head_dim, int batch, int num_qo_heads, void* stream) {
  if (p->o == nullptr || p->lse == nullptr || head_dim % 32 != 0 || batch < 0 || num_qo_heads < 1)
    return (int)cudaErrorInvalidValue;
  if (batch == 0) return 0;
  return (int)kvx::launch_merge(*p, head_dim, batch, num_qo_heads, reinterpret_cast<cudaStream_t>(stream));
}

int kvx_paged_decode(const kvx::DecodeParams* p, int kfmt, int vfmt, int bf16, int head_dim, int group,
                     int num_warps, int batch, int num_kv_heads, void* stream) {
  // every parameter checked before the first launch (the q rotation writes the scratch): a refused call runs nothing
  if (p->qh < 1 || p->qh > 16 || p->bs <= 0 || p->bs % 16 != 0 || p->rows_per_seq < 1 || num_warps != kvx::NW ||
      (p->o != nullptr && (p->lse == nullptr || p->o_dtype < 0 || p->o_dtype > 2)))
    return (int)cudaErrorInvalidValue;
  if (batch == 0) return 0;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int hq = num_kv_heads * p->qh;
  kvx::DecodeParams rp;  // with q_rot: the decode reads the rotated queries from the scratch
  if (p->q_rot != nullptr) {
    const cudaError_t e = bf16 ? kvx::rotate_q_by_dim<__nv_bfloat16>(*p, head_dim, batch, hq, s)
                               : kvx::rotate_q_by_dim<__half>(*p, head_dim, batch, hq, s);
    if (e != cudaSuccess) return (int)e;
    rp = *p;
    rp.q = p->q_rot, rp.q_sb = (int64_t)hq * head_dim, rp.q_sh = head_dim;
    p = &rp;
  }
  const int err = decode_only(p, kfmt, vfmt, bf16, head_dim, group, num_warps, batch, num_kv_heads, stream);
  if (err != 0 || p->o == nullptr) return err;
  return (int)kvx::launch_merge(*p, head_dim, batch, hq, s);
}

}  // extern "C"
