// Encoder input rows as fp32: the stored fp32 values in place, or IEEE fp16 values widened exactly
// (F16C), so that quantize's encoders read a GGUF file's F16 tensor without a float32 copy of it;
// and whether they are all finite (NaN / Inf are refused by quantize/blocks.py), checked on the way.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace lq {

// Values [i, i + n) of x (fp32, or fp16 where `half`) as fp32: x's own memory (fp32) or buf (n floats,
// fp16 converted, exact). Returns nullptr where any of them is NaN or +-Inf.
inline const float* load_finite(const void* x, bool half, int64_t i, int64_t n, float* buf) {
  const float* v = static_cast<const float*>(x) + i;
  if (half) {
    const uint16_t* h = static_cast<const uint16_t*>(x) + i;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
      _mm256_storeu_ps(buf + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j))));
    for (; j < n; j++) buf[j] = _cvtsh_ss(h[j]);
    v = buf;
  }
  // exponent bits all ones <=> NaN or Inf
  const __m256i e = _mm256_set1_epi32(0x7f800000);
  __m256i bad = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256i b = _mm256_castps_si256(_mm256_loadu_ps(v + j));
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(b, e), e));
  }
  bool finite = _mm256_testz_si256(bad, bad);
  for (; j < n; j++) {
    const __m128i b = _mm_castps_si128(_mm_set_ss(v[j]));
    finite = finite && (_mm_cvtsi128_si32(b) & 0x7f800000) != 0x7f800000;
  }
  return finite ? v : nullptr;
}

}  // namespace lq
