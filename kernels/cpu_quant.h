// GGUF block formats read in place by the CPU kernels: every format is seen as groups of 32 weights
//     w[e] = s[h] * (u[e] - o) + m[h],   h = e / 16 (the group's two halves), u[e] an unsigned byte,
// so one integer dot product (u8 weights widened to int16 x int16 activations: VNNI vpdpwssd, or AVX2 vpmaddwd)
// serves Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL and IQ4_XS (their codes looked up
// as integers). The blocks stay as the file stores them (memory-mapped); only the 6-bit K-quant scales
// are unpacked, per group, in registers.
//
// Exactness: s and m are computed in fp32 in the order of the torch decoders (d * sc first, then the
// min term), so s * (u - o) + m equals dequantize_torch's value bit for bit (tests/test_cpu_kernels.py).
// Byte layouts: see the comments above each decoder in quantize/formats/legacy_types.py and k_types.py.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if !defined(__AVX2__) || !defined(__F16C__) || !defined(__FMA__)
#error "localllm's CPU kernels need x86-64 with AVX2, F16C and FMA (kernels/cpu.py falls back to torch)"
#endif

namespace lq {

// ggml type ids (gguf.GGMLQuantizationType).
enum QType : int {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30, MXFP4 = 39,
};

struct Group {
  __m256i u;     // 32 unsigned quants in value order
  float s[2];    // scale of values 0..15 and 16..31
  float m[2];    // min term of each half (0 for formats without one)
};

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 16 nibble bytes -> 32 values: low nibbles (values 0..15), then high nibbles (16..31).
inline __m256i nibbles16(const uint8_t* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256i v = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

// 32 bytes, one nibble side (0 low, 1 high) -> 32 values.
inline __m256i nibbles32(const uint8_t* p, int side) {
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (side) b = _mm256_srli_epi16(b, 4);
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

// Bit e of a little-endian uint32 -> byte e: 0xFF if set, else 0.
inline __m256i bits_to_bytes(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_movm_epi8(x);
#else
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
#endif
}

// Bit j of each of 32 bytes -> 0 / `value` per byte.
inline __m256i bit_plane(const uint8_t* p, int j, int value) {
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
  __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(static_cast<char>(value)));
}

// Two-bit field k (bits 2k..2k+1) of each of 32 bytes.
inline __m256i two_bits(const uint8_t* p, int k) {
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(_mm256_srl_epi16(b, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
}

// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (q: its 12 scale bytes);
// equals quantize.decode.unpack_k_scales.
inline void k_scale_min(const uint8_t* q, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Scale s of Q3_K sub-block s (q: its 12 scale bytes), minus 32; equals unpack_q3_scales.
inline int q3_scale(const uint8_t* q, int s) {
  int low = s < 8 ? (q[s] & 0xF) : (q[s - 8] >> 4);
  int high = (q[8 + s % 4] >> (2 * (s / 4))) & 3;
  return (low | (high << 4)) - 32;
}

// Q4_K/Q5_K: s = d * sc and m = -(dmin * mn) of sub-block j, in decode_q4_k's order.
inline void k_group_scales(const uint8_t* b, int j, Group& g) {
  int sc, mn;
  k_scale_min(b + 4, j, sc, mn);
  g.s[0] = g.s[1] = f16(b) * static_cast<float>(sc);
  g.m[0] = g.m[1] = -(f16(b + 2) * static_cast<float>(mn));
}

template <int QT> struct Fmt;  // block: values per block; bytes: bytes per block; offset o; has_min

template <> struct Fmt<Q8_0> {
  static constexpr int block = 32, bytes = 34, o = 128;
  static constexpr bool has_min = false;
  static void group(const uint8_t* b, int, Group& g) {
    __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    g.u = _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));  // int8 q -> q + 128
    g.s[0] = g.s[1] = f16(b);
  }
};

template <> struct Fmt<Q4_0> {
  static constexpr int block = 32, bytes = 18, o = 8;
  static constexpr bool has_min = false;
  static void group(const uint8_t* b, int, Group& g) {
    g.u = nibbles16(b + 2);
    g.s[0] = g.s[1] = f16(b);
  }
};

template <> struct Fmt<Q4_1> {
  static constexpr int block = 32, bytes = 20, o = 0;
  static constexpr bool has_min = true;
  static void group(const uint8_t* b, int, Group& g) {
    g.u = nibbles16(b + 4);
    g.s[0] = g.s[1] = f16(b);
    g.m[0] = g.m[1] = f16(b + 2);
  }
};

template <> struct Fmt<Q5_0> {
  static constexpr int block = 32, bytes = 22, o = 16;
  static constexpr bool has_min = false;
  static void group(const uint8_t* b, int, Group& g) {
    __m256i high = _mm256_and_si256(bits_to_bytes(b + 2), _mm256_set1_epi8(0x10));
    g.u = _mm256_or_si256(nibbles16(b + 6), high);
    g.s[0] = g.s[1] = f16(b);
  }
};

template <> struct Fmt<Q5_1> {
  static constexpr int block = 32, bytes = 24, o = 0;
  static constexpr bool has_min = true;
  static void group(const uint8_t* b, int, Group& g) {
    __m256i high = _mm256_and_si256(bits_to_bytes(b + 4), _mm256_set1_epi8(0x10));
    g.u = _mm256_or_si256(nibbles16(b + 8), high);
    g.s[0] = g.s[1] = f16(b);
    g.m[0] = g.m[1] = f16(b + 2);
  }
};

// MXFP4: byte 0 e, bytes 1..16 nibble codes (quantize/formats/mx_types.py). The codes' values (E2M1
// doubled: 0 1 2 3 4 6 8 12 and negatives) plus 12 are looked up as bytes, so u - 12 is the value;
// s = 2^(e - 128) built from its bits as ggml_e8m0_to_fp32_half. s * (u - 12) is then the decoder's
// one product d * value, bit for bit.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}

template <> struct Fmt<MXFP4> {
  static constexpr int block = 32, bytes = 17, o = 12;
  static constexpr bool has_min = false;
  static void group(const uint8_t* b, int, Group& g) {
    const __m256i values = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                            12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    g.u = _mm256_shuffle_epi8(values, nibbles16(b + 1));
    g.s[0] = g.s[1] = e8m0_half(b[0]);
  }
};

// IQ4_NL / IQ4_XS: nibble codes into ggml's kvalues_iq4nl (-127 .. 113; quantize/formats/iq_types.py),
// looked up as the bytes u = value + 127 (0 .. 240), so u - 127 is the value; s = d (IQ4_NL) or
// d * (scale - 32) (IQ4_XS, as the decoder's dl): s * (u - 127) is the decoder's product, bit for bit.
inline __m256i iq4_codes(const uint8_t* p) {
  const __m256i values = _mm256_setr_epi8(0, 23, 44, 62, 78, 92, 105, 117, (char)128, (char)140, (char)152, (char)165,
                                          (char)180, (char)196, (char)216, (char)240,
                                          0, 23, 44, 62, 78, 92, 105, 117, (char)128, (char)140, (char)152, (char)165,
                                          (char)180, (char)196, (char)216, (char)240);
  return _mm256_shuffle_epi8(values, nibbles16(p));
}

template <> struct Fmt<IQ4_NL> {
  static constexpr int block = 32, bytes = 18, o = 127;
  static constexpr bool has_min = false;
  static void group(const uint8_t* b, int, Group& g) {
    g.u = iq4_codes(b + 2);
    g.s[0] = g.s[1] = f16(b);
  }
};

// IQ4_XS: 256 values, group j = 0..7: bytes 0..1 d, 2..3 scales_h (2 bits per group), 4..7 scales_l
// (a nibble per group), then 16 code bytes per group.
template <> struct Fmt<IQ4_XS> {
  static constexpr int block = 256, bytes = 136, o = 127;
  static constexpr bool has_min = false;
  static void group(const uint8_t* b, int j, Group& g) {
    g.u = iq4_codes(b + 8 + 16 * j);
    const int high = ((b[2] | (b[3] << 8)) >> (2 * j)) & 3;
    const int low = (b[4 + j / 2] >> (4 * (j % 2))) & 0xF;
    g.s[0] = g.s[1] = f16(b) * static_cast<float>((low | (high << 4)) - 32);
  }
};

// K-quants: 256 values per block, group j = 0..7 of the block.
template <> struct Fmt<Q2_K> {
  static constexpr int block = 256, bytes = 84, o = 0;
  static constexpr bool has_min = true;
  static void group(const uint8_t* b, int j, Group& g) {
    g.u = two_bits(b + 16 + 32 * (j / 4), j % 4);
    float d = f16(b + 80), dmin = f16(b + 82);
    for (int h = 0; h < 2; h++) {
      int sc = b[2 * j + h];
      g.s[h] = d * static_cast<float>(sc & 0xF);
      g.m[h] = -(dmin * static_cast<float>(sc >> 4));
    }
  }
};

template <> struct Fmt<Q3_K> {
  static constexpr int block = 256, bytes = 110, o = 4;
  static constexpr bool has_min = false;
  static void group(const uint8_t* b, int j, Group& g) {
    // u = low 2 bits | hmask bit << 2, so u - 4 = low - 4 * (1 - hbit), decode_q3_k's q.
    g.u = _mm256_or_si256(two_bits(b + 32 + 32 * (j / 4), j % 4), bit_plane(b, j, 4));
    float d = f16(b + 108);
    for (int h = 0; h < 2; h++) g.s[h] = d * static_cast<float>(q3_scale(b + 96, 2 * j + h));
  }
};

template <> struct Fmt<Q4_K> {
  static constexpr int block = 256, bytes = 144, o = 0;
  static constexpr bool has_min = true;
  static void group(const uint8_t* b, int j, Group& g) {
    g.u = nibbles32(b + 16 + 32 * (j / 2), j % 2);
    k_group_scales(b, j, g);
  }
};

template <> struct Fmt<Q5_K> {
  static constexpr int block = 256, bytes = 176, o = 0;
  static constexpr bool has_min = true;
  static void group(const uint8_t* b, int j, Group& g) {
    g.u = _mm256_or_si256(nibbles32(b + 48 + 32 * (j / 2), j % 2), bit_plane(b + 16, j, 16));
    k_group_scales(b, j, g);
  }
};

template <> struct Fmt<Q6_K> {
  static constexpr int block = 256, bytes = 210, o = 32;
  static constexpr bool has_min = false;
  static void group(const uint8_t* b, int j, Group& g) {
    // values 128h + 32k + l: ql nibble side k / 2 of bytes 64h + 32 (k % 2) + l, qh bits 2k of 128 + 32h + l.
    int h = j / 4, k = j % 4;
    __m256i low = nibbles32(b + 64 * h + 32 * (k % 2), k / 2);
    __m256i high = _mm256_slli_epi16(two_bits(b + 128 + 32 * h, k), 4);
    g.u = _mm256_or_si256(low, high);
    float d = f16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int half = 0; half < 2; half++) g.s[half] = d * static_cast<float>(sc[2 * j + half]);
  }
};

// Decode group g (0-based, 32 values each) of a row of blocks.
template <int QT>
inline void row_group(const uint8_t* row, int g, Group& out) {
  using F = Fmt<QT>;
  constexpr int per_block = F::block / 32;
  Fmt<QT>::group(row + (g / per_block) * F::bytes, g % per_block, out);
}

// acc + pairwise products of int16 lanes summed into int32 lanes (exact: |u| < 256, |x| < 32768).
inline __m256i madd16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Activations quantized per group of 32 to int16: x ~= d * q, q in [-32767, 32767], d = max|x| / 32767.
// (llama.cpp rounds to int8; int16 makes the rounding ~250x smaller, so greedy output stays that of
// the fp32 reference: docs/PERFORMANCE.md.) For T rows of K values (G = K / 32 groups): q (T, K),
// d (T, G), sums (T, G, 2) int32 sum(q) of values 0..15 and 16..31 (the integer offset term -o *
// sum), half_sums (T, G, 2) d * sums (the min terms).
struct QX {
  const int16_t* q;
  const float* d;
  const float* half_sums;
  const int32_t* sums;
  int64_t T, K;
  // Optional (null: unused): q's low bytes (unsigned) and high bytes (signed), (T, K) each, q = 256 hi + lo,
  // for the byte products of 5-bit tiles on AVX2 (cpu_tiles.cpp bytes_dot).
  const uint8_t* lo = nullptr;
  const int8_t* hi = nullptr;
};

// n int16 q -> lo = q & 0xFF (unsigned), hi = q >> 8 (signed): QX's lo, hi.
void split_x(const int16_t* q, int64_t n, uint8_t* lo, int8_t* hi);

// A (N, K) weight: GGUF blocks of `qtype` (row_bytes a row), F32/F16/BF16 rows, or 8-row tiles
// (cpu_tiles.h) when `tiled`.
struct Mat {
  int qtype = 0;
  const uint8_t* w = nullptr;
  int64_t N = 0, K = 0, row_bytes = 0;
  bool tiled = false;
};

bool is_dense(int qtype);
void quantize_x(const float* x, int64_t T, int64_t K, int16_t* q, float* d, float* half_sums, int32_t* sums,
                int threads);
// y[t * ldy + n] = row n of m . row t of x, for n in [n0, n1) (multiples of 8 when tiled, or N);
// dense weights read xf (T, K) fp32, the others qx.
void mat_rows(const Mat& m, int64_t n0, int64_t n1, const QX& qx, const float* xf, float* y, int64_t ldy);
// rows [n0, n1) -> out (n1 - n0, K) fp32: quantize.decode.dequantize_torch's values.
void mat_dequantize(const Mat& m, int64_t n0, int64_t n1, float* out);
// The same over all rows, on `threads` OpenMP threads.
void mat_matmul(const Mat& m, const QX& qx, const float* xf, float* y, int threads);
void mat_dequantize_all(const Mat& m, float* out, int threads);

}  // namespace lq
