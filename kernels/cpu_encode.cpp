// Encoders of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 without an imatrix (cpu_encode.h): one block of 32 values at a
// time, each operation the one of quantize/simple.py's torch reference in the same fp32 order (which is
// ggml-quants.c quantize_row_*_ref's and gguf-py's), so the bytes are equal.
//
// No fused multiply-add may replace a product and a sum here (x * id + 8.5 is two roundings in the
// reference): GCC contracts them by default, hence the pragma.
#pragma GCC optimize("fp-contract=off")

#include "cpu_encode.h"
#include "cpu_values.h"

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

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

// ---- with an imatrix: quantize/simple_search.py's searches, float for float (C order, as ggml-quants.c)

constexpr float GROUP_MAX_EPS = 1e-15f;

// Half to even, as torch.round and ggml's nearest_int (one SSE4.1 instruction, exact for any float).
float nearest(float v) {
  return _mm_cvtss_f32(_mm_round_ss(_mm_setzero_ps(), _mm_set_ss(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

float clampf(float v, float lo, float hi) { return std::fmin(std::fmax(v, lo), hi); }

// make_qx_quants (rmse_type 1, weights w): the scale of x ~ scale * q, q in [-nmax, nmax - 1].
float qx_scale(const float* x, const float* w, int nmax) {
  const float max = signed_max(x);
  if (!(std::fabs(max) >= GROUP_MAX_EPS)) return 0.0f;
  static constexpr int steps[19] = {0, -9, -8, -7, -6, -5, -4, -3, -2, -1, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  const float lo = static_cast<float>(-nmax), hi = static_cast<float>(nmax - 1);
  float scale = 0.0f, best = 0.0f;
  for (int k : steps) {
    const float c = k ? static_cast<float>(nmax) + 0.1f * static_cast<float>(k) : static_cast<float>(nmax);
    const float iscale = -c / max;
    float sumlx = 0.0f, suml2 = 0.0f;
    for (int i = 0; i < QK; i++) {
      const float l = clampf(nearest(iscale * x[i]), lo, hi);
      sumlx += w[i] * x[i] * l;
      suml2 += w[i] * l * l;
    }
    if (k == 0) {
      scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
      best = scale * sumlx;
    } else if (suml2 > 0.0f && sumlx * sumlx > best * suml2) {
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

float fit_error(const float* x, const float* w, float scale, float low, const float* q) {
  float err = 0.0f;
  for (int i = 0; i < QK; i++) {
    const float diff = scale * q[i] + low - x[i];
    err += w[i] * (diff * diff);
  }
  return err;
}

// make_qkx2_quants' fit x ~ scale * q + low, q in [0, nmax], low <= 0 (rmin -0.9, rdelta 0.05, 36 steps).
void qkx_fit(const float* x, const float* w, int nmax, float* scale_out, float* low_out) {
  float xmin, xmax;
  min_max(x, &xmin, &xmax);
  float low = xmin > 0.0f ? 0.0f : xmin;
  if (!(xmax > low)) {  // flat
    *scale_out = 0.0f, *low_out = low;
    return;
  }
  const float fmax = static_cast<float>(nmax);
  float sum_w = 0.0f, sum_x = 0.0f, q[QK];
  for (int i = 0; i < QK; i++) sum_w += w[i], sum_x += w[i] * x[i];
  float iscale = fmax / (xmax - low), scale = 1.0f / iscale;
  for (int i = 0; i < QK; i++) q[i] = clampf(nearest(iscale * (x[i] - low)), 0.0f, fmax);
  float best = fit_error(x, w, scale, low, q);
  for (int k = 0; k <= 36; k++) {  // (max - min) and x - min with the best min so far, as ggml
    const float c = -0.9f + 0.05f * static_cast<float>(k) + fmax;
    iscale = c / (xmax - low);
    float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
    for (int i = 0; i < QK; i++) {
      q[i] = clampf(nearest(iscale * (x[i] - low)), 0.0f, fmax);
      const float wq = w[i] * q[i];
      sum_l += wq, sum_l2 += wq * q[i], sum_xl += wq * x[i];
    }
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (!(det > 0.0f)) continue;
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
    float this_low = (sum_l2 * sum_x - sum_l * sum_xl) / det;
    if (this_low > 0.0f) this_low = 0.0f, this_scale = sum_xl / sum_l2;
    const float err = fit_error(x, w, this_scale, this_low, q);
    if (err < best) best = err, scale = this_scale, low = this_low;
  }
  *scale_out = scale, *low_out = low;
}

float to_f16_value(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)); }

// The weighted candidate: quants re-rounded against the fp16 scale (and min) as they decode.
void symmetric_weighted(const float* x, const float* w, int nmax, float* d_out, int* q) {
  const float d = to_f16_value(qx_scale(x, w, nmax));
  for (int i = 0; i < QK; i++) {
    q[i] = d != 0.0f ? static_cast<int>(clampf(nearest(x[i] / d), static_cast<float>(-nmax), static_cast<float>(nmax - 1))) + nmax
                     : nmax;
  }
  *d_out = d;
}

void affine_weighted(const float* x, const float* w, int nmax, float* d_out, float* m_out, int* q) {
  float scale, low;
  qkx_fit(x, w, nmax, &scale, &low);
  const float d = to_f16_value(scale), m = to_f16_value(low);
  for (int i = 0; i < QK; i++) {
    q[i] = d != 0.0f ? static_cast<int>(clampf(nearest((x[i] - m) / d), 0.0f, static_cast<float>(nmax))) : 0;
  }
  *d_out = d, *m_out = m;
}

// sum (qw * diff) * diff in order over the block's decoded values, NaN as infinite (simple_search.block_error).
float decoded_error(const float* x, const float* qw, const float* v) {
  float err = 0.0f;
  for (int i = 0; i < QK; i++) {
    const float diff = v[i] - x[i];
    err += qw[i] * diff * diff;
  }
  return std::isnan(err) ? INFINITY : err;
}

// Decoded values of a block, as the torch decoders compute them: d * (q - o) or d * q + m.
void decoded(const int* q, float d, float m, int offset, bool affine, float* v) {
  for (int i = 0; i < QK; i++) {
    v[i] = affine ? d * static_cast<float>(q[i]) + m : d * static_cast<float>(q[i] - offset);
  }
}

float f16_value_of(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

void encode_block(int qtype, const float* x, uint8_t* out);

// With weights w (search) and qw (error): the reference rule's block, else the weighted one where its
// decoded values have less weighted error (the first on ties: quantize/blocks.py pick_best).
void encode_block_weighted(int qtype, const float* x, const float* w, const float* qw, uint8_t* out) {
  encode_block(qtype, x, out);
  int qa[QK], qb[QK];
  float va[QK], vb[QK], d, m = 0.0f;
  const int8_t* s8 = reinterpret_cast<const int8_t*>(out + 2);
  switch (qtype) {
    case 8: {  // Q8_0: the weighted search may use -128 too
      const float da = f16_value_of(out);
      for (int i = 0; i < QK; i++) qa[i] = s8[i];
      for (int i = 0; i < QK; i++) va[i] = static_cast<float>(qa[i]) * da;
      symmetric_weighted(x, w, 128, &d, qb);
      for (int i = 0; i < QK; i++) vb[i] = static_cast<float>(qb[i] - 128) * d;
      if (decoded_error(x, qw, vb) < decoded_error(x, qw, va)) {
        put_f16(out, d);
        for (int i = 0; i < QK; i++) {
          const int8_t v = static_cast<int8_t>(qb[i] - 128);
          std::memcpy(out + 2 + i, &v, 1);
        }
      }
      return;
    }
    case 2:
    case 6: {  // Q4_0, Q5_0
      const int nmax = qtype == 2 ? 8 : 16;
      symmetric(x, nmax, &d, qa);
      decoded(qa, to_f16_value(d), 0.0f, nmax, false, va);
      symmetric_weighted(x, w, nmax, &d, qb);
      decoded(qb, d, 0.0f, nmax, false, vb);
      if (decoded_error(x, qw, vb) < decoded_error(x, qw, va)) {
        put_f16(out, d);
        if (qtype == 2) put_nibbles(out + 2, qb);
        else put_fifth_bits(out + 2, qb), put_nibbles(out + 6, qb);
      }
      return;
    }
    case 3:
    case 7: {  // Q4_1, Q5_1
      const int nmax = qtype == 3 ? 15 : 31;
      affine(x, nmax, &d, &m, qa);
      decoded(qa, to_f16_value(d), to_f16_value(m), 0, true, va);
      affine_weighted(x, w, nmax, &d, &m, qb);
      decoded(qb, d, m, 0, true, vb);
      if (decoded_error(x, qw, vb) < decoded_error(x, qw, va)) {
        put_f16(out, d), put_f16(out + 2, m);
        if (qtype == 3) put_nibbles(out + 4, qb);
        else put_fifth_bits(out + 4, qb), put_nibbles(out + 8, qb);
      }
      return;
    }
  }
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

bool encode_simple(int qtype, const void* x, bool half, int64_t rows, int64_t cols, const float* imp,
                   int64_t imp_stride, uint8_t* out, int threads) {
  const int64_t nb = cols / QK, bytes = simple_block_bytes(qtype);
  if (!bytes) return true;
  bool finite = true;
  // one row a task: --target-bpw round-trips 64 sampled rows per candidate (16-row tasks kept 12 of an
  // H100 host's 16 cores idle); a row of thousands of values outweighs the scheduling
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buf(half ? cols : 0);  // a row of fp16 input, widened
#pragma omp for schedule(dynamic, 1) reduction(&& : finite)
    for (int64_t r = 0; r < rows; r++) {
      const float* xr = load_finite(x, half, r * cols, cols, buf.data());
      if (!xr) {  // the caller refuses the tensor: the row is left unwritten
        finite = false;
        continue;
      }
      if (!imp) {
        for (int64_t b = 0; b < nb; b++) encode_block(qtype, xr + b * QK, out + (r * nb + b) * bytes);
        continue;
      }
      // quantize_row_*_impl: sigma2 = sum of x^2 over the row (in order) / cols; w = qw * sqrtf(sigma2 + x^2)
      const float* qwr = imp + r * imp_stride;
      float sum_x2 = 0.0f;
      for (int64_t j = 0; j < cols; j++) sum_x2 += xr[j] * xr[j];
      const float sigma2 = sum_x2 / static_cast<float>(cols);
      float w[QK];
      for (int64_t b = 0; b < nb; b++) {
        const float* xb = xr + b * QK;
        const float* qw = qwr + b * QK;
        for (int i = 0; i < QK; i++) w[i] = qw[i] * std::sqrt(sigma2 + xb[i] * xb[i]);
        encode_block_weighted(qtype, xb, w, qw, out + (r * nb + b) * bytes);
      }
    }
  }
  return finite;
}

}  // namespace lq
