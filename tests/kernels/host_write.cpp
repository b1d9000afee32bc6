// The CUDA write (kvx_core/ops/cuda/paged_write.cu) compiled for the host, so the CPU suite runs the kernel's own
// code against the formats' encode (tests/kernels/test_write_kernel.py, backend "cuda_host"): every thread of the
// grid runs on a CPU thread, a warp's 32 lanes meet at a barrier in each shuffle. g++ compiles the file with
// -DKVX_HOST_EMULATION -ffp-contract=off (each FP32 operation rounded once, as __fmaf_rn / __fmul_rn ... are on the
// GPU) and -fno-strict-aliasing (the kernel reads words through casts, which nvcc keeps). What is emulated: the
// PTX pieces (FP8 encode and decode, the reciprocal estimate) and the CUDA intrinsics the kernel calls, each by its
// PTX definition. The estimate is the correctly rounded 1 / d (the hardware's is within an ulp
// of it; the Newton step and the corrected quotient that follow make the division's result the same for both: the
// exhaustive GPU tests check the hardware's).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace kvx_host {

thread_local uint3 tid, bid;

struct Warp {  // one warp's shuffle exchange
  std::barrier<> meet{32};
  uint32_t slot[32];
};
thread_local Warp* warp;

template <typename T>
T shfl_xor(T v, int mask) {
  const unsigned lane = tid.x % 32;
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  warp->slot[lane] = bits;
  warp->meet.arrive_and_wait();
  bits = warp->slot[lane ^ mask];
  warp->meet.arrive_and_wait();
  std::memcpy(&v, &bits, sizeof(bits));
  return v;
}

}  // namespace kvx_host

#define threadIdx kvx_host::tid
#define blockIdx kvx_host::bid
#define __launch_bounds__(n)
using std::max;
using std::min;

static inline uint32_t __float_as_uint(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
static inline float __uint_as_float(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}
static inline float __int_as_float(int b) { return __uint_as_float((uint32_t)b); }
static inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __saturatef(float x) { return std::isnan(x) ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline unsigned __vmaxu2(unsigned a, unsigned b) {
  const unsigned lo = std::max(a & 0xFFFFu, b & 0xFFFFu), hi = std::max(a >> 16, b >> 16);
  return lo | (hi << 16);
}
template <typename T>
static inline T __shfl_xor_sync(unsigned, T v, int mask) { return kvx_host::shfl_xor(v, mask); }

namespace kvx_write {

// FP8 (E4M3 / E5M2) code of a finite FP32 value by cvt.rn.satfinite: the nearest of the format's finite values
// (ties to the even code, whose last mantissa bit is 0), the largest for magnitudes beyond it, the sign kept.
template <bool E5M2>
static uint32_t f8_code(float x) {
  const int mbits = E5M2 ? 2 : 3, bias = E5M2 ? 15 : 7;
  const uint32_t top = E5M2 ? 0x7B : 0x7E;  // the largest finite code
  const uint32_t sign = (__float_as_uint(x) >> 24) & 0x80;
  const double a = std::fabs((double)x);
  auto value = [&](uint32_t c) {
    const int e = (int)(c >> mbits), m = (int)(c & ((1u << mbits) - 1));
    return e ? std::ldexp(1.0 + m / (double)(1 << mbits), e - bias) : std::ldexp(m / (double)(1 << mbits), 1 - bias);
  };
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

static inline float e4m3_value(uint32_t byte) {  // exact (no NaN byte is decoded by the kernel)
  const int e = (int)((byte >> 3) & 0xF), m = (int)(byte & 7);
  const float v = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
  return (byte & 0x80) ? -v : v;
}

static inline float rcp_approx(float d) { return 1.0f / d; }

struct WriteParams;
template <typename K>
cudaError_t host_launch(K kernel, dim3 grid, int threads, const WriteParams& p);

}  // namespace kvx_write

#include KVX_WRITE_SOURCE

namespace kvx_write {

// Each CTA's threads as CPU threads (one CTA at a time; a warp's lanes share its shuffle barrier).
template <typename K>
cudaError_t host_launch(K kernel, dim3 grid, int threads, const WriteParams& p) {
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        std::vector<std::unique_ptr<kvx_host::Warp>> warps;
        for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<kvx_host::Warp>());
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t)
          pool.emplace_back([&, t] {
            kvx_host::tid = make_uint3((unsigned)t, 0, 0);
            kvx_host::bid = make_uint3(x, y, z);
            kvx_host::warp = warps[t / 32].get();
            kernel(p);
          });
        for (auto& th : pool) th.join();
      }
  return cudaSuccess;
}

}  // namespace kvx_write
