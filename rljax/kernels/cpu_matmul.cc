// Small-batch matmuls against pre-packed float32 weights, for x86-64 CPUs with AVX2 + FMA,
// as XLA FFI calls (see rljax/kernels/cpu_matmul.py).
//
//   y[r, n] = sum_d h[r, d] * W[n, d]      h: [R, D] activations, W: [N, D] weights
//
// Two outputs layouts: "RxN" (y as [R, N], a linear layer) and "NxR" (y as [N, R] plus
// max_R[r] = max_n y[r, n], the sampler's vocab-major output projection). NxR can also
// return the softmax's block sums for the sampler's inverse-CDF draw,
//   sums[b, r] = sum_{n in block b} exp((y[r, n] - max_R[r]) / T),  blocks of `block` rows,
// computed while each group of rows is still in cache: exp relative to the group's own
// max, rescaled by exp((group max - max) / T) at the end.
//
// W arrives packed once per weight array in panels of 6 output rows, wp[ceil(N/6)][D][6]
// (zero rows past N), so the inner loop reads six consecutive floats of W per step. The
// inner loop is a 6 x 16 tile: 12 AVX accumulators, 2 loads of h and 6 broadcasts of W
// per 12 FMAs. h is repacked on entry as [ceil(R/16)][D][16] (zero columns past R) so a
// tile's slice of h is one contiguous block (16 KiB at D = 256) that stays in L1.
//
// Threads: the output rows are cut into chunks of whole groups, claimed by the calling
// thread and helpers on XLA's intra-op pool (rljax::ParallelChunks in cpu_common.h).
//
// Each y[r, n] is a float32 sum over d in increasing order with FMAs: as exact as XLA's
// own dot, which sums in another order (the two agree to float32 rounding).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using rljax::Exp;
using rljax::LaneMask;

constexpr int kMR = 6;   // output rows n per tile and per packed panel
constexpr int kNC = 16;  // activation rows r per tile (two AVX vectors)
constexpr int64_t kL2Bytes = 192 * 1024;  // W per group of panels, re-read per part of h
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum class Layout { kRxN, kNxR };

struct Job {
  Layout layout;
  const float* wp;          // [npanels][D][6]
  std::vector<float> hp;    // [nparts][D][16]
  float* out;               // [R][N] or [N][R]
  int64_t N, D, R, npanels, nparts;
  int64_t group;            // panels per group (in L2; a multiple of a sum block's panels)
  int64_t chunk, nchunks;   // groups per work chunk, chunks
  int64_t block = 0;        // NxR: rows per softmax block (0: no sums)
  float inv_t = 1.0f;       // NxR: 1 / temperature for the sums
  float* sums = nullptr;    // NxR: [ceil(N / block)][R], relative to the group max first
  std::vector<float> group_max;  // NxR: [ngroups][nparts][max 16, NaN flags 16]
};

// Stores a finished tile t[i][c] = y[r0 + c, n0 + i] (rows < rows, cols < cols).
inline void StoreTile(const Job& j, const float (&t)[kMR][kNC], int64_t n0, int rows,
                      int64_t r0, int cols, float* colmax) {
  if (j.layout == Layout::kRxN) {
    for (int c = 0; c < cols; ++c) {
      float* o = j.out + (r0 + c) * j.N + n0;
      for (int i = 0; i < rows; ++i) o[i] = t[i][c];
    }
    return;
  }
  // colmax holds the running max of 16 columns, then their NaN flags (all bits set).
  __m256 m0 = _mm256_loadu_ps(colmax), m1 = _mm256_loadu_ps(colmax + 8);
  __m256 nan0 = _mm256_loadu_ps(colmax + kNC), nan1 = _mm256_loadu_ps(colmax + kNC + 8);
  const __m256i k0 = LaneMask(std::min(cols, 8)), k1 = LaneMask(std::max(cols - 8, 0));
  for (int i = 0; i < rows; ++i) {
    const __m256 x0 = _mm256_load_ps(t[i]), x1 = _mm256_load_ps(t[i] + 8);
    float* o = j.out + (n0 + i) * j.R + r0;
    if (cols == kNC) {
      _mm256_storeu_ps(o, x0);
      _mm256_storeu_ps(o + 8, x1);
    } else {
      _mm256_maskstore_ps(o, k0, x0);
      _mm256_maskstore_ps(o + 8, k1, x1);
    }
    m0 = _mm256_max_ps(m0, x0);
    m1 = _mm256_max_ps(m1, x1);
    nan0 = _mm256_or_ps(nan0, _mm256_cmp_ps(x0, x0, _CMP_UNORD_Q));
    nan1 = _mm256_or_ps(nan1, _mm256_cmp_ps(x1, x1, _CMP_UNORD_Q));
  }
  _mm256_storeu_ps(colmax, m0);
  _mm256_storeu_ps(colmax + 8, m1);
  _mm256_storeu_ps(colmax + kNC, nan0);
  _mm256_storeu_ps(colmax + kNC + 8, nan1);
}

// One 6 x 16 tile: y[r0 .. r0+15, n0 .. n0+5] from one panel and one part of h.
inline void Tile(const Job& j, const float* panel, const float* hpart, int64_t n0, int rows,
                 int64_t r0, int cols, float* colmax) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
         a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const float* p = panel;
  const float* b = hpart;
  for (int64_t k = 0; k < j.D; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    __m256 w;
    w = _mm256_broadcast_ss(p + 0); a00 = _mm256_fmadd_ps(w, b0, a00); a01 = _mm256_fmadd_ps(w, b1, a01);
    w = _mm256_broadcast_ss(p + 1); a10 = _mm256_fmadd_ps(w, b0, a10); a11 = _mm256_fmadd_ps(w, b1, a11);
    w = _mm256_broadcast_ss(p + 2); a20 = _mm256_fmadd_ps(w, b0, a20); a21 = _mm256_fmadd_ps(w, b1, a21);
    w = _mm256_broadcast_ss(p + 3); a30 = _mm256_fmadd_ps(w, b0, a30); a31 = _mm256_fmadd_ps(w, b1, a31);
    w = _mm256_broadcast_ss(p + 4); a40 = _mm256_fmadd_ps(w, b0, a40); a41 = _mm256_fmadd_ps(w, b1, a41);
    w = _mm256_broadcast_ss(p + 5); a50 = _mm256_fmadd_ps(w, b0, a50); a51 = _mm256_fmadd_ps(w, b1, a51);
    p += kMR;
    b += kNC;
  }
  alignas(32) float t[kMR][kNC];
  _mm256_store_ps(t[0], a00); _mm256_store_ps(t[0] + 8, a01);
  _mm256_store_ps(t[1], a10); _mm256_store_ps(t[1] + 8, a11);
  _mm256_store_ps(t[2], a20); _mm256_store_ps(t[2] + 8, a21);
  _mm256_store_ps(t[3], a30); _mm256_store_ps(t[3] + 8, a31);
  _mm256_store_ps(t[4], a40); _mm256_store_ps(t[4] + 8, a41);
  _mm256_store_ps(t[5], a50); _mm256_store_ps(t[5] + 8, a51);
  StoreTile(j, t, n0, rows, r0, cols, colmax);
}

// NxR: the max of a group's rows, then each softmax block's sum relative to it.
void GroupSums(Job& j, int64_t g, int64_t n0, int64_t n1) {
  float* gm = j.group_max.data() + g * j.nparts * 2 * kNC;
  alignas(32) float m[kNC];
  for (int64_t part = 0; part < j.nparts; ++part) {
    for (int i = 0; i < kNC; ++i) {  // a group with no finite max sums exp(x - 0) = 0
      const float v = gm[part * 2 * kNC + i];
      m[i] = v == kNegInf ? 0.0f : v;
    }
    const int cols = static_cast<int>(std::min<int64_t>(kNC, j.R - part * kNC));
    const int c0 = std::min(cols, 8), c1 = std::max(cols - 8, 0);
    const __m256 m0 = _mm256_load_ps(m), m1 = _mm256_load_ps(m + 8);
    const __m256 it = _mm256_set1_ps(j.inv_t);
    for (int64_t b0 = n0; b0 < n1; b0 += j.block) {
      __m256 s0 = _mm256_setzero_ps(), s1 = s0;
      for (int64_t n = b0; n < std::min(n1, b0 + j.block); ++n) {
        const float* y = j.out + n * j.R + part * kNC;
        s0 = _mm256_add_ps(s0, Exp(_mm256_mul_ps(_mm256_sub_ps(rljax::LoadN(y, c0), m0), it)));
        if (c1 > 0) s1 = _mm256_add_ps(s1, Exp(_mm256_mul_ps(_mm256_sub_ps(rljax::LoadN(y + 8, c1), m1), it)));
      }
      float* out = j.sums + (b0 / j.block) * j.R + part * kNC;
      rljax::StoreN(out, c0, s0);
      if (c1 > 0) rljax::StoreN(out + 8, c1, s1);
    }
  }
}

void RunChunk(Job& j, int64_t c) {
  const int64_t ngroups = (j.npanels + j.group - 1) / j.group;
  for (int64_t g = c * j.chunk; g < std::min(ngroups, (c + 1) * j.chunk); ++g) {
    // W is read from memory once per group, each part of h once per group (from L1).
    const int64_t p0 = g * j.group, p1 = std::min(j.npanels, p0 + j.group);
    float* gm = j.layout == Layout::kNxR ? j.group_max.data() + g * j.nparts * 2 * kNC : nullptr;
    for (int64_t part = 0; part < j.nparts; ++part) {
      const int cols = static_cast<int>(std::min<int64_t>(kNC, j.R - part * kNC));
      const float* hpart = j.hp.data() + part * j.D * kNC;
      for (int64_t p = p0; p < p1; ++p) {
        const int rows = static_cast<int>(std::min<int64_t>(kMR, j.N - p * kMR));
        Tile(j, j.wp + p * j.D * kMR, hpart, p * kMR, rows, part * kNC, cols,
             gm == nullptr ? nullptr : gm + part * 2 * kNC);
      }
    }
    if (j.block > 0) GroupSums(j, g, p0 * kMR, std::min(j.N, p1 * kMR));
  }
}

// Validates shapes, packs h, runs the chunks on this thread and the pool's.
ffi::Error Run(ffi::ThreadPool& pool, Layout layout, ffi::Buffer<ffi::F32>& wp,
               ffi::Buffer<ffi::F32>& h, float* out, int64_t n_out, Job& j) {
  const auto wd = wp.dimensions(), hd = h.dimensions();
  if (wd.size() != 3 || wd[2] != kMR || hd.size() != 2 || wd[1] != hd[1] ||
      wd[0] != (n_out + kMR - 1) / kMR) {
    return ffi::Error::InvalidArgument(
        "rljax packed matmul: expected w [ceil(N/6), D, 6] and h [R, D] with the output's N");
  }
  j.layout = layout;
  j.wp = wp.typed_data();
  j.out = out;
  j.N = n_out;
  j.R = hd[0];
  j.D = hd[1];
  j.npanels = wd[0];
  j.nparts = (j.R + kNC - 1) / kNC;
  j.hp.assign(j.nparts * j.D * kNC, 0.0f);
  const float* hs = h.typed_data();
  for (int64_t r = 0; r < j.R; ++r)
    for (int64_t d = 0; d < j.D; ++d) j.hp[(r / kNC) * j.D * kNC + d * kNC + r % kNC] = hs[r * j.D + d];

  // Groups: about kL2Bytes of W, and whole softmax blocks (block / gcd(block, 6) panels).
  const int64_t align = j.block > 0 ? j.block / std::gcd<int64_t>(j.block, kMR) : 1;
  const int64_t fit = std::max<int64_t>(1, kL2Bytes / (j.D * kMR * sizeof(float)));
  j.group = align * std::max<int64_t>(1, fit / align);
  const int64_t ngroups = (j.npanels + j.group - 1) / j.group;
  const int64_t threads = rljax::ThreadsFor(pool, 2.0 * j.N * j.R * j.D);
  const int64_t want = std::max<int64_t>(1, std::min<int64_t>(ngroups, 4 * threads));
  j.chunk = std::max<int64_t>(1, (ngroups + want - 1) / want);
  j.nchunks = j.R == 0 ? 0 : (ngroups + j.chunk - 1) / j.chunk;
  if (layout == Layout::kNxR) {
    j.group_max.assign(ngroups * j.nparts * 2 * kNC, kNegInf);
    for (int64_t c = 0; c < ngroups * j.nparts; ++c)
      std::fill_n(j.group_max.data() + (2 * c + 1) * kNC, kNC, 0.0f);  // no NaN seen
  }
  rljax::ParallelChunks(pool, j.nchunks, threads, [&j](int64_t c) { RunChunk(j, c); });
  return ffi::Error::Success();
}

ffi::Error MatmulRxN(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> wp, ffi::Buffer<ffi::F32> h,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != h.dimensions()[0]) {
    return ffi::Error::InvalidArgument("rljax packed matmul: expected y [R, N]");
  }
  Job j;
  return Run(pool, Layout::kRxN, wp, h, y->typed_data(), yd[1], j);
}

// max_R from the groups' maxima (NaN if any group saw one), then the block sums rescaled
// from their group's max to max_R.
void Finish(Job& j, float* mx) {
  const int64_t ngroups = (j.npanels + j.group - 1) / j.group;
  for (int64_t i = 0; i < j.R; ++i) {
    float m = kNegInf;
    bool nan = false;
    for (int64_t g = 0; g < ngroups; ++g) {
      const float* gm = j.group_max.data() + (g * j.nparts + i / kNC) * 2 * kNC + i % kNC;
      m = std::max(m, gm[0]);
      nan = nan || gm[kNC] != 0.0f;  // flag lanes are 0 or all bits set (a NaN)
    }
    mx[i] = nan ? std::numeric_limits<float>::quiet_NaN() : m;
  }
  if (j.block == 0) return;
  const int64_t rows_per_group = j.group * kMR;
  for (int64_t b = 0; b * j.block < j.N; ++b) {
    const int64_t g = b * j.block / rows_per_group;
    for (int64_t i = 0; i < j.R; ++i) {
      const float gm = j.group_max[(g * j.nparts + i / kNC) * 2 * kNC + i % kNC];
      const float shift = (gm == kNegInf ? 0.0f : gm) - mx[i];
      j.sums[b * j.R + i] *= std::exp(shift * j.inv_t);
    }
  }
}

ffi::Error MatmulNxR(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> wp, ffi::Buffer<ffi::F32> h,
                     int64_t block, float inv_temperature, ffi::ResultBuffer<ffi::F32> y,
                     ffi::ResultBuffer<ffi::F32> ymax, ffi::ResultBuffer<ffi::F32> sums) {
  const auto yd = y->dimensions(), md = ymax->dimensions(), sd = sums->dimensions();
  const int64_t r = h.dimensions().size() == 2 ? h.dimensions()[0] : -1;
  if (yd.size() != 2 || yd[1] != r || md.size() != 1 || md[0] != r) {
    return ffi::Error::InvalidArgument("rljax packed matmul: expected y [N, R] and max [R]");
  }
  const int64_t nb = block > 0 ? (yd[0] + block - 1) / block : 0;
  if (block < 0 || sd.size() != 2 || sd[0] != nb || sd[1] != r || !(inv_temperature > 0.0f)) {
    return ffi::Error::InvalidArgument(
        "rljax packed matmul: expected block >= 0, sums [ceil(N / block), R] ([0, R] "
        "without blocks) and 1 / temperature > 0");
  }
  Job j;
  j.block = block;
  j.inv_t = inv_temperature;
  j.sums = sums->typed_data();
  if (ffi::Error e = Run(pool, Layout::kNxR, wp, h, y->typed_data(), yd[0], j); e.failure()) {
    return e;
  }
  Finish(j, ymax->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RljaxPackedMatmulRxN, MatmulRxN,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RljaxPackedMatmulNxR, MatmulNxR,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block")
                                  .Attr<float>("inv_temperature")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
