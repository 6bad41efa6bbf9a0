// tanh on 8 floats at a time (AVX2), for the Gemma layer's tanh-GELU and soft caps: the scalar
// std::tanh costs ~25-50 ns a value, more than a decode step's products for a vocabulary of 256k
// soft-capped logits. Cephes' tanhf scheme: an odd polynomial below |x| = 0.625, else
// 1 - 2 / (exp(2|x|) + 1) with the sign restored; exp by 2^n * a degree-6 polynomial of the
// remainder (Cephes expf). Error: a few ulp of 1 (tests/test_cpu_families.py: within the decode
// step's tolerance of torch.tanh; the kernels' int16 rounding of activations is ~1e3 times larger).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace lq {

// exp(x) for x in [-88, 88] (the caller clamps).
inline __m256 exp8(__m256 x) {
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
  r = _mm256_fnmadd_ps(n, ln2_lo, r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline __m256 tanh8(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 a = _mm256_andnot_ps(sign, x);  // |x|
  // |x| >= 0.625: 1 - 2 / (exp(2|x|) + 1), exp's argument clamped (tanh is 1 in fp32 from |x| ~ 9)
  const __m256 z = exp8(_mm256_min_ps(_mm256_add_ps(a, a), _mm256_set1_ps(88.f)));
  const __m256 one = _mm256_set1_ps(1.f);
  __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(z, one)));
  big = _mm256_or_ps(big, _mm256_and_ps(x, sign));
  // |x| < 0.625: x + x^3 P(x^2)
  const __m256 s = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(2.06390887954e-2f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(-5.37397155531e-2f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(1.33314422036e-1f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(-3.33332819422e-1f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, s), x, x);
  return _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
}

// out[i] = tanh(x[i]) for n values (any n; x == out allowed).
inline void tanh_n(const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, tanh8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    float buf[8] = {0.f};
    for (int64_t j = i; j < n; j++) buf[j - i] = x[j];
    const __m256 t = tanh8(_mm256_loadu_ps(buf));
    _mm256_storeu_ps(buf, t);
    for (int64_t j = i; j < n; j++) out[j] = buf[j - i];
  }
}

}  // namespace lq
