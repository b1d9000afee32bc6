// The CUDA write (kvx_core/ops/cuda/paged_write.cu) compiled for the host, so the CPU suite runs the kernel's own
// code against the formats' encode (tests/kernels/test_write_kernel.py, backend "cuda_host"); the execution model and
// the intrinsics: host_cuda.h. Emulated here: the write's PTX pieces (byte permute, FP8 encode and decode, the
// reciprocal estimate), each by its PTX definition. The estimate is the correctly rounded 1 / d (the hardware's is
// within an ulp of it; the Newton step and the corrected quotient that follow make the division's result the same
// for both: the exhaustive GPU tests check the hardware's).
#include "host_cuda.h"

namespace kvx_write {

// prmt.b32, default mode: byte n of the result is byte (sel >> 4n) & 7 of {b, a}, or its top bit replicated when
// bit 3 of that selector nibble is set.
static inline uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  const uint64_t x = ((uint64_t)b << 32) | a;
  uint32_t d = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t s = (sel >> (4 * n)) & 0xF;
    uint32_t byte = (uint32_t)(x >> (8 * (s & 7))) & 0xFF;
    if (s & 8) byte = (byte & 0x80) ? 0xFF : 0;
    d |= byte << (8 * n);
  }
  return d;
}

// FP8 (E4M3 / E5M2) code of a finite FP32 value by cvt.rn.satfinite: the nearest of the format's finite values
// (ties to the even code, whose last mantissa bit is 0), the largest for magnitudes beyond it, the sign kept.
template <bool E5M2>
static uint32_t f8_code(float x) {
  const uint32_t top = E5M2 ? 0x7B : 0x7E;  // the largest finite code
  const uint32_t sign = (__float_as_uint(x) >> 24) & 0x80;
  const double a = std::fabs((double)x);
  auto value = [](uint32_t c) { return (double)kvx_host::fp8_value<E5M2>(c); };
  uint32_t lo = 0, hi = top;  // the last code whose value is <= a
  if (a >= value(top)) return sign | top;
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) / 2;
    if (value(mid) <= a) lo = mid; else hi = mid - 1;
  }
  const double below = value(lo), above = value(lo + 1);
  const uint32_t c = (a - below < above - a || (a - below == above - a && (lo & 1) == 0)) ? lo : lo + 1;
  return sign | c;
}

template <bool E5M2>
static inline uint32_t f8x2(float lo, float hi) { return f8_code<E5M2>(lo) | (f8_code<E5M2>(hi) << 8); }

static inline float e4m3_value(uint32_t byte) { return kvx_host::fp8_value<false>(byte); }

static inline float rcp_approx(float d) { return 1.0f / d; }

template <typename K, typename P>
cudaError_t host_launch(K kernel, dim3 grid, int threads, const P& p) {
  return kvx_host::launch(kernel, grid, threads, 0, p);
}

}  // namespace kvx_write

#include KVX_SOURCE
