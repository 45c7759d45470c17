// dlm::blocked_linear: a float32 linear layer's product for a few rows (a decoding step, a speculative verify, a row
// batch's step) over its weight in a blocked layout, on a CPU.
//
// x (M, K) float32; wb (N / 16, K, 16) float32 contiguous: the weight (N, K) cut into blocks of 16 output columns,
// each block's K x 16 values one contiguous stream -> (M, N) = x W^T.
//
// Why a kernel of our own: at a decoder of ar-mid's width (256-640) MKL's float32 product reads the weights at ~9 GB/s
// for one row (row-major or column-major alike) and costs 1.4-2x that for 4-8 rows on an AVX2 core
// (docs/log/dflash.md). Here each block's weights are one sequential read (the prefetcher's favourite pattern),
// every row's 16 sums stay in registers, four rows share each load of the weights, and where a block takes more than
// one pass of four rows the last pass fetches the next block: ar-mid's linear layers cost 2.1 ms for one row (the
// weights read at ~21 GB/s), 2.6 for 4, 3.8 for 8, 5.9 for 16 (F.linear over column-major weights: 5.3, 6.3, 7.1,
// 8.9). Each output is the same sum in the same order whatever M is (a row's result does not depend on the rows
// beside it: a verify's logits are those of the one-token steps, bit for bit).
//
// On AVX-512 a block row is one register and eight rows share each load; a block read in one pass fetches its own
// weights AHEAD rows ahead (the hardware's prefetch alone fell behind there). On an Intel Xeon (AVX-512, one thread;
// medians of 15 interleaved rounds against the AVX2-only kernel before these two changes, the same outputs bit for
// bit): ar-mid's 112 layer products 0.76x for one row, 0.64x for 4, 0.76x for 8, 0.73x for 16 (docs/log/dflash.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <immintrin.h>

namespace {

using at::vec::Vectorized;
using V = Vectorized<float>;
constexpr int BLOCK = 16;
constexpr int AHEAD = 32;  // one pass over a block: its weights fetched this many rows of 16 ahead
constexpr int NV = BLOCK / V::size();  // vectors per block row (2 on AVX2, 1 on AVX512)
// rows x[0..MT), one block of columns: out[m, 0..16) = sum_k x[m, k] w[k, 0..16)
#if defined(__AVX512F__)
// AVX-512: a block row of 16 columns is one register, so up to TILE = 8 rows share each load of the weights in one
// pass (8 accumulators); the same fused multiply-adds in the same order as the AVX2 path's, lane for lane
constexpr int TILE = 8;
template <int MT>
inline void block(const float* x, int64_t K, const float* w, float* out, int64_t N, const float* next = nullptr) {
  __m512 a[MT];
  for (int m = 0; m < MT; ++m) a[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k, w += BLOCK) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + k * BLOCK), _MM_HINT_T0);
    const __m512 wv = _mm512_loadu_ps(w);
    for (int m = 0; m < MT; ++m) a[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), wv, a[m]);
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * N, a[m]);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int TILE = 4;  // rows per pass over a block (8 accumulators; 6 rows, 12 of them, ran 4 and 8 rows slower)
// AVX2's own instructions (on AVX512 machines too): Vectorized<float>'s arrays of accumulators were not kept in
// registers here, and the kernel ran at half this speed for 4-16 rows
template <int MT>
inline void block(const float* x, int64_t K, const float* w, float* out, int64_t N, const float* next = nullptr) {
  __m256 a0[MT], a1[MT];
  for (int m = 0; m < MT; ++m) { a0[m] = _mm256_setzero_ps(); a1[m] = _mm256_setzero_ps(); }
  for (int64_t k = 0; k < K; ++k, w += BLOCK) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + k * BLOCK), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    for (int m = 0; m < MT; ++m) {
      const __m256 b = _mm256_broadcast_ss(x + m * K + k);
      a0[m] = _mm256_fmadd_ps(b, w0, a0[m]);
      a1[m] = _mm256_fmadd_ps(b, w1, a1[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    _mm256_storeu_ps(out + m * N, a0[m]);
    _mm256_storeu_ps(out + m * N + 8, a1[m]);
  }
}
#else
constexpr int TILE = 4;
template <int MT>
inline void block(const float* x, int64_t K, const float* w, float* out, int64_t N, const float* next = nullptr) {
  V acc[MT][NV];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = V(0.f);
  for (int64_t k = 0; k < K; ++k, w += BLOCK) {
    V wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = V::loadu(w + j * V::size());
    for (int m = 0; m < MT; ++m) {
      V b(x[m * K + k]);
      for (int j = 0; j < NV; ++j) acc[m][j] = at::vec::fmadd(b, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j].store(out + m * N + j * V::size());
}
#endif

at::Tensor blocked_linear(const at::Tensor& x_, const at::Tensor& wb) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "blocked_linear: x must be (M, K) float32");
  TORCH_CHECK(wb.dim() == 3 && wb.size(2) == BLOCK && wb.size(1) == x_.size(1) && wb.is_contiguous() &&
                  wb.scalar_type() == at::kFloat,
              "blocked_linear: the weight must be (N / 16, K, 16) float32, contiguous, K = x's");
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = wb.size(0) * BLOCK;
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = wb.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, wb.size(0), 4, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      const float* w = wp + j * K * BLOCK;
      float* o = op + j * BLOCK;
      // more than one pass over this block: the last one (its weights in cache, its time the FMAs') fetches the next
      // block's, so that the memory's time and the arithmetic's overlap; one pass: it fetches its own weights AHEAD
      // rows ahead, running into the next block's (a prefetch past the last block reads nothing and cannot fault)
      const float* next = (M > TILE && j + 1 < e) ? w + K * BLOCK : M <= TILE ? w + AHEAD * BLOCK : nullptr;
      int64_t m = 0;
      for (; m + TILE <= M; m += TILE)
        block<TILE>(xp + m * K, K, w, o + m * N, N, m + TILE == M ? next : nullptr);
      switch (M - m) {
#if defined(__AVX512F__)
        case 7: block<7>(xp + m * K, K, w, o + m * N, N, next); break;
        case 6: block<6>(xp + m * K, K, w, o + m * N, N, next); break;
        case 5: block<5>(xp + m * K, K, w, o + m * N, N, next); break;
        case 4: block<4>(xp + m * K, K, w, o + m * N, N, next); break;
#endif
        case 3: block<3>(xp + m * K, K, w, o + m * N, N, next); break;
        case 2: block<2>(xp + m * K, K, w, o + m * N, N, next); break;
        case 1: block<1>(xp + m * K, K, w, o + m * N, N, next); break;
        default: break;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dlm, m) { m.def("blocked_linear(Tensor x, Tensor wb) -> Tensor"); }

TORCH_LIBRARY_IMPL(dlm, CPU, m) { m.impl("blocked_linear", &blocked_linear); }
