// Dense prompt products (cpu_gemm.h): y (T, N) = x (T, K) @ w.T, fp32 FMAs, for F32 / F16 / BF16 rows.
//
// Blocking (AVX2: 16 ymm registers; the project's Zen 3 has 32 KiB L1d and 512 KiB L2 a core):
//   Each thread takes panels of 16 weight rows and packs each once as fp32 [k][16] (F16 by F16C, BF16
//   by a shift: exact, the values dequantize_torch gives; K in slices of at most 2048 values, so a
//   panel, <= 128 KiB, stays in L2), then runs the 6 x 16 micro-kernel over every row of x: per k one
//   broadcast of x per row and two loads of the panel feed 12 FMAs into 12 accumulators (6 rows of x
//   x 16 weight rows). Each register sum runs over at most 256 values of k, then is added to y (the
//   6 x 16 tile stays in L1), which keeps the rounding error that of a 256-term fp32 sum.
// So the weight is decoded once per panel, never as a whole fp32 matrix, and each decoded value
// serves all T rows of x. On the project's EPYC (one thread, SmolLM2's layer shapes, T = 256) this ran
// 80-86 GFLOP/s of a measured 100 FMA peak, against torch's (MKL) fp32 GEMM ~70-80 on the decoded
// rows (bench/dense_prompt_products.py); a 256-value K slice outermost (y re-read per slice) ran 67,
// and packing x as well gained nothing. The result differs from torch's GEMM by fp32 rounding only
// (tests/test_cpu_gemm.py).
#include "cpu_gemm.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>

namespace lq {
namespace {

constexpr int NR = 16;        // weight rows a panel (two ymm of outputs)
constexpr int MR = 6;         // rows of x a micro-kernel pass (12 accumulators + 2 panel + 1 broadcast)
constexpr int64_t KC = 2048;  // most values of K a slice (a packed panel: 128 KiB, in L2)
constexpr int64_t SUB = 256;  // values a register sum runs over before it is added to y (precision)

// 8 values of a dense row from index k as fp32 (ggml types: 0 F32, 1 F16, 30 BF16).
template <int QT>
inline __m256 load8(const uint8_t* row, int64_t k) {
  if constexpr (QT == 0) return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k));
  if constexpr (QT == 1) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// r[i] (8 rows of 8 values) -> r[j] = column j (values j of rows 0..7).
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; i++) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; i++) {
    for (int h = 0; h < 2; h++) {
      const __m256 a = t[4 * i + h], b = t[4 * i + 2 + h];
      u[4 * i + 2 * h] = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0));
      u[4 * i + 2 * h + 1] = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2));
    }
  }
  // u[0..3]: rows 0-3, columns (0,4) (1,5) (2,6) (3,7) per 128-bit lane; u[4..7]: rows 4-7 alike
  for (int j = 0; j < 4; j++) {
    r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}

// Rows [n0, n0 + nr) (nr <= 16), values [k0, k0 + kc) -> panel[k * 16 + r] fp32; rows past nr are 0.
template <int QT>
void pack(const uint8_t* w, int64_t row_bytes, int64_t n0, int nr, int64_t k0, int64_t kc, float* panel) {
  for (int half = 0; half < 2; half++) {
    const uint8_t* rows[8];
    for (int i = 0; i < 8; i++) {
      const int r = 8 * half + i;
      rows[i] = r < nr ? w + (n0 + r) * row_bytes : nullptr;
    }
    for (int64_t k = 0; k < kc; k += 8) {
      __m256 v[8];
      for (int i = 0; i < 8; i++) v[i] = rows[i] ? load8<QT>(rows[i], k0 + k) : _mm256_setzero_ps();
      transpose8(v);
      for (int j = 0; j < 8; j++) _mm256_store_ps(panel + (k + j) * NR + 8 * half, v[j]);
    }
  }
}

// y[i * ldy + c] (+)= sum_k x[i * ldx + k] * panel[k * 16 + c], rows i < M, columns c < nc.
template <int M>
inline void micro(const float* x, int64_t ldx, const float* panel, int64_t kc, float* y, int64_t ldy, int nc,
                  bool add) {
  for (int64_t s0 = 0; s0 < kc; s0 += SUB) {
    const int64_t s1 = std::min(kc, s0 + SUB);
    __m256 c0[M], c1[M];
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) c0[i] = c1[i] = _mm256_setzero_ps();
    for (int64_t k = s0; k < s1; k++) {
      const __m256 w0 = _mm256_load_ps(panel + k * NR), w1 = _mm256_load_ps(panel + k * NR + 8);
#pragma GCC unroll 8
      for (int i = 0; i < M; i++) {
        const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
        c0[i] = _mm256_fmadd_ps(a, w0, c0[i]);
        c1[i] = _mm256_fmadd_ps(a, w1, c1[i]);
      }
    }
    // the accumulators leave registers only here (a runtime-indexed epilogue on them would keep them
    // in memory through the loop)
    alignas(32) float tile[M][NR];
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) {
      _mm256_store_ps(tile[i], c0[i]);
      _mm256_store_ps(tile[i] + 8, c1[i]);
    }
    const bool sum = add || s0 > 0;
    for (int i = 0; i < M; i++) {
      float* out = y + i * ldy;
      if (nc == NR) {
        __m256 a = _mm256_load_ps(tile[i]), b = _mm256_load_ps(tile[i] + 8);
        if (sum) {
          a = _mm256_add_ps(a, _mm256_loadu_ps(out));
          b = _mm256_add_ps(b, _mm256_loadu_ps(out + 8));
        }
        _mm256_storeu_ps(out, a);
        _mm256_storeu_ps(out + 8, b);
      } else {
        for (int j = 0; j < nc; j++) out[j] = sum ? out[j] + tile[i][j] : tile[i][j];
      }
    }
  }
}

void micro_rows(int m, const float* x, int64_t ldx, const float* panel, int64_t kc, float* y, int64_t ldy, int nc,
                bool add) {
  switch (m) {
    case 1: return micro<1>(x, ldx, panel, kc, y, ldy, nc, add);
    case 2: return micro<2>(x, ldx, panel, kc, y, ldy, nc, add);
    case 3: return micro<3>(x, ldx, panel, kc, y, ldy, nc, add);
    case 4: return micro<4>(x, ldx, panel, kc, y, ldy, nc, add);
    case 5: return micro<5>(x, ldx, panel, kc, y, ldy, nc, add);
    default: return micro<MR>(x, ldx, panel, kc, y, ldy, nc, add);
  }
}

template <int QT>
void gemm(const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t T, float* y, int threads) {
  const int64_t row_bytes = K * (QT == 0 ? 4 : 2);
  const int64_t slices = (K + KC - 1) / KC;
  const int64_t kc_max = ((K + slices - 1) / slices + 7) / 8 * 8;  // <= KC, a multiple of 8
  const int64_t panels = (N + NR - 1) / NR;
  for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
    const int64_t kc = std::min(kc_max, K - k0);
#pragma omp parallel num_threads(threads)
    {
      float* panel = static_cast<float*>(std::aligned_alloc(64, KC * NR * sizeof(float)));
#pragma omp for schedule(static)
      for (int64_t p = 0; p < panels; p++) {
        const int nr = static_cast<int>(std::min<int64_t>(NR, N - p * NR));
        pack<QT>(w, row_bytes, p * NR, nr, k0, kc, panel);
        for (int64_t t = 0; t < T; t += MR) {
          const int m = static_cast<int>(std::min<int64_t>(MR, T - t));
          micro_rows(m, x + t * K + k0, K, panel, kc, y + t * N + p * NR, N, nr, k0 > 0);
        }
      }
      std::free(panel);
    }
  }
}

}  // namespace

void dense_gemm(int qtype, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t T, float* y, int threads) {
  if (qtype == 0) return gemm<0>(w, N, K, x, T, y, threads);
  if (qtype == 1) return gemm<1>(w, N, K, x, T, y, threads);
  gemm<30>(w, N, K, x, T, y, threads);
}

}  // namespace lq
