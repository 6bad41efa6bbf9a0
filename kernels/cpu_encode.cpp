// Encoders of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 without an imatrix (cpu_encode.h): one block of 32 values at a
// time, each operation the one of quantize/simple.py's torch reference in the same fp32 order (which is
// ggml-quants.c quantize_row_*_ref's and gguf-py's), so the bytes are equal.
//
// No fused multiply-add may replace a product and a sum here (x * id + 8.5 is two roundings in the
// reference): GCC contracts them by default, hence the pragma.
#pragma GCC optimize("fp-contract=off")

#include "cpu_encode.h"

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstring>

namespace lq {
namespace {

constexpr int QK = 32;

void put_f16(uint8_t* p, float v) {  // round to nearest even, as torch's .to(float16) and numpy's astype
  const uint16_t h = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
  std::memcpy(p, &h, 2);
}

float inverse(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

// The value of largest magnitude, sign kept; the first one on ties (torch / numpy argmax).
float signed_max(const float* x) {
  int best = 0;
  float amax = std::fabs(x[0]);
  for (int i = 1; i < QK; i++) {
    if (std::fabs(x[i]) > amax) amax = std::fabs(x[i]), best = i;
  }
  return x[best];
}

// The first smallest and the first largest value (ggml's loop: a later equal value, e.g. -0 after +0,
// does not replace them).
void min_max(const float* x, float* lo, float* hi) {
  float a = x[0], b = x[0];
  for (int i = 1; i < QK; i++) {
    if (x[i] < a) a = x[i];
    if (x[i] > b) b = x[i];
  }
  *lo = a, *hi = b;
}

// Quants q[0..31] (each < 32) -> qs: low nibbles of q[j] | low nibbles of q[j + 16] << 4.
void put_nibbles(uint8_t* qs, const int* q) {
  for (int j = 0; j < QK / 2; j++) qs[j] = static_cast<uint8_t>((q[j] & 0xF) | ((q[j + QK / 2] & 0xF) << 4));
}

// Bit 4 of q[e] -> bit e of a little-endian uint32.
void put_fifth_bits(uint8_t* qh, const int* q) {
  uint32_t h = 0;
  for (int e = 0; e < QK; e++) h |= static_cast<uint32_t>((q[e] >> 4) & 1) << e;
  std::memcpy(qh, &h, 4);
}

// roundf (halves away from zero), as simple.round_away.
float round_away(float v) { return std::round(v); }

void block_q8_0(const float* x, uint8_t* out) {
  float amax = 0.0f;
  for (int i = 0; i < QK; i++) amax = std::fmax(amax, std::fabs(x[i]));
  const float d = amax / 127.0f, id = inverse(d);
  put_f16(out, d);
  for (int i = 0; i < QK; i++) {
    const int8_t q = static_cast<int8_t>(round_away(x[i] * id));
    std::memcpy(out + 2 + i, &q, 1);
  }
}

// Q4_0 (nmax 8) and Q5_0 (nmax 16): d = max / -nmax, q = trunc(x / d + nmax + 0.5) in [0, 2 nmax - 1].
void symmetric(const float* x, int nmax, float* d_out, int* q) {
  const float d = signed_max(x) / static_cast<float>(-nmax), id = inverse(d);
  const float offset = static_cast<float>(nmax) + 0.5f;
  for (int i = 0; i < QK; i++) {
    const float t = std::trunc(x[i] * id + offset);
    q[i] = static_cast<int>(std::fmin(std::fmax(t, 0.0f), static_cast<float>(2 * nmax - 1)));
  }
  *d_out = d;
}

// Q4_1 (nmax 15) and Q5_1 (nmax 31): d = (max - min) / nmax, q = trunc((x - min) / d + 0.5) in [0, nmax].
void affine(const float* x, int nmax, float* d_out, float* m_out, int* q) {
  float lo, hi;
  min_max(x, &lo, &hi);
  const float d = (hi - lo) / static_cast<float>(nmax), id = inverse(d);
  for (int i = 0; i < QK; i++) {
    const float t = std::trunc((x[i] - lo) * id + 0.5f);
    q[i] = static_cast<int>(std::fmin(std::fmax(t, 0.0f), static_cast<float>(nmax)));
  }
  *d_out = d, *m_out = lo;
}

void encode_block(int qtype, const float* x, uint8_t* out) {
  int q[QK];
  float d, m;
  switch (qtype) {
    case 8:  // Q8_0: d, q[32] int8
      block_q8_0(x, out);
      break;
    case 2:  // Q4_0: d, qs[16]
      symmetric(x, 8, &d, q);
      put_f16(out, d), put_nibbles(out + 2, q);
      break;
    case 3:  // Q4_1: d, m, qs[16]
      affine(x, 15, &d, &m, q);
      put_f16(out, d), put_f16(out + 2, m), put_nibbles(out + 4, q);
      break;
    case 6:  // Q5_0: d, qh[4], qs[16]
      symmetric(x, 16, &d, q);
      put_f16(out, d), put_fifth_bits(out + 2, q), put_nibbles(out + 6, q);
      break;
    case 7:  // Q5_1: d, m, qh[4], qs[16]
      affine(x, 31, &d, &m, q);
      put_f16(out, d), put_f16(out + 2, m), put_fifth_bits(out + 4, q), put_nibbles(out + 8, q);
      break;
  }
}

}  // namespace

int simple_block_bytes(int qtype) {
  switch (qtype) {
    case 8: return 34;
    case 2: return 18;
    case 3: return 20;
    case 6: return 22;
    case 7: return 24;
    default: return 0;
  }
}

void encode_simple(int qtype, const float* x, int64_t rows, int64_t cols, uint8_t* out, int threads) {
  const int64_t nb = cols / QK, bytes = simple_block_bytes(qtype);
  if (!bytes) return;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t b = 0; b < nb; b++) encode_block(qtype, x + r * cols + b * QK, out + (r * nb + b) * bytes);
  }
}

}  // namespace lq
