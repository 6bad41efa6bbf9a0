// make_qkx2_quants / make_qkx3_quants on 8 groups at once, one group per AVX2 lane (cpu_kencode.cpp's
// scalar make_qkx, lane by lane): every lane does the scalar code's float operations in the scalar
// code's order (separate mul / add, no FMA; sums over the group's values in sequence), so each lane's
// result is the scalar one bit for bit. Flat groups (max <= min) compute throwaway values that are
// replaced at the end, as the torch reference (quantize/ksearch.py make_qkx) does.
#pragma once

#include <immintrin.h>

namespace lq {

// xt, wt: n x 8 (value i of group j at [8 i + j]), n <= 32 -> scale[8], the_min[8].
inline void make_qkx8(int n, int nmax, const float* xt, const float* wt, float rmin, float rdelta, int nstep,
                      bool mad, bool v3, float* scale_out, float* min_out) {
  const __m256 zero = _mm256_setzero_ps(), fmax = _mm256_set1_ps(static_cast<float>(nmax));
  const __m256 sign = _mm256_set1_ps(-0.f);
  auto rnd = [](__m256 v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); };
  auto lt = [](__m256 a, __m256 b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); };
  auto gt = [](__m256 a, __m256 b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); };
  // clampf(v, 0, nmax): v < 0 ? 0 : (v > nmax ? nmax : v)
  auto clamp = [&](__m256 v) {
    const __m256 hi = _mm256_blendv_ps(v, fmax, gt(v, fmax));
    return _mm256_blendv_ps(hi, zero, lt(v, zero));
  };
  auto err_of = [&](__m256 diff) { return mad ? _mm256_andnot_ps(sign, diff) : _mm256_mul_ps(diff, diff); };

  __m256 mn = _mm256_loadu_ps(xt), mx = mn;
  for (int i = 1; i < n; ++i) {
    const __m256 x = _mm256_loadu_ps(xt + 8 * i);
    mn = _mm256_blendv_ps(mn, x, lt(x, mn));
    mx = _mm256_blendv_ps(mx, x, gt(x, mx));
  }
  __m256 sum_w = zero, sum_x = zero;
  for (int i = 0; i < n; ++i) sum_w = _mm256_add_ps(sum_w, _mm256_loadu_ps(wt + 8 * i));
  for (int i = 0; i < n; ++i)
    sum_x = _mm256_add_ps(sum_x, _mm256_mul_ps(_mm256_loadu_ps(wt + 8 * i), _mm256_loadu_ps(xt + 8 * i)));
  mn = _mm256_blendv_ps(mn, zero, gt(mn, zero));
  const __m256 flat = _mm256_cmp_ps(mx, mn, _CMP_LE_OQ);
  const __m256 mn0 = mn;

  const __m256 iscale = _mm256_div_ps(fmax, _mm256_sub_ps(mx, mn));
  __m256 scale = _mm256_div_ps(_mm256_set1_ps(1.f), iscale);
  __m256 best = zero;
  for (int i = 0; i < n; ++i) {
    const __m256 x = _mm256_loadu_ps(xt + 8 * i), w = _mm256_loadu_ps(wt + 8 * i);
    const __m256 l = clamp(rnd(_mm256_mul_ps(iscale, _mm256_sub_ps(x, mn))));
    const __m256 diff = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(scale, l), mn), x);
    best = _mm256_add_ps(best, _mm256_mul_ps(w, err_of(diff)));
  }
  __m256 low = mn;
  __m256 La[32];
  for (int is = 0; is <= nstep; ++is) {
    const float c = rmin + rdelta * static_cast<float>(is) + static_cast<float>(nmax);
    const __m256 isc = _mm256_div_ps(_mm256_set1_ps(c), _mm256_sub_ps(mx, low));
    __m256 sl = zero, sl2 = zero, sxl = zero;
    for (int i = 0; i < n; ++i) {
      const __m256 x = _mm256_loadu_ps(xt + 8 * i), w = _mm256_loadu_ps(wt + 8 * i);
      const __m256 v = _mm256_mul_ps(isc, _mm256_sub_ps(x, low));
      __m256 l;
      if (v3) {  // v > 0 ? round(v < nmax ? v : nmax) : 0
        const __m256 r = rnd(_mm256_blendv_ps(fmax, v, lt(v, fmax)));
        l = _mm256_blendv_ps(zero, r, gt(v, zero));
      } else {
        l = clamp(rnd(v));
      }
      La[i] = l;
      const __m256 wl = _mm256_mul_ps(w, l);
      sl = _mm256_add_ps(sl, wl);
      sl2 = _mm256_add_ps(sl2, _mm256_mul_ps(wl, l));
      sxl = _mm256_add_ps(sxl, _mm256_mul_ps(wl, x));
    }
    const __m256 D = _mm256_sub_ps(_mm256_mul_ps(sum_w, sl2), _mm256_mul_ps(sl, sl));
    __m256 ts = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sum_w, sxl), _mm256_mul_ps(sum_x, sl)), D);
    __m256 tm = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sl2, sum_x), _mm256_mul_ps(sl, sxl)), D);
    const __m256 pos = gt(tm, zero);
    ts = _mm256_blendv_ps(ts, _mm256_div_ps(sxl, sl2), pos);
    tm = _mm256_blendv_ps(tm, zero, pos);
    __m256 err = zero;
    for (int i = 0; i < n; ++i) {
      const __m256 x = _mm256_loadu_ps(xt + 8 * i), w = _mm256_loadu_ps(wt + 8 * i);
      const __m256 diff = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(ts, La[i]), tm), x);
      err = _mm256_add_ps(err, _mm256_mul_ps(w, err_of(diff)));
    }
    const __m256 better = _mm256_and_ps(gt(D, zero), lt(err, best));
    best = _mm256_blendv_ps(best, err, better);
    scale = _mm256_blendv_ps(scale, ts, better);
    low = _mm256_blendv_ps(low, tm, better);
  }
  _mm256_storeu_ps(scale_out, _mm256_blendv_ps(scale, zero, flat));
  _mm256_storeu_ps(min_out, _mm256_xor_ps(sign, _mm256_blendv_ps(low, mn0, flat)));
}

// make_qx_quants (rmse_type 1, weights w) on 8 groups at once (cpu_kencode.cpp's scalar make_qx, lane by
// lane; the quants themselves are not returned): xt, wt n x 8 as above -> scale[8].
inline void make_qx8(int n, int nmax, const float* xt, const float* wt, float* scale_out) {
  const __m256 zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.f);
  const __m256 lo = _mm256_set1_ps(-static_cast<float>(nmax)), hi = _mm256_set1_ps(static_cast<float>(nmax - 1));
  __m256 amax = zero, mx = zero;
  for (int i = 0; i < n; ++i) {
    const __m256 x = _mm256_loadu_ps(xt + 8 * i), ax = _mm256_andnot_ps(sign, x);
    const __m256 gt = _mm256_cmp_ps(ax, amax, _CMP_GT_OQ);
    amax = _mm256_blendv_ps(amax, ax, gt);
    mx = _mm256_blendv_ps(mx, x, gt);
  }
  const __m256 live = _mm256_cmp_ps(_mm256_andnot_ps(sign, mx), _mm256_set1_ps(1e-15f), _CMP_GE_OQ);
  static const int ks[19] = {0, -9, -8, -7, -6, -5, -4, -3, -2, -1, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  __m256 scale = zero, best = zero;
  for (int t = 0; t < 19; ++t) {
    const int k = ks[t];
    const float c = k ? static_cast<float>(nmax) + 0.1f * static_cast<float>(k) : static_cast<float>(nmax);
    const __m256 isc = _mm256_div_ps(_mm256_set1_ps(-c), mx);
    __m256 sumlx = zero, suml2 = zero;
    for (int i = 0; i < n; ++i) {
      const __m256 x = _mm256_loadu_ps(xt + 8 * i), w = _mm256_loadu_ps(wt + 8 * i);
      const __m256 v = _mm256_round_ps(_mm256_mul_ps(isc, x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256 h = _mm256_blendv_ps(v, hi, _mm256_cmp_ps(v, hi, _CMP_GT_OQ));
      const __m256 q = _mm256_blendv_ps(h, lo, _mm256_cmp_ps(v, lo, _CMP_LT_OQ));
      sumlx = _mm256_add_ps(sumlx, _mm256_mul_ps(_mm256_mul_ps(w, x), q));
      suml2 = _mm256_add_ps(suml2, _mm256_mul_ps(_mm256_mul_ps(w, q), q));
    }
    const __m256 s = _mm256_div_ps(sumlx, suml2);
    if (t == 0) {
      scale = _mm256_blendv_ps(zero, s, _mm256_cmp_ps(suml2, zero, _CMP_NEQ_UQ));
      best = _mm256_mul_ps(scale, sumlx);
    } else {
      const __m256 better = _mm256_and_ps(_mm256_cmp_ps(suml2, zero, _CMP_GT_OQ),
                                          _mm256_cmp_ps(_mm256_mul_ps(sumlx, sumlx), _mm256_mul_ps(best, suml2), _CMP_GT_OQ));
      scale = _mm256_blendv_ps(scale, s, better);
      best = _mm256_blendv_ps(best, _mm256_mul_ps(s, sumlx), better);
    }
  }
  _mm256_storeu_ps(scale_out, _mm256_and_ps(scale, live));
}

}  // namespace lq
