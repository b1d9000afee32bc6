// The CUDA decode (kvx_core/ops/cuda/paged_decode_mma.cu: decode, split merge, query rotation) compiled for the
// host, so the CPU suite runs the kernels' own code against the float64 oracle (tests/kernels/test_cuda_decode.py,
// backend "cuda_host"); the execution model and the intrinsics: host_cuda.h. Emulated here: the decode's PTX pieces,
// each by its PTX definition. The tensor-core product mma.m16n8k16 (f16 / bf16 in, FP32 accumulate) gathers the
// warp's fragments by the PTX ISA's layouts and sums each output in FP64 (the hardware's order and internal width are
// unspecified: tests hold the decode to the oracle with a tolerance, never to bits); MOVMATRIX likewise; ex2.approx is
// exp2f with its subnormal results flushed (the hardware's is within 2 ulp).
#include "host_cuda.h"

namespace kvx {

using kvx_host::exchange;
using kvx_host::lane;

inline float ex2(float x) {
  const float y = std::exp2(x);
  return y < 0x1p-126f ? 0.0f : y;  // .ftz
}

inline float f16_value(uint32_t h) { return __half2float(__ushort_as_half((unsigned short)h)); }
inline float bf16_value(uint32_t h) { return __uint_as_float(h << 16); }
inline uint32_t f16_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }
inline uint32_t bf16_bits(float x) {
  const __nv_bfloat16 b = __float2bfloat16_rn(x);
  unsigned short u;
  std::memcpy(&u, &b, 2);
  return u;
}

// Packed FMA, each half rounded once: the FP64 product of two 16-bit values is exact and so is its sum with a third
// wherever the kernel uses it (scales and magic numbers: exact by construction).
template <float (*VALUE)(uint32_t), uint32_t (*BITS)(float)>
inline uint32_t fma_x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d = 0;
  for (int h = 0; h < 2; ++h) {
    const auto part = [&](uint32_t x) { return (x >> (16 * h)) & 0xFFFFu; };
    const double r = std::fma((double)VALUE(part(a)), (double)VALUE(part(b)), (double)VALUE(part(c)));
    d |= BITS((float)r) << (16 * h);
  }
  return d;
}
inline uint32_t fma_f16x2(uint32_t a, uint32_t b, uint32_t c) { return fma_x2<f16_value, f16_bits>(a, b, c); }
inline uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) { return fma_x2<bf16_value, bf16_bits>(a, b, c); }
inline uint32_t pack_f16x2(float lo, float hi) { return f16_bits(lo) | (f16_bits(hi) << 16); }
inline uint32_t pack_bf16x2(float lo, float hi) { return bf16_bits(lo) | (bf16_bits(hi) << 16); }

// An FP8 byte -> its f16 bits (exact: both FP8 formats are subsets of f16; E5M2 is f16's high byte).
template <bool E5M2>
inline uint32_t fp8_f16(uint32_t byte) {
  if (E5M2) return byte << 8;
  const float v = kvx_host::fp8_value<false>(byte);
  return std::isnan(v) ? ((byte & 0x80u) << 8) | 0x7E00u : f16_bits(v);
}
template <bool E5M2>
inline uint32_t fp8x2_f16x2(unsigned short v) { return fp8_f16<E5M2>(v & 0xFFu) | (fp8_f16<E5M2>(v >> 8) << 16); }

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: lane l (group g = l / 4, t = l % 4) holds A[g + 8 (i % 2)]
// [2t + 8 (i / 2) + j] in half j of a[i], B[2t + 8 i + j][g] in half j of b_i, and C / D[g + 8 (i / 2)][2t + i % 2]
// in c[i].
template <bool BF16>
inline void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  constexpr auto VALUE = BF16 ? bf16_value : f16_value;
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  const unsigned l = lane();
  const auto d = exchange(mine, 6, [&](auto& s) {
    std::array<float, 4> out;
    const auto half = [](uint32_t w, int j) { return VALUE((w >> (16 * j)) & 0xFFFFu); };
    for (int i = 0; i < 4; ++i) {
      const int row = (int)(l / 4) + 8 * (i / 2), col = 2 * (int)(l % 4) + i % 2;
      double acc = c[i];
      for (int k = 0; k < 16; ++k) {
        const double av = half(s[(row % 8) * 4 + (k % 8) / 2][(row / 8) + 2 * (k / 8)], k % 2);
        const double bv = half(s[col * 4 + (k % 8) / 2][4 + k / 8], k % 2);
        acc += av * bv;
      }
      out[i] = (float)acc;
    }
    return out;
  });
  for (int i = 0; i < 4; ++i) c[i] = d[i];
}

// movmatrix.sync.aligned.m8n8.trans.b16: lane l holds row l / 4, columns 2 (l % 4) + j (half j); the result is the
// transpose, held the same way.
inline uint32_t transpose8x8(uint32_t x) {
  const unsigned l = lane();
  return exchange(&x, 1, [&](auto& s) {
    uint32_t y = 0;
    for (int j = 0; j < 2; ++j) {  // element (row r, column c) of the transpose is (c, r) of the input
      const int r = (int)(l / 4), c = 2 * (int)(l % 4) + j;
      y |= ((s[c * 4 + r / 2][0] >> (16 * (r % 2))) & 0xFFFFu) << (16 * j);
    }
    return y;
  });
}

inline ulonglong2 lds_u64x2(const ulonglong2* p) { return *p; }

template <typename K, typename P>
cudaError_t host_launch(K kernel, dim3 grid, int threads, size_t smem, const P& p) {
  return kvx_host::launch(kernel, grid, threads, smem, p);
}

}  // namespace kvx

#define DYNAMIC_SHARED(T, name) T* const name = reinterpret_cast<T*>(kvx_host::block->smem.data())

#include KVX_SOURCE
