// Products and decoding of weights held as GGUF blocks (formats: cpu_quant.h), dense F32/F16/BF16
// rows, or 8-row tiles (cpu_tiles.cpp), on raw pointers and OpenMP threads.
//
//   quantize_x:     x rounded to int16 per 32 values (cpu_quant.h QX); the integer sums of the
//                   products are exact, so their only error is this rounding (documented in
//                   docs/PERFORMANCE.md against the fp32 reference forward).
//   mat_rows / mat_matmul:  y (T, N) = x (T, K) @ w.T; dense weights take x in fp32 as given.
//   mat_dequantize: w -> fp32, bit-identical to quantize.decode.dequantize_torch (prefill multiplies
//                   those values with torch's fp32 GEMM, so long prompts see no activation rounding).
#include "cpu_quant.h"

#include "cpu_tiles.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

namespace lq {

// One group of 32 values -> q (int16), returns d; the sums of each half into s.
inline float quantize_group(const float* xs, int16_t* q, int32_t* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; j++) {
    v[j] = _mm256_loadu_ps(xs + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 32767.f, inv = d != 0.f ? 1.f / d : 0.f;
  __m256i r[4];
  for (int j = 0; j < 4; j++) r[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));  // to nearest even
  for (int h = 0; h < 2; h++) {
    const __m256i sum = _mm256_add_epi32(r[2 * h], r[2 * h + 1]);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s[h] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1))));
    // packs works within 128-bit lanes: the permute restores value order
    const __m256i packed = _mm256_packs_epi32(r[2 * h], r[2 * h + 1]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * h), _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
  }
  return d;
}

void quantize_x(const float* x, int64_t T, int64_t K, int16_t* q, float* d, float* half_sums, int32_t* sums,
                int threads) {
  const int64_t G = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads) if (T >= 16)
  for (int64_t t = 0; t < T; t++) {
    for (int64_t g = 0; g < G; g++) {
      const int64_t i = t * G + g, at = t * K + g * 32;
      int32_t* s = sums + 2 * i;
      d[i] = quantize_group(x + at, q + at, s);
      half_sums[2 * i] = d[i] * static_cast<float>(s[0]);
      half_sums[2 * i + 1] = d[i] * static_cast<float>(s[1]);
    }
  }
}

void split_x(const int16_t* q, int64_t n, uint8_t* lo, int8_t* hi) {
  for (int64_t i = 0; i < n; i++) {
    lo[i] = static_cast<uint8_t>(q[i] & 0xFF);
    hi[i] = static_cast<int8_t>(q[i] >> 8);  // arithmetic: q = 256 hi + lo
  }
}

// NT rows of x (from t0) against one weight row of blocks; y[t * ldy] gets each product.
template <int QT, int NT>
inline void dot_rows(const uint8_t* row, const QX& x, int64_t t0, float* y, int64_t ldy) {
  using F = Fmt<QT>;
  const int64_t G = x.K / 32;
  __m256 acc[NT];
  float macc[NT];
  for (int t = 0; t < NT; t++) {
    acc[t] = _mm256_setzero_ps();
    macc[t] = 0.f;
  }
  Group g;
  g.m[0] = g.m[1] = 0.f;
  for (int64_t i = 0; i < G; i++) {
    row_group<QT>(row, static_cast<int>(i), g);
    const __m256i u0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(g.u));  // values 0..15 as int16
    const __m256i u1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(g.u, 1));
    for (int t = 0; t < NT; t++) {
      const int64_t ti = (t0 + t) * G + i;
      const int16_t* xq = x.q + (t0 + t) * x.K + 32 * i;
      const int32_t* s = x.sums + 2 * ti;
      // lane 0 of each half starts at -o * sum(x): the offset term, exact in integers
      __m256i a = _mm256_zextsi128_si256(_mm_cvtsi32_si128(-F::o * s[0]));
      __m256i b = _mm256_zextsi128_si256(_mm_cvtsi32_si128(-F::o * s[1]));
      a = madd16(a, u0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
      b = madd16(b, u1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16)));
      const float dx = x.d[ti];
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(g.s[0] * dx), acc[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), _mm256_set1_ps(g.s[1] * dx), acc[t]);
      if constexpr (F::has_min) macc[t] += g.m[0] * x.half_sums[2 * ti] + g.m[1] * x.half_sums[2 * ti + 1];
    }
  }
  for (int t = 0; t < NT; t++) y[t * ldy] = hsum(acc[t]) + macc[t];
}

template <int QT>
void rows_of(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const QX& x, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w + n * row_bytes;
    int64_t t = 0;
    for (; t + 4 <= x.T; t += 4) dot_rows<QT, 4>(row, x, t, y + t * ldy + n, ldy);
    for (; t < x.T; t++) dot_rows<QT, 1>(row, x, t, y + t * ldy + n, ldy);
  }
}

void raw_rows(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const QX& x, float* y,
              int64_t ldy) {
  switch (qtype) {
    case Q8_0: return rows_of<Q8_0>(w, row_bytes, n0, n1, x, y, ldy);
    case Q4_0: return rows_of<Q4_0>(w, row_bytes, n0, n1, x, y, ldy);
    case Q4_1: return rows_of<Q4_1>(w, row_bytes, n0, n1, x, y, ldy);
    case Q5_0: return rows_of<Q5_0>(w, row_bytes, n0, n1, x, y, ldy);
    case Q5_1: return rows_of<Q5_1>(w, row_bytes, n0, n1, x, y, ldy);
    case Q2_K: return rows_of<Q2_K>(w, row_bytes, n0, n1, x, y, ldy);
    case Q3_K: return rows_of<Q3_K>(w, row_bytes, n0, n1, x, y, ldy);
    case Q4_K: return rows_of<Q4_K>(w, row_bytes, n0, n1, x, y, ldy);
    case Q5_K: return rows_of<Q5_K>(w, row_bytes, n0, n1, x, y, ldy);
    case Q6_K: return rows_of<Q6_K>(w, row_bytes, n0, n1, x, y, ldy);
    case MXFP4: return rows_of<MXFP4>(w, row_bytes, n0, n1, x, y, ldy);
    case IQ4_NL: return rows_of<IQ4_NL>(w, row_bytes, n0, n1, x, y, ldy);
    case IQ4_XS: return rows_of<IQ4_XS>(w, row_bytes, n0, n1, x, y, ldy);
    default: return;  // cpu.py only passes the types above
  }
}

bool is_dense(int qtype) { return qtype == F32 || qtype == F16 || qtype == BF16; }

// 8 weights of a dense row as fp32 (F16 by F16C, BF16 by a shift into the top half: exact).
template <int QT>
inline __m256 dense8(const uint8_t* row, int64_t k) {
  if constexpr (QT == F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k));
  if constexpr (QT == F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 load8(int qtype, const uint8_t* row, int64_t k) {
  if (qtype == F32) return dense8<F32>(row, k);
  return qtype == F16 ? dense8<F16>(row, k) : dense8<BF16>(row, k);
}

// NR weight rows (from row n) times NT rows of x (from t): NR * NT fp32 accumulators in registers, so
// each weight load serves NT rows of x and each x load NR weight rows (short prompts; decode takes
// dense_rows_x1).
template <int QT, int NR, int NT>
inline void dense_block(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n, const float* x, int64_t t,
                        float* y, int64_t ldy) {
  __m256 acc[NR][NT];
  for (int r = 0; r < NR; r++)
    for (int j = 0; j < NT; j++) acc[r][j] = _mm256_setzero_ps();
  const uint8_t* rows = w + n * row_bytes;
  if constexpr (QT == BF16) {
    // 16 values a step, no widening shuffle: a 32-bit lane of the row holds values 2i (low half) and
    // 2i + 1 (high half), so a shift and a mask give the even and the odd values as fp32; x is split
    // alike (per 128-bit lane x0 x2 x4 x6 | x8 x10 x12 x14, then the odd ones), once for all NR rows.
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t k = 0; k < K; k += 16) {
      __m256 xe[NT], xo[NT];
      for (int j = 0; j < NT; j++) {
        const __m256 a = _mm256_loadu_ps(x + (t + j) * K + k), b = _mm256_loadu_ps(x + (t + j) * K + k + 8);
        const __m256 lo = _mm256_permute2f128_ps(a, b, 0x20), hi = _mm256_permute2f128_ps(a, b, 0x31);
        xe[j] = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
        xo[j] = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
      }
      for (int r = 0; r < NR; r++) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + r * row_bytes + 2 * k));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        for (int j = 0; j < NT; j++) acc[r][j] = _mm256_fmadd_ps(odd, xo[j], _mm256_fmadd_ps(even, xe[j], acc[r][j]));
      }
    }
  } else {
    for (int64_t k = 0; k < K; k += 8) {
      __m256 xs[NT];
      for (int j = 0; j < NT; j++) xs[j] = _mm256_loadu_ps(x + (t + j) * K + k);
      for (int r = 0; r < NR; r++) {
        const __m256 wv = dense8<QT>(rows + r * row_bytes, k);
        for (int j = 0; j < NT; j++) acc[r][j] = _mm256_fmadd_ps(wv, xs[j], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < NR; r++)
    for (int j = 0; j < NT; j++) y[(t + j) * ldy + n + r] = hsum(acc[r][j]);
}

// Bytes ahead of the row being read that decode prefetches (a line per 64 bytes read): tuned by
// bench/dense_products.py on the project's EPYC (512 to 1024 ran best; 2048 and more lost ~10%).
constexpr int64_t DENSE_PREFETCH = 1024;

// Decode (one x): rows [n0, n1) one at a time, 32 values a step into 4 accumulators. The rows lie end
// to end, so this reads the weights as one sequential stream, which the prefetch runs ahead of; 8 rows
// a pass (8 interleaved streams) streamed 10-30% slower for F16 and BF16 (bench/dense_products.py).
template <int QT>
void dense_rows_x1(const uint8_t* w, int64_t K, int64_t n0, int64_t n1, const float* x, float* y) {
  constexpr int64_t esz = QT == F32 ? 4 : 2;
  const int64_t row_bytes = K * esz;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w + n * row_bytes;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < K; k += 32) {  // K % 32 == 0 (kernels/cpu.py fits_cpp)
      for (int64_t b = 0; b < 32 * esz; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row + k * esz + b + DENSE_PREFETCH), _MM_HINT_T0);
      a0 = _mm256_fmadd_ps(dense8<QT>(row, k), _mm256_loadu_ps(x + k), a0);
      a1 = _mm256_fmadd_ps(dense8<QT>(row, k + 8), _mm256_loadu_ps(x + k + 8), a1);
      a2 = _mm256_fmadd_ps(dense8<QT>(row, k + 16), _mm256_loadu_ps(x + k + 16), a2);
      a3 = _mm256_fmadd_ps(dense8<QT>(row, k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    y[n] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  }
}

template <int QT>
void dense_rows_of(const uint8_t* w, int64_t K, int64_t n0, int64_t n1, const float* x, int64_t T, float* y,
                   int64_t ldy) {
  const int64_t row_bytes = K * (QT == F32 ? 4 : 2);
  if (T == 1) return dense_rows_x1<QT>(w, K, n0, n1, x, y);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    int64_t t = 0;
    for (; t + 2 <= T; t += 2) dense_block<QT, 4, 2>(w, row_bytes, K, n, x, t, y, ldy);
    if (t < T) dense_block<QT, 4, 1>(w, row_bytes, K, n, x, t, y, ldy);
  }
  for (; n < n1; n++)
    for (int64_t t = 0; t < T; t++) dense_block<QT, 1, 1>(w, row_bytes, K, n, x, t, y, ldy);
}

void dense_matmul_rows(int qtype, const uint8_t* w, int64_t K, int64_t n0, int64_t n1, const float* x, int64_t T,
                       float* y, int64_t ldy) {
  if (qtype == F32) return dense_rows_of<F32>(w, K, n0, n1, x, T, y, ldy);
  if (qtype == F16) return dense_rows_of<F16>(w, K, n0, n1, x, T, y, ldy);
  dense_rows_of<BF16>(w, K, n0, n1, x, T, y, ldy);
}

template <int QT>
void dequantize_row(const uint8_t* row, int64_t K, float* out) {
  using F = Fmt<QT>;
  Group g;
  g.m[0] = g.m[1] = 0.f;
  alignas(32) uint8_t u[32];
  for (int64_t i = 0; i < K / 32; i++) {
    row_group<QT>(row, static_cast<int>(i), g);
    _mm256_store_si256(reinterpret_cast<__m256i*>(u), g.u);
    for (int e = 0; e < 32; e++) {
      const float v = g.s[e / 16] * static_cast<float>(static_cast<int>(u[e]) - F::o);
      // Formats without a min add nothing: adding 0 would turn -0.0 into +0.0.
      out[32 * i + e] = F::has_min ? v + g.m[e / 16] : v;
    }
  }
}

void raw_dequantize(int qtype, const uint8_t* row, int64_t K, float* o) {
  switch (qtype) {
    case Q8_0: return dequantize_row<Q8_0>(row, K, o);
    case Q4_0: return dequantize_row<Q4_0>(row, K, o);
    case Q4_1: return dequantize_row<Q4_1>(row, K, o);
    case Q5_0: return dequantize_row<Q5_0>(row, K, o);
    case Q5_1: return dequantize_row<Q5_1>(row, K, o);
    case Q2_K: return dequantize_row<Q2_K>(row, K, o);
    case Q3_K: return dequantize_row<Q3_K>(row, K, o);
    case Q4_K: return dequantize_row<Q4_K>(row, K, o);
    case Q5_K: return dequantize_row<Q5_K>(row, K, o);
    case Q6_K: return dequantize_row<Q6_K>(row, K, o);
    case MXFP4: return dequantize_row<MXFP4>(row, K, o);
    case IQ4_NL: return dequantize_row<IQ4_NL>(row, K, o);
    case IQ4_XS: return dequantize_row<IQ4_XS>(row, K, o);
    default:
      for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(o + k, load8(qtype, row, k));
  }
}

void mat_rows(const Mat& m, int64_t n0, int64_t n1, const QX& qx, const float* xf, float* y, int64_t ldy) {
  if (m.tiled) return tile_matmul(m.qtype, m.w, m.N, m.K, n0 / 8, (n1 + 7) / 8, qx, y, ldy);
  if (is_dense(m.qtype)) return dense_matmul_rows(m.qtype, m.w, m.K, n0, n1, xf, qx.T, y, ldy);
  raw_rows(m.qtype, m.w, m.row_bytes, n0, n1, qx, y, ldy);
}

void mat_dequantize(const Mat& m, int64_t n0, int64_t n1, float* out) {
  if (m.tiled) return tile_dequantize(m.qtype, m.w, m.K, n0, n1, out);
  for (int64_t n = n0; n < n1; n++) raw_dequantize(m.qtype, m.w + n * m.row_bytes, m.K, out + (n - n0) * m.K);
}

constexpr int64_t CHUNK = 16;  // rows a task: a multiple of the 8-row tiles

// Rows of x a pass: each pass streams the weights once, while its x (at most 64 x K int16) stays in L2.
constexpr int64_t X_BLOCK = 64;

void mat_matmul(const Mat& m, const QX& qx, const float* xf, float* y, int threads) {
  const int64_t G = qx.K / 32;
  for (int64_t t0 = 0; t0 < qx.T; t0 += X_BLOCK) {
    const int64_t T = std::min(X_BLOCK, qx.T - t0);
    const QX part{qx.q + t0 * qx.K, qx.d + t0 * G, qx.half_sums + 2 * t0 * G, qx.sums + 2 * t0 * G, T, qx.K};
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < (m.N + CHUNK - 1) / CHUNK; c++) {
      mat_rows(m, c * CHUNK, std::min(m.N, (c + 1) * CHUNK), part, xf + t0 * qx.K, y + t0 * m.N, m.N);
    }
  }
}

void mat_dequantize_all(const Mat& m, float* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t c = 0; c < (m.N + CHUNK - 1) / CHUNK; c++) {
    mat_dequantize(m, c * CHUNK, std::min(m.N, (c + 1) * CHUNK), out + c * CHUNK * m.K);
  }
}

}  // namespace lq
