// CUDA kernels of kvx_core/ops/cuda compiled for the host (host_write.cpp, host_decode.cpp): the execution model
// and the intrinsics they call. Every thread of a block is a CPU thread (blocks one after another, so a `__shared__`
// array can be one static per kernel); `__syncthreads` is a barrier of the block, and each warp-wide operation
// (shuffles, votes, the tensor-core product, MOVMATRIX) an exchange of the warp's 32 lanes through a slot table
// between two barriers of the warp. A thread that returns leaves both barriers (as exited threads leave the
// hardware's). g++ compiles with -ffp-contract=off (each FP32 operation rounded once, as __fmaf_rn / __fmul_rn ...
// are on the GPU) and -fno-strict-aliasing (the kernels read words through casts, which nvcc keeps).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace kvx_host {

constexpr int SLOT_WORDS = 8;  // words a lane puts in one exchange (the product's A fragment and B pair)

struct Warp {
  std::barrier<> meet{32};
  uint32_t slot[32][SLOT_WORDS];
};

struct Block {
  explicit Block(int threads) : sync(threads), warps(threads / 32) {
    for (auto& w : warps) w = std::make_unique<Warp>();
  }
  std::barrier<> sync;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<float> smem;  // the launch's dynamic shared memory
};

inline thread_local uint3 tid, bid;
inline thread_local dim3 bdim, gdim;
inline thread_local Block* block;

inline unsigned lane() { return tid.x % 32; }
inline Warp& warp() { return *block->warps[tid.x / 32]; }

// Lane words in, then `read` of the whole table, then out: one warp-wide operation.
template <typename R>
auto exchange(const uint32_t* words, int n, R read) {
  Warp& w = warp();
  std::memcpy(w.slot[lane()], words, n * sizeof(uint32_t));
  w.meet.arrive_and_wait();
  auto out = read(w.slot);
  w.meet.arrive_and_wait();
  return out;
}

template <typename T>
inline uint32_t bits_of(T v) {
  static_assert(sizeof(T) == 4);
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}
template <typename T>
inline T from_bits(uint32_t b) {
  T v;
  std::memcpy(&v, &b, 4);
  return v;
}

// An FP8 byte's value (E4M3: bias 7, 3 mantissa bits, S.1111.111 NaN; E5M2: bias 15, 2 mantissa bits, IEEE
// infinities and NaNs), exact in FP32.
template <bool E5M2>
inline float fp8_value(uint32_t byte) {
  constexpr int MBITS = E5M2 ? 2 : 3, BIAS = E5M2 ? 15 : 7, EMAX = E5M2 ? 31 : 15;
  const int e = (int)((byte >> MBITS) & EMAX), m = (int)(byte & ((1u << MBITS) - 1));
  float v;
  if (E5M2 && e == EMAX) v = m ? NAN : INFINITY;
  else if (!E5M2 && e == EMAX && m == 7) v = NAN;
  else v = e ? std::ldexp(1.0f + m / float(1 << MBITS), e - BIAS) : std::ldexp(m / float(1 << MBITS), 1 - BIAS);
  return (byte & 0x80) ? -v : v;
}

// The grid, block by block: each thread of a block a CPU thread running `kernel(p)`.
template <typename K, typename P>
cudaError_t launch(K kernel, dim3 grid, int threads, size_t smem_bytes, const P& p) {
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        Block b(threads);
        b.smem.assign((smem_bytes + 3) / 4, NAN);  // poisoned: what the kernel reads it must have written
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t)
          pool.emplace_back([&, t] {
            tid = make_uint3((unsigned)t, 0, 0);
            bid = make_uint3(x, y, z);
            bdim = dim3((unsigned)threads, 1, 1);
            gdim = grid;
            block = &b;
            kernel(p);
            warp().meet.arrive_and_drop();
            b.sync.arrive_and_drop();
          });
        for (auto& th : pool) th.join();
      }
  return cudaSuccess;
}

}  // namespace kvx_host

#define threadIdx kvx_host::tid
#define blockIdx kvx_host::bid
#define blockDim kvx_host::bdim
#define gridDim kvx_host::gdim
#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)
using std::max;
using std::min;
using std::isfinite;

static inline uint32_t __float_as_uint(float x) { return kvx_host::bits_of(x); }
static inline float __uint_as_float(uint32_t b) { return kvx_host::from_bits<float>(b); }
static inline float __int_as_float(int b) { return __uint_as_float((uint32_t)b); }
static inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __saturatef(float x) { return std::isnan(x) ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline unsigned __vmaxu2(unsigned a, unsigned b) {
  return std::max(a & 0xFFFFu, b & 0xFFFFu) | (std::max(a >> 16, b >> 16) << 16);
}
// __byte_perm(x, y, s): byte n of the result is byte (s >> 4n) & 7 of {y, x}
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = ((uint64_t)y << 32) | x;
  unsigned d = 0;
  for (int n = 0; n < 4; ++n) d |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
  return d;
}
template <typename T>
static inline T __ldg(const T* p) { return *p; }
static inline void __syncthreads() { kvx_host::block->sync.arrive_and_wait(); }

template <typename T>
static inline T __shfl_sync(unsigned, T v, int src) {
  const uint32_t b = kvx_host::bits_of(v);
  return kvx_host::from_bits<T>(kvx_host::exchange(&b, 1, [&](auto& s) { return s[src & 31][0]; }));
}
template <typename T>
static inline T __shfl_xor_sync(unsigned, T v, int mask) {
  const uint32_t b = kvx_host::bits_of(v);
  const unsigned from = kvx_host::lane() ^ (unsigned)mask;
  return kvx_host::from_bits<T>(kvx_host::exchange(&b, 1, [&](auto& s) { return s[from & 31][0]; }));
}
static inline int __any_sync(unsigned, int pred) {
  const uint32_t b = pred != 0;
  return kvx_host::exchange(&b, 1, [](auto& s) {
    int any = 0;
    for (int l = 0; l < 32; ++l) any |= (int)s[l][0];
    return any;
  });
}
