// K-quant encoders: see cpu_kencode.h. Every float below is computed as quantize/ksearch.py and
// quantize/kquants.py compute it (each product left to right, each sum in order from 0), which is
// llama.cpp's ggml-quants.c order for its searches; fp-contract is off so no a * b + c becomes an FMA.
#pragma GCC optimize("fp-contract=off")

#include "cpu_kencode.h"
#include "cpu_kencode_avx.h"
#include "cpu_values.h"

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace lq {
namespace {

constexpr int QK = 256;
constexpr float GROUP_MAX_EPS = 1e-15f;
constexpr int MAX_CANDIDATES = 12;

inline float rnd(float v) { return __builtin_nearbyintf(v); }  // half to even, as torch.round

// clamp as torch.clamp: NaN stays NaN
inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

inline uint16_t f16_bits(float v) { return _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT); }
inline float f16_round(float v) { return _cvtsh_ss(f16_bits(v)); }

inline void put_f16(uint8_t* p, float v) {
  const uint16_t h = f16_bits(v);
  std::memcpy(p, &h, 2);
}

// ---- the searches (quantize/ksearch.py)

// ggml's coordinate descent on L (make_qp_quants: gate slx > 0 && sl2 > 0; make_q3_quants: slx > 0).
void descend(int n, const float* x, const float* w, float* L, float qmin, float qmax, bool gate_sl2, float* psumlx,
             float* psuml2) {
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) sumlx += w[i] * x[i] * L[i];
  for (int i = 0; i < n; ++i) suml2 += w[i] * L[i] * L[i];
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const float slx = sumlx - w[i] * x[i] * L[i];
      const float sl2 = suml2 - w[i] * L[i] * L[i];
      if (!(slx > 0) || (gate_sl2 && !(sl2 > 0))) continue;
      const float nl = clampf(rnd(x[i] * sl2 / slx), qmin, qmax);
      if (nl == L[i]) continue;
      const float slx_new = slx + w[i] * x[i] * nl;
      const float sl2_new = sl2 + w[i] * nl * nl;
      if (sl2_new > 0 && slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new) {
        L[i] = nl;
        sumlx = slx_new;
        suml2 = sl2_new;
        ++changed;
      }
    }
    if (!changed) break;
  }
  *psumlx = sumlx;
  *psuml2 = suml2;
}

// make_qp_quants: non-negative x ~ scale * L, L in [0, nmax]; returns scale.
float make_qp(int n, int nmax, const float* x, const float* w, float* L) {
  float mx = 0;
  for (int i = 0; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  if (!(mx >= GROUP_MAX_EPS)) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  const float fmax = static_cast<float>(nmax);
  float iscale = fmax / mx;
  {
    const float scale = 1 / iscale;
    float best = 0;
    for (int i = 0; i < n; ++i) {
      const float diff = x[i] - scale * rnd(iscale * x[i]);
      best += w[i] * diff * diff;
    }
    for (int is = -4; is <= 4; ++is) {
      if (is == 0) continue;
      const float isc = (0.1f * static_cast<float>(is) + fmax) / mx;
      const float sc = 1 / isc;
      float err = 0;
      for (int i = 0; i < n; ++i) {
        const float l = clampf(rnd(isc * x[i]), -INFINITY, fmax);
        const float diff = x[i] - sc * l;
        err += w[i] * diff * diff;
      }
      if (err < best) {
        best = err;
        iscale = isc;
      }
    }
  }
  for (int i = 0; i < n; ++i) L[i] = clampf(rnd(iscale * x[i]), -INFINITY, fmax);
  float sumlx, suml2;
  descend(n, x, w, L, -1073741824.f, fmax, true, &sumlx, &suml2);
  return suml2 > 0 ? sumlx / suml2 : 0.f;
}

// The first value of largest magnitude (0 if all are 0).
float signed_max(int n, const float* x) {
  float mx = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      mx = x[i];
    }
  }
  return mx;
}

// make_qx_quants (rmse_type 1, weights w): x ~ scale * L, L in [-nmax, nmax-1]; returns scale.
float make_qx(int n, int nmax, const float* x, const float* w, float* L) {
  const float mx = signed_max(n, x);
  if (!(std::fabs(mx) >= GROUP_MAX_EPS)) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  const float fmax = static_cast<float>(nmax);
  static const int ks[19] = {0, -9, -8, -7, -6, -5, -4, -3, -2, -1, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  float scale = 0, best = 0, q[32];
  for (int t = 0; t < 19; ++t) {
    const int k = ks[t];
    const float c = k ? fmax + 0.1f * static_cast<float>(k) : fmax;
    const float isc = -c / mx;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) q[i] = clampf(rnd(isc * x[i]), -fmax, fmax - 1);
    for (int i = 0; i < n; ++i) sumlx += w[i] * x[i] * q[i];
    for (int i = 0; i < n; ++i) suml2 += w[i] * q[i] * q[i];
    if (t == 0) {
      scale = suml2 != 0 ? sumlx / suml2 : 0.f;
      best = scale * sumlx;
      std::memcpy(L, q, n * sizeof(float));
    } else if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      scale = sumlx / suml2;
      best = scale * sumlx;
      std::memcpy(L, q, n * sizeof(float));
    }
  }
  return scale;
}

// make_qx's scale of each of the 16 sub-blocks of 16 (x, w: 256), 8 sub-blocks a call.
void qx_scales16(const float* x, const float* w, int nmax, float* scale) {
  for (int j0 = 0; j0 < 16; j0 += 8) {
    float xt[128], wt[128];
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 16; ++i) xt[8 * i + j] = x[16 * (j0 + j) + i], wt[8 * i + j] = w[16 * (j0 + j) + i];
    make_qx8(16, nmax, xt, wt, scale + j0);
  }
}

// make_q3_quants with do_rmse; returns scale.
float make_q3(int n, int nmax, const float* x) {
  const float mx = signed_max(n, x);
  if (!(std::fabs(mx) >= GROUP_MAX_EPS)) return 0.f;
  const float fmax = static_cast<float>(nmax);
  const float iscale = -fmax / mx;
  float L[16], w[16];
  for (int i = 0; i < n; ++i) L[i] = clampf(rnd(iscale * x[i]), -fmax, fmax - 1);
  for (int i = 0; i < n; ++i) w[i] = x[i] * x[i];
  float sumlx, suml2;
  descend(n, x, w, L, -fmax, fmax - 1, false, &sumlx, &suml2);
  return suml2 > 0 ? sumlx / suml2 : 0.f;
}

// ---- candidates: d * sc[j] * q - dmin * m[j] over NS sub-blocks (dmin = 0, m = 0 for the symmetric types)

struct Fields {
  float d = 0, dmin = 0;
  float sc[16] = {}, m[16] = {};
};

// Non-negative s -> ints by max (the ref quantizers): d = max / levels.
void scales_by_max(int ns, const float* s, int levels, float* ints, float* d) {
  float top = 0;
  for (int j = 0; j < ns; ++j) top = s[j] > top ? s[j] : top;
  const float lv = static_cast<float>(levels);
  const float inv = top > 0 ? lv / top : 0.f;
  for (int j = 0; j < ns; ++j) ints[j] = clampf(rnd(inv * s[j]), 0.f, lv);
  *d = f16_round(top / lv);
}

// Signed s -> ints in [-levels, levels-1] with the largest |s| at -levels (Q3_K, Q6_K ref).
void signed_scales_by_max(int ns, const float* s, int levels, float* ints, float* d) {
  const float top = signed_max(ns, s);
  const bool live = std::fabs(top) >= GROUP_MAX_EPS;
  const float lv = static_cast<float>(levels);
  const float iscale = live ? -lv / top : 0.f;
  for (int j = 0; j < ns; ++j) ints[j] = clampf(rnd(iscale * s[j]), -lv, lv - 1);
  *d = f16_round(live ? 1 / iscale : 0.f);
}

template <int NS>
void requant_affine(const float* x, const Fields& f, int nmax, float* q) {
  constexpr int S = QK / NS;
  for (int j = 0; j < NS; ++j) {
    const float dl = f.d * f.sc[j], ml = f.dmin * f.m[j];
    for (int i = 0; i < S; ++i) {
      q[S * j + i] = dl != 0 ? clampf(rnd((x[S * j + i] + ml) / dl), 0.f, static_cast<float>(nmax)) : 0.f;
    }
  }
}

template <int NS>
void requant_symmetric(const float* x, const Fields& f, int nmax, float* q) {
  constexpr int S = QK / NS;
  const float fmax = static_cast<float>(nmax);
  for (int j = 0; j < NS; ++j) {
    const float dl = f.d * f.sc[j];
    for (int i = 0; i < S; ++i) q[S * j + i] = dl != 0 ? clampf(rnd(x[S * j + i] / dl), -fmax, fmax - 1) : 0.f;
  }
}

// (d, dmin) of least sum ew (d sc q - dmin m - x)^2 for the current quants (kquants.refit_affine).
template <int NS>
Fields refit_affine(const float* x, const float* ew, int nmax, const Fields& f) {
  constexpr int S = QK / NS;
  float q[QK];
  requant_affine<NS>(x, f, nmax, q);
  float saa = 0, sab = 0, sbb = 0, sax = 0, sbx = 0;
  for (int e = 0; e < QK; ++e) { const float a = f.sc[e / S] * q[e]; saa += ew[e] * a * a; }
  for (int e = 0; e < QK; ++e) { const float a = f.sc[e / S] * q[e], b = f.m[e / S]; sab += ew[e] * a * b; }
  for (int e = 0; e < QK; ++e) { const float b = f.m[e / S]; sbb += ew[e] * b * b; }
  for (int e = 0; e < QK; ++e) { const float a = f.sc[e / S] * q[e]; sax += ew[e] * a * x[e]; }
  for (int e = 0; e < QK; ++e) { const float b = f.m[e / S]; sbx += ew[e] * b * x[e]; }
  const float det = saa * sbb - sab * sab;
  const bool both = det > 1e-6f * saa * sbb;
  const float nd = both ? (sbb * sax - sab * sbx) / det : sax / (saa > 0 ? saa : 1.f);
  const float ndm = both ? (sab * sax - saa * sbx) / det : f.dmin;
  Fields out = f;
  if (saa > 0 && std::isfinite(nd) && std::isfinite(ndm)) {
    out.d = f16_round(nd);
    out.dmin = f16_round(ndm);
  }
  return out;
}

template <int NS>
Fields refit_symmetric(const float* x, const float* ew, int nmax, const Fields& f) {
  constexpr int S = QK / NS;
  float q[QK];
  requant_symmetric<NS>(x, f, nmax, q);
  float saa = 0, sax = 0;
  for (int e = 0; e < QK; ++e) { const float a = f.sc[e / S] * q[e]; saa += ew[e] * a * a; }
  for (int e = 0; e < QK; ++e) { const float a = f.sc[e / S] * q[e]; sax += ew[e] * a * x[e]; }
  const float nd = sax / (saa > 0 ? saa : 1.f);
  Fields out = f;
  if (saa > 0 && std::isfinite(nd)) out.d = f16_round(nd);
  return out;
}

// Sum over the block of (qw * diff) * diff (or diff * diff) in order, NaN as infinite (kquants.best_of).
template <int NS>
float block_error(const float* x, const float* qw, const Fields& f, const float* q, bool affine) {
  constexpr int S = QK / NS;
  float err = 0;
  for (int j = 0; j < NS; ++j) {
    const float dl = f.d * f.sc[j], ml = f.dmin * f.m[j];
    for (int i = 0; i < S; ++i) {
      const int e = S * j + i;
      const float v = affine ? dl * q[e] - ml : dl * q[e];
      const float diff = v - x[e];
      err += qw ? qw[e] * diff * diff : diff * diff;
    }
  }
  return std::isnan(err) ? INFINITY : err;
}

// found + for each, two successive refits of it (kquants.with_refits); returns the count.
template <int NS>
int with_refits(Fields* c, int n_found, const float* x, const float* ew, int nmax, bool affine) {
  int n = n_found;
  for (int k = 0; k < n_found; ++k) {
    Fields f = c[k];
    for (int r = 0; r < 2; ++r) {
      f = affine ? refit_affine<NS>(x, ew, nmax, f) : refit_symmetric<NS>(x, ew, nmax, f);
      c[n++] = f;
    }
  }
  return n;
}

// The candidate of least error (the first on ties) and its quants.
template <int NS>
int pick(const float* x, const float* qw, const Fields* c, int n, int nmax, bool affine, float* best_q) {
  int best = 0;
  float best_err = 0, q[QK];
  for (int k = 0; k < n; ++k) {
    if (affine) requant_affine<NS>(x, c[k], nmax, q); else requant_symmetric<NS>(x, c[k], nmax, q);
    const float err = block_error<NS>(x, qw, c[k], q, affine);
    if (k == 0 || err < best_err) {
      best = k;
      best_err = err;
      std::memcpy(best_q, q, sizeof(q));
    }
  }
  return best;
}

// Sub-block scales and mins by make_qkx, then their ints against fp16 d and dmin (kquants.affine_fields).
template <int NS>
Fields affine_fields(const float* x, const float* w, int nmax, float rmin, float rdelta, int nstep, int levels,
                     bool search, bool mad) {
  constexpr int S = QK / NS;
  float scale[NS], mins[NS], sw[NS];
  for (int j0 = 0; j0 < NS; j0 += 8) {  // 8 sub-blocks at a time, one per lane
    float xt[8 * S], wt[8 * S];
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < S; ++i) xt[8 * i + j] = x[S * (j0 + j) + i], wt[8 * i + j] = w[S * (j0 + j) + i];
    make_qkx8(S, nmax, xt, wt, rmin, rdelta, nstep, mad, search, scale + j0, mins + j0);
  }
  for (int j = 0; j < NS; ++j) {
    float s = 0;
    for (int i = 0; i < S; ++i) s += w[S * j + i];
    sw[j] = s;
  }
  Fields f;
  if (search) {
    f.d = f16_round(make_qp(NS, levels, scale, sw, f.sc));
    f.dmin = f16_round(make_qp(NS, levels, mins, sw, f.m));
  } else {
    scales_by_max(NS, scale, levels, f.sc, &f.d);
    scales_by_max(NS, mins, levels, f.m, &f.dmin);
  }
  return f;
}

float block_sigma2(const float* x, float factor) {
  float s = 0;
  for (int e = 0; e < QK; ++e) s += x[e] * x[e];
  return factor * s / QK;
}

// ---- byte packing (formats/k_types.py draws the layouts)

inline int qi(float v) { return static_cast<int>(v); }

void pack_k_scales(const Fields& f, uint8_t* p) {  // 12 bytes of Q4_K / Q5_K
  for (int j = 0; j < 4; ++j) {
    p[j] = static_cast<uint8_t>(qi(f.sc[j]) | ((qi(f.sc[j + 4]) >> 4) << 6));
    p[j + 4] = static_cast<uint8_t>(qi(f.m[j]) | ((qi(f.m[j + 4]) >> 4) << 6));
    p[j + 8] = static_cast<uint8_t>((qi(f.sc[j + 4]) & 0xF) | ((qi(f.m[j + 4]) & 0xF) << 4));
  }
}

void k_low_nibbles(const float* q, uint8_t* p) {  // 128 bytes
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l)
      p[32 * c + l] = static_cast<uint8_t>((qi(q[64 * c + l]) & 0xF) | ((qi(q[64 * c + 32 + l]) & 0xF) << 4));
}

void high_bits(const float* q, int offset, int bit, uint8_t* p) {  // 32 bytes: byte e % 32, bit e / 32
  for (int l = 0; l < 32; ++l) {
    int b = 0;
    for (int k = 0; k < 8; ++k) b |= ((qi(q[32 * k + l]) + offset) >> bit & 1) << k;
    p[l] = static_cast<uint8_t>(b);
  }
}

void two_bits(const float* q, int offset, uint8_t* p) {  // 64 bytes
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      int b = 0;
      for (int k = 0; k < 4; ++k) b |= ((qi(q[128 * h + 32 * k + l]) + offset) & 3) << (2 * k);
      p[32 * h + l] = static_cast<uint8_t>(b);
    }
}

// ---- the five types: x (256), qw (256) or nullptr, ones (256 of 1.0f) -> block bytes

void encode_q45(const float* x, const float* qw, const float* ones, uint8_t* out, bool five) {
  const int nmax = five ? 31 : 15;
  const float* ew = qw ? qw : ones;
  float w[QK];
  Fields c[MAX_CANDIDATES];
  int n = 0;
  for (int j = 0; j < 8; ++j) {  // ref: weights rms of the sub-block + |x|, qkx2, scales by max
    float s = 0;
    for (int i = 0; i < 32; ++i) s += x[32 * j + i] * x[32 * j + i];
    const float av = std::sqrt(s / 32);
    for (int i = 0; i < 32; ++i) w[32 * j + i] = av + std::fabs(x[32 * j + i]);
  }
  c[n++] = five ? affine_fields<8>(x, w, nmax, -0.5f, 0.1f, 15, 63, false, false)
                : affine_fields<8>(x, w, nmax, -1.f, 0.1f, 20, 63, false, false);
  const float sigma2 = block_sigma2(x, 2.f);
  const float av = std::sqrt(sigma2);
  for (int e = 0; e < QK; ++e) w[e] = av + std::fabs(x[e]);
  c[n++] = affine_fields<8>(x, w, nmax, -0.9f, 0.05f, 36, 63, true, false);
  if (qw) {
    for (int e = 0; e < QK; ++e) w[e] = qw[e] * std::sqrt(sigma2 + x[e] * x[e]);
    c[n++] = affine_fields<8>(x, w, nmax, -0.9f, 0.05f, 36, 63, true, false);
  }
  c[n++] = affine_fields<8>(x, ew, nmax, -0.9f, 0.05f, 36, 63, true, false);
  n = with_refits<8>(c, n, x, ew, nmax, true);
  float q[QK];
  const Fields& f = c[pick<8>(x, qw, c, n, nmax, true, q)];
  put_f16(out, f.d);
  put_f16(out + 2, f.dmin);
  pack_k_scales(f, out + 4);
  if (five) {
    high_bits(q, 0, 4, out + 16);
    k_low_nibbles(q, out + 48);
  } else {
    k_low_nibbles(q, out + 16);
  }
}

void encode_q2(const float* x, const float* qw, const float* ones, uint8_t* out) {
  const float* ew = qw ? qw : ones;
  float w[QK];
  Fields c[MAX_CANDIDATES];
  int n = 0;
  for (int e = 0; e < QK; ++e) w[e] = std::fabs(x[e]);
  c[n++] = affine_fields<16>(x, w, 3, -0.5f, 0.1f, 15, 15, false, true);
  const float sigma2 = block_sigma2(x, 1.f);
  for (int e = 0; e < QK; ++e) w[e] = ew[e] * std::sqrt(sigma2 + x[e] * x[e]);
  c[n++] = affine_fields<16>(x, w, 3, -0.9f, 0.05f, 36, 15, true, false);
  c[n++] = affine_fields<16>(x, ew, 3, -0.9f, 0.05f, 36, 15, true, false);
  n = with_refits<16>(c, n, x, ew, 3, true);
  float q[QK];
  const Fields& f = c[pick<16>(x, qw, c, n, 3, true, q)];
  for (int j = 0; j < 16; ++j) out[j] = static_cast<uint8_t>((qi(f.sc[j]) & 0xF) | ((qi(f.m[j]) & 0xF) << 4));
  two_bits(q, 0, out + 16);
  put_f16(out + 80, f.d);
  put_f16(out + 82, f.dmin);
}

// Q3_K's impl candidates: make_qx per sub-block weighted w, then its scales by make_qx weighted sw.
Fields q3_impl(const float* x, const float* w) {
  float scale[16], sw[16];
  qx_scales16(x, w, 4, scale);
  for (int j = 0; j < 16; ++j) {
    float s = 0;
    for (int i = 0; i < 16; ++i) s += w[16 * j + i];
    sw[j] = s;
  }
  Fields f;
  f.d = f16_round(make_qx(16, 32, scale, sw, f.sc));
  return f;
}

void encode_q3(const float* x, const float* qw, const float* ones, uint8_t* out) {
  const float* ew = qw ? qw : ones;
  float w[QK], scale[16];
  Fields c[MAX_CANDIDATES];
  int n = 0;
  for (int j = 0; j < 16; ++j) scale[j] = make_q3(16, 4, x + 16 * j);
  signed_scales_by_max(16, scale, 32, c[n].sc, &c[n].d);
  ++n;
  if (qw) {
    const float sigma2 = block_sigma2(x, 2.f);
    for (int e = 0; e < QK; ++e) w[e] = qw[e] * std::sqrt(sigma2 + x[e] * x[e]);
  } else {
    for (int e = 0; e < QK; ++e) w[e] = x[e] * x[e];
  }
  c[n++] = q3_impl(x, w);
  c[n++] = q3_impl(x, ew);
  n = with_refits<16>(c, n, x, ew, 4, false);
  float q[QK];
  const Fields& f = c[pick<16>(x, qw, c, n, 4, false, q)];
  high_bits(q, 4, 2, out);
  two_bits(q, 4, out + 32);
  int u[16];
  for (int j = 0; j < 16; ++j) u[j] = qi(f.sc[j]) + 32;
  for (int j = 0; j < 8; ++j) out[96 + j] = static_cast<uint8_t>((u[j] & 0xF) | ((u[j + 8] & 0xF) << 4));
  for (int b = 0; b < 4; ++b) {
    int v = 0;
    for (int k = 0; k < 4; ++k) v |= ((u[4 * k + b] >> 4) & 3) << (2 * k);
    out[104 + b] = static_cast<uint8_t>(v);
  }
  put_f16(out + 108, f.d);
}

void encode_q6(const float* x, const float* qw, const float* ones, uint8_t* out) {
  const float* ew = qw ? qw : ones;
  float w[QK], scale[16];
  Fields c[MAX_CANDIDATES];
  int n = 0;
  for (int e = 0; e < QK; ++e) w[e] = x[e] * x[e];
  const float* wsets[2] = {w, ew};
  for (const float* ws : wsets) {
    qx_scales16(x, ws, 32, scale);
    signed_scales_by_max(16, scale, 128, c[n].sc, &c[n].d);
    ++n;
  }
  n = with_refits<16>(c, n, x, ew, 32, false);
  float q[QK];
  const Fields& f = c[pick<16>(x, qw, c, n, 32, false, q)];
  for (int h = 0; h < 2; ++h) {
    const float* qh = q + 128 * h;
    for (int l = 0; l < 32; ++l) {
      const int q1 = qi(qh[l]) + 32, q2 = qi(qh[l + 32]) + 32, q3 = qi(qh[l + 64]) + 32, q4 = qi(qh[l + 96]) + 32;
      out[64 * h + l] = static_cast<uint8_t>((q1 & 0xF) | ((q3 & 0xF) << 4));
      out[64 * h + l + 32] = static_cast<uint8_t>((q2 & 0xF) | ((q4 & 0xF) << 4));
      out[128 + 32 * h + l] =
          static_cast<uint8_t>(((q1 >> 4) & 3) | (((q2 >> 4) & 3) << 2) | (((q3 >> 4) & 3) << 4) | (((q4 >> 4) & 3) << 6));
    }
  }
  for (int j = 0; j < 16; ++j) out[192 + j] = static_cast<uint8_t>(static_cast<int8_t>(qi(f.sc[j])));
  put_f16(out + 208, f.d);
}

int block_bytes(int qtype) {
  switch (qtype) {
    case 10: return 84;   // Q2_K
    case 11: return 110;  // Q3_K
    case 12: return 144;  // Q4_K
    case 13: return 176;  // Q5_K
    case 14: return 210;  // Q6_K
    default: return 0;
  }
}

}  // namespace

bool kquant_encodes(int qtype) { return block_bytes(qtype) != 0; }

bool kquant_encode(int qtype, const void* x, bool half, int64_t rows, int64_t cols, const float* qw,
                   int64_t qw_stride, uint8_t* out, int threads) {
  const int nbytes = block_bytes(qtype);
  if (!nbytes || cols % QK) return true;  // not a K type: the caller checks kquant_encodes (quantize/blocks.py)
  const int64_t per_row = cols / QK, blocks = rows * per_row;
  bool finite = true;
#pragma omp parallel num_threads(threads)
  {
    float ones[QK], buf[QK];
    for (int e = 0; e < QK; ++e) ones[e] = 1.f;
#pragma omp for schedule(dynamic, 16) reduction(&& : finite)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r = b / per_row, k = b % per_row;
      const float* xb = load_finite(x, half, r * cols + k * QK, QK, buf);
      if (!xb) {  // the caller refuses the tensor: the block is left unwritten
        finite = false;
        continue;
      }
      const float* wb = qw ? qw + r * qw_stride + k * QK : nullptr;
      uint8_t* ob = out + b * nbytes;
      switch (qtype) {
        case 10: encode_q2(xb, wb, ones, ob); break;
        case 11: encode_q3(xb, wb, ones, ob); break;
        case 12: encode_q45(xb, wb, ones, ob, false); break;
        case 13: encode_q45(xb, wb, ones, ob, true); break;
        default: encode_q6(xb, wb, ones, ob); break;
      }
    }
  }
  return finite;
}

}  // namespace lq
