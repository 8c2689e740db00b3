// Small-batch matmuls against pre-packed float32 weights, for x86-64 CPUs with AVX2 + FMA,
// as XLA FFI calls (see rljax/kernels/cpu_matmul.py).
//
//   y[r, n] = sum_d h[r, d] * W[n, d]      h: [R, D] activations, W: [N, D] weights
//
// Two outputs layouts: "RxN" (y as [R, N], a linear layer) and "NxR" (y as [N, R] plus
// max_R[r] = max_n y[r, n], the sampler's vocab-major output projection).
//
// W arrives packed once per weight array in panels of 6 output rows, wp[ceil(N/6)][D][6]
// (zero rows past N), so the inner loop reads six consecutive floats of W per step. The
// inner loop is a 6 x 16 tile: 12 AVX accumulators, 2 loads of h and 6 broadcasts of W
// per 12 FMAs. h is repacked on entry as [ceil(R/16)][D][16] (zero columns past R) so a
// tile's slice of h is one contiguous block (16 KiB at D = 256) that stays in L1.
//
// Threads: the output rows are cut into chunks that the calling thread and helpers on
// XLA's intra-op pool claim from an atomic counter. The caller works until no chunk is
// left, then waits only for chunks a helper has claimed; a helper that starts late finds
// nothing to claim and touches no buffer, so a call never waits on a queued task and no
// task outlives the buffers it writes.
//
// Each y[r, n] is a float32 sum over d in increasing order with FMAs: as exact as XLA's
// own dot, which sums in another order (the two agree to float32 rounding).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMR = 6;   // output rows n per tile and per packed panel
constexpr int kNC = 16;  // activation rows r per tile (two AVX vectors)
constexpr double kThreadFlops = 4e6;  // below this a call runs on the calling thread only
constexpr int64_t kL2Bytes = 192 * 1024;  // W per block, re-read once per part of h
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum class Layout { kRxN, kNxR };

struct Job {
  Layout layout;
  const float* wp;          // [npanels][D][6]
  std::vector<float> hp;    // [nparts][D][16]
  float* out;               // [R][N] or [N][R]
  int64_t N, D, R, npanels, nparts, chunk, nchunks;
  std::vector<float> chunk_max;  // [nchunks][nparts][max 16, NaN flags 16], NxR only
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

inline __m256i LaneMask(int lanes) {  // the first `lanes` (0..8) lanes on
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), idx);
}

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

void RunChunk(Job& j, int64_t c) {
  const int64_t p0 = c * j.chunk, p1 = std::min(j.npanels, p0 + j.chunk);
  float* colmax = j.layout == Layout::kNxR ? j.chunk_max.data() + c * j.nparts * 2 * kNC : nullptr;
  // Blocks of panels that fit in L2: W is read from memory once, each part of h once
  // per block (from L1).
  const int64_t block = std::max<int64_t>(1, kL2Bytes / (j.D * kMR * sizeof(float)));
  for (int64_t b0 = p0; b0 < p1; b0 += block) {
    const int64_t b1 = std::min(p1, b0 + block);
    for (int64_t part = 0; part < j.nparts; ++part) {
      const int cols = static_cast<int>(std::min<int64_t>(kNC, j.R - part * kNC));
      const float* hpart = j.hp.data() + part * j.D * kNC;
      for (int64_t p = b0; p < b1; ++p) {
        const int rows = static_cast<int>(std::min<int64_t>(kMR, j.N - p * kMR));
        Tile(j, j.wp + p * j.D * kMR, hpart, p * kMR, rows, part * kNC, cols,
             colmax == nullptr ? nullptr : colmax + part * 2 * kNC);
      }
    }
  }
}

void Work(Job& j) {
  for (;;) {
    const int64_t c = j.next.fetch_add(1, std::memory_order_relaxed);
    if (c >= j.nchunks) return;
    RunChunk(j, c);
    j.done.fetch_add(1, std::memory_order_release);
  }
}

// Validates shapes, packs h, runs the chunks on this thread and the pool's.
ffi::Error Run(ffi::ThreadPool& pool, Layout layout, ffi::Buffer<ffi::F32>& wp,
               ffi::Buffer<ffi::F32>& h, float* out, int64_t n_out, std::shared_ptr<Job> j) {
  const auto wd = wp.dimensions(), hd = h.dimensions();
  if (wd.size() != 3 || wd[2] != kMR || hd.size() != 2 || wd[1] != hd[1] ||
      wd[0] != (n_out + kMR - 1) / kMR) {
    return ffi::Error::InvalidArgument(
        "rljax packed matmul: expected w [ceil(N/6), D, 6] and h [R, D] with the output's N");
  }
  j->layout = layout;
  j->wp = wp.typed_data();
  j->out = out;
  j->N = n_out;
  j->R = hd[0];
  j->D = hd[1];
  j->npanels = wd[0];
  j->nparts = (j->R + kNC - 1) / kNC;
  j->hp.assign(j->nparts * j->D * kNC, 0.0f);
  const float* hs = h.typed_data();
  for (int64_t r = 0; r < j->R; ++r)
    for (int64_t d = 0; d < j->D; ++d)
      j->hp[(r / kNC) * j->D * kNC + d * kNC + r % kNC] = hs[r * j->D + d];

  const double flops = 2.0 * j->N * j->R * j->D;
  const int64_t hw = std::max<unsigned>(1, std::thread::hardware_concurrency());
  const int64_t threads = flops < kThreadFlops ? 1 : std::min<int64_t>(pool.num_threads() + 1, hw);
  const int64_t want = std::max<int64_t>(1, std::min<int64_t>(j->npanels, 4 * threads));
  j->chunk = std::max<int64_t>(1, (j->npanels + want - 1) / want);
  j->nchunks = j->R == 0 ? 0 : (j->npanels + j->chunk - 1) / j->chunk;
  if (layout == Layout::kNxR) {
    j->chunk_max.assign(j->nchunks * j->nparts * 2 * kNC, kNegInf);
    for (int64_t c = 0; c < j->nchunks * j->nparts; ++c)
      std::fill_n(j->chunk_max.data() + (2 * c + 1) * kNC, kNC, 0.0f);  // no NaN seen
  }
  for (int64_t i = 0; i + 1 < std::min(threads, j->nchunks); ++i) pool.Schedule([j] { Work(*j); });
  Work(*j);
  for (int spins = 0; j->done.load(std::memory_order_acquire) < j->nchunks; ++spins) {
    if (spins < 4096) _mm_pause(); else std::this_thread::yield();
  }
  return ffi::Error::Success();
}

ffi::Error MatmulRxN(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> wp, ffi::Buffer<ffi::F32> h,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != h.dimensions()[0]) {
    return ffi::Error::InvalidArgument("rljax packed matmul: expected y [R, N]");
  }
  return Run(pool, Layout::kRxN, wp, h, y->typed_data(), yd[1], std::make_shared<Job>());
}

ffi::Error MatmulNxR(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> wp, ffi::Buffer<ffi::F32> h,
                     ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> ymax) {
  const auto yd = y->dimensions(), md = ymax->dimensions();
  const int64_t r = h.dimensions().size() == 2 ? h.dimensions()[0] : -1;
  if (yd.size() != 2 || yd[1] != r || md.size() != 1 || md[0] != r) {
    return ffi::Error::InvalidArgument("rljax packed matmul: expected y [N, R] and max [R]");
  }
  auto j = std::make_shared<Job>();
  if (ffi::Error e = Run(pool, Layout::kNxR, wp, h, y->typed_data(), yd[0], j); e.failure()) {
    return e;
  }
  float* mx = ymax->typed_data();
  for (int64_t i = 0; i < r; ++i) {
    float m = kNegInf;
    bool nan = false;
    for (int64_t c = 0; c < j->nchunks; ++c) {
      const float* cm = j->chunk_max.data() + (c * j->nparts + i / kNC) * 2 * kNC + i % kNC;
      m = std::max(m, cm[0]);
      nan = nan || cm[kNC] != 0.0f;  // flag lanes are 0 or all bits set (a NaN)
    }
    mx[i] = nan ? std::numeric_limits<float>::quiet_NaN() : m;
  }
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
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
