// Helpers shared by the CPU kernels (rljax/kernels/cpu_*.cc): AVX2 exp, lane masks, and
// the chunk scheduler that splits a call over the calling thread and XLA's intra-op pool.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace rljax {

// exp(x) for float32 lanes: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7
// polynomial (the minimax coefficients of Cephes' expf), times 2^n; 0 below -87.34
// (where the float32 result would be subnormal), +inf above 88.72, NaN stays NaN.
inline __m256 Exp(__m256 x) {
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 xc = _mm256_min_ps(_mm256_set1_ps(88.7228f), x);  // NaN kept (2nd operand)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, log2e),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, ln2_hi, xc);
  r = _mm256_fnmadd_ps(n, ln2_lo, r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n in two halves so n = 128 (x near 88.72) does not overflow the exponent field.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 s2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  y = _mm256_blendv_ps(y, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                       _mm256_cmp_ps(x, _mm256_set1_ps(88.7228f), _CMP_GT_OQ));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.3365f), _CMP_LT_OQ), y);
}

inline __m256i LaneMask(int lanes) {  // the first `lanes` (0..8) lanes on
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), idx);
}

// Loads / stores of the first `lanes` (0..8) floats: plain when all 8 (AMD CPUs run
// masked moves, stores especially, many times slower), masked otherwise.
inline __m256 LoadN(const float* p, int lanes) {
  return lanes == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, LaneMask(lanes));
}

inline void StoreN(float* p, int lanes, __m256 x) {
  if (lanes == 8) {
    _mm256_storeu_ps(p, x);
  } else {
    _mm256_maskstore_ps(p, LaneMask(lanes), x);
  }
}

// Work split: the calling thread and helpers on XLA's intra-op pool claim chunks
// [0, n) from an atomic counter. The caller works until no chunk is left, then waits only
// for chunks a helper has claimed; a helper that starts late finds nothing to claim and
// never calls fn, so a call never waits on a queued task and no task outlives the
// buffers fn writes.
struct Chunks {
  std::function<void(int64_t)> fn;
  int64_t n = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

inline void Claim(Chunks& s) {
  for (;;) {
    const int64_t c = s.next.fetch_add(1, std::memory_order_relaxed);
    if (c >= s.n) return;
    s.fn(c);
    s.done.fetch_add(1, std::memory_order_release);
  }
}

// Threads worth using for `flops` of work: 1 below ~4 MFLOP (waking a helper costs more).
inline int64_t ThreadsFor(xla::ffi::ThreadPool& pool, double flops) {
  if (flops < 4e6) return 1;
  const int64_t hw = std::max<unsigned>(1, std::thread::hardware_concurrency());
  return std::min<int64_t>(pool.num_threads() + 1, hw);
}

inline void ParallelChunks(xla::ffi::ThreadPool& pool, int64_t n, int64_t threads,
                           std::function<void(int64_t)> fn) {
  auto s = std::make_shared<Chunks>();
  s->fn = std::move(fn);
  s->n = n;
  for (int64_t i = 0; i + 1 < std::min(threads, n); ++i) pool.Schedule([s] { Claim(*s); });
  Claim(*s);
  for (int spins = 0; s->done.load(std::memory_order_acquire) < n; ++spins) {
    if (spins < 4096) _mm_pause(); else std::this_thread::yield();
  }
}

}  // namespace rljax
