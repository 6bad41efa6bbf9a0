// The vector operations of the tile kernels (cpu_tiles.cpp), at two widths, so one kernel body serves:
//   Y: one 8-row tile in 256-bit registers (AVX2, or AVX-512VL);
//   Z: two consecutive tiles (16 rows) in 512-bit registers: quants of tile a in the low half,
//      tile b in the high half, so each broadcast of x serves 16 rows (AVX-512 with VNNI).
// Within each 128-bit lane both behave alike, which is all the kernel relies on.
#pragma once

#include "cpu_quant.h"

namespace lq {

struct Y {
  using I = __m256i;
  using F = __m256;
  static constexpr int rows = 8, nt = 2;  // nt: rows of x a pass (16 ymm registers on AVX2)
  static I load(const uint8_t* a, const uint8_t*) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I set8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static I set32(int v) { return _mm256_set1_epi32(v); }
  static I set64(int64_t v) { return _mm256_set1_epi64x(v); }
  static I band(I a, I b) { return _mm256_and_si256(a, b); }
  static I bor(I a, I b) { return _mm256_or_si256(a, b); }
  static I shr4(I a) { return _mm256_srli_epi16(a, 4); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I widen_lo(I a) { return _mm256_unpacklo_epi8(a, zero()); }
  static I widen_hi(I a) { return _mm256_unpackhi_epi8(a, zero()); }
  static I madd(I acc, I a, I b) { return madd16(acc, a, b); }
  static I maddubs(I u8, I s8) { return _mm256_maddubs_epi16(u8, s8); }  // int16 pair sums (bytes_dot: no overflow)
  static I pairs16(I a, int m) { return _mm256_madd_epi16(a, _mm256_set1_epi16(static_cast<int16_t>(m))); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  // 5th-bit plane (cpu_tiles.h): bit i of each byte moved to bit 4, the rest cleared (shifts of 16-bit
  // lanes stay within each byte for bits 4 - i >= 0 and 4 + i - 4 <= 7)
  template <int i>
  static I plane_bit(I plane) {
    if constexpr (i < 4) plane = _mm256_slli_epi16(plane, 4 - i);
    if constexpr (i > 4) plane = _mm256_srli_epi16(plane, i - 4);
    return band(plane, set8(0x10));
  }
  // 2-bit plane (cpu_tiles.h, Q6_K): bits 2j, 2j+1 of each byte moved to bits 4, 5, the rest cleared
  // (left shifts <= 4 and the right shift by 2 keep bits 4, 5 within their byte)
  template <int j>
  static I plane2(I plane) {
    if constexpr (j < 2) plane = _mm256_slli_epi16(plane, 4 - 2 * j);
    if constexpr (j == 3) plane = _mm256_srli_epi16(plane, 2);
    return band(plane, set8(0x30));
  }
  // 8 int8 at a -> fp32 (exact)
  static F i8_floats(const uint8_t* a, const uint8_t*) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a))));
  }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset(float v) { return _mm256_set1_ps(v); }
  static F to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  // (even, odd) 32-bit lanes of (lo, hi) added: per 128-bit lane [lo0+lo1, lo2+lo3, hi0+hi1, hi2+hi3]
  static I pair_sums(I lo, I hi) {
    const __m256 l = _mm256_castsi256_ps(lo), h = _mm256_castsi256_ps(hi);
    return add(_mm256_castps_si256(_mm256_shuffle_ps(l, h, _MM_SHUFFLE(2, 0, 2, 0))),
               _mm256_castps_si256(_mm256_shuffle_ps(l, h, _MM_SHUFFLE(3, 1, 3, 1))));
  }
  template <bool S32>
  static F scales(const uint8_t* a, const uint8_t*) {
    if constexpr (S32) return _mm256_loadu_ps(reinterpret_cast<const float*>(a));
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
  }
  // byte j of each 128-bit lane of idx (0..15) -> table[idx] (16 bytes)
  static I lookup16(const uint8_t* table, I idx) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))),
                               idx);
  }
  // 8 E8M0 bytes -> 2^(e - 128) in fp32, the bits of cpu_quant.h's e8m0_half (e < 2: subnormal)
  static F e8m0_half(const uint8_t* a, const uint8_t*) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, set32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(set32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(small, normal, _mm256_cmpgt_epi32(e, set32(1))));
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
struct Z {
  using I = __m512i;
  using F = __m512;
  static constexpr int rows = 16, nt = 4;
  static I load(const uint8_t* a, const uint8_t* b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(Y::load(a, a)), Y::load(b, b), 1);
  }
  static I zero() { return _mm512_setzero_si512(); }
  static I set8(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static I set32(int v) { return _mm512_set1_epi32(v); }
  static I set64(int64_t v) { return _mm512_set1_epi64(v); }
  static I band(I a, I b) { return _mm512_and_si512(a, b); }
  static I bor(I a, I b) { return _mm512_or_si512(a, b); }
  static I shr4(I a) { return _mm512_srli_epi16(a, 4); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I widen_lo(I a) { return _mm512_unpacklo_epi8(a, zero()); }
  static I widen_hi(I a) { return _mm512_unpackhi_epi8(a, zero()); }
  static I madd(I acc, I a, I b) { return _mm512_dpwssd_epi32(acc, a, b); }
  template <int i>
  static I plane_bit(I plane) {
    if constexpr (i < 4) plane = _mm512_slli_epi16(plane, 4 - i);
    if constexpr (i > 4) plane = _mm512_srli_epi16(plane, i - 4);
    return band(plane, set8(0x10));
  }
  template <int j>
  static I plane2(I plane) {
    if constexpr (j < 2) plane = _mm512_slli_epi16(plane, 4 - 2 * j);
    if constexpr (j == 3) plane = _mm512_srli_epi16(plane, 2);
    return band(plane, set8(0x30));
  }
  static F i8_floats(const uint8_t* a, const uint8_t* b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(Y::i8_floats(a, a)), Y::i8_floats(b, b), 1);
  }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F to_float(I a) { return _mm512_cvtepi32_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static I pair_sums(I lo, I hi) {
    const __m512 l = _mm512_castsi512_ps(lo), h = _mm512_castsi512_ps(hi);
    return add(_mm512_castps_si512(_mm512_shuffle_ps(l, h, _MM_SHUFFLE(2, 0, 2, 0))),
               _mm512_castps_si512(_mm512_shuffle_ps(l, h, _MM_SHUFFLE(3, 1, 3, 1))));
  }
  template <bool S32>
  static F scales(const uint8_t* a, const uint8_t* b) {
    if constexpr (S32) {
      return _mm512_insertf32x8(_mm512_castps256_ps512(Y::scales<true>(a, a)), Y::scales<true>(b, b), 1);
    }
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    return _mm512_cvtph_ps(_mm256_set_m128i(hi, lo));
  }
  static I lookup16(const uint8_t* table, I idx) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))), idx);
  }
  static F e8m0_half(const uint8_t* a, const uint8_t* b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(Y::e8m0_half(a, a)), Y::e8m0_half(b, b), 1);
  }
};
#endif

}  // namespace lq
