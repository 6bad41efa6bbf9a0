// Repacking GGUF blocks into 8-row tiles, and the products and decoding that read them (cpu_tiles.h).
// Reference: every value equals quantize.decode.dequantize_torch of the original blocks
// (tests/test_cpu_kernels.py decodes tiles back and compares bit for bit).
#include "cpu_tiles.h"

#include <omp.h>

#include <algorithm>
#include <utility>

#include "cpu_quant.h"
#include "cpu_simd.h"

namespace lq {
namespace {

// MXFP4's E2M1 codes -> u = 2 value + 12 (cpu_quant.h Fmt<MXFP4>'s table)
alignas(16) constexpr uint8_t MXFP4_U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
// IQ4_NL / IQ4_XS codes -> u = kvalues_iq4nl + 127 (cpu_quant.h iq4_codes' table)
alignas(16) constexpr uint8_t IQ4_U[16] = {0, 23, 44, 62, 78, 92, 105, 117, 128, 140, 152, 165, 180, 196, 216, 240};

// The 16 code bytes of group g (32 values: low nibbles 0..15, high 16..31) of an IQ4 row.
template <int QT>
inline const uint8_t* iq4_group_codes(const uint8_t* row, int64_t g) {
  if constexpr (QT == IQ4_NL) return row + 18 * g + 2;
  return row + 136 * (g / 8) + 8 + 16 * (g % 8);
}

// v[i] |= the 5th bits of vector i (bit 4 of each byte), from the group's plane.
template <class V, int... i>
inline void or_plane(typename V::I v[8], typename V::I plane, std::integer_sequence<int, i...>) {
  ((v[i] = V::bor(v[i], V::template plane_bit<i>(plane))), ...);
}

// v[4p + j] |= the top 2 bits of vector 4p + j (bits 4, 5 of each byte), from the group's 2-bit planes.
template <class V, int... j>
inline void or_plane2(typename V::I v[8], typename V::I p0, typename V::I p1, std::integer_sequence<int, j...>) {
  ((v[j] = V::bor(v[j], V::template plane2<j>(p0))), ...);
  ((v[4 + j] = V::bor(v[4 + j], V::template plane2<j>(p1))), ...);
}

// The 8 quant vectors of a tile-group (vector i: rows 0..7 x values 4i..4i+3, unsigned); with Z,
// of the tile-groups at a and b side by side.
template <class V, TileKind k>
inline void unpack(const uint8_t* a, const uint8_t* b, typename V::I v[8]) {
  constexpr int BITS = k.bits;
  if constexpr (BITS == 8) {
    for (int i = 0; i < 8; i++) v[i] = V::load(a + 32 * i, b + 32 * i);
  } else {
    const auto low = V::set8(0x0F);
    for (int i = 0; i < 4; i++) {
      const auto q = V::load(a + 32 * i, b + 32 * i);
      v[i] = V::band(q, low);
      v[i + 4] = V::band(V::shr4(q), low);
    }
    if constexpr (BITS == 5) {  // one load of the 5th-bit plane, a shift and mask a vector
      or_plane<V>(v, V::load(a + 128, b + 128), std::make_integer_sequence<int, 8>{});
    }
    if constexpr (BITS == 6) {  // two loads of the 2-bit planes, a shift and mask a vector
      or_plane2<V>(v, V::load(a + 128, b + 128), V::load(a + 160, b + 160), std::make_integer_sequence<int, 4>{});
    }
    if constexpr (k.lut) {
      for (int i = 0; i < 8; i++) v[i] = V::lookup16(k.table == 1 ? IQ4_U : MXFP4_U, v[i]);
    }
  }
}

// The fp32 scales of rows 0..7 (with Z, of both tiles) of values 0..15 (H = 0; all 32 where one
// scale serves both) or 16..31 (H = 1), from the scale bytes at a (and b).
template <class V, TileKind k, int H = 0>
inline typename V::F load_scales(const uint8_t* a, const uint8_t* b) {
  if constexpr (k.e8m0) return V::e8m0_half(a, b);
  if constexpr (k.i8s) {  // d * sc: exact in fp32, the bits of Fmt<Q6_K>'s d * float(sc)
    return V::mul(V::template scales<false>(a + 16, b + 16), V::i8_floats(a + 8 * H, b + 8 * H));
  }
  constexpr int off = H * k.scale_bytes() / 2;
  return V::template scales<k.s32>(a + off, b + off);
}

template <bool S32>
inline void store_scales(uint8_t* p, const float v[8]) {
  for (int r = 0; r < 8; r++) {
    if constexpr (S32) {
      std::memcpy(p + 4 * r, &v[r], 4);
    } else {
      const uint16_t h = _cvtss_sh(v[r], 0);  // exact: the value came from an fp16 field
      std::memcpy(p + 2 * r, &h, 2);
    }
  }
}

template <int QT>
void repack_tile(const uint8_t* raw, int64_t N, int64_t row_bytes, int64_t K, int64_t tile, uint8_t* tiles) {
  constexpr TileKind k = tile_kind(QT);
  const int64_t G = K / 32;
  alignas(32) uint8_t u[8][32];
  uint8_t vec[8][32];
  static_assert(!k.i8s || QT == Q6_K, "int8 scales: Q6_K's block layout");
  for (int64_t g = 0; g < G; g++) {
    uint8_t* dst = tiles + (tile * G + g) * k.group_bytes();
    float s[2][8] = {}, m[8] = {};
    uint8_t e[8] = {};  // E8M0 scales (k.e8m0)
    uint8_t sc8[2][8] = {}, d16[8][2] = {};  // k.i8s: Q6_K's int8 scales of both halves, fp16 d
    for (int r = 0; r < 8; r++) {
      const int64_t n = tile * 8 + r;
      if (n >= N) {
        std::memset(u[r], 0, 32);
        continue;
      }
      if constexpr (k.lut && !k.e8m0) {  // IQ4: the codes as stored, the scale as Fmt<QT> computes it
        Group gr;
        row_group<QT>(raw + n * row_bytes, static_cast<int>(g), gr);
        s[0][r] = s[1][r] = gr.s[0];
        const uint8_t* c = iq4_group_codes<QT>(raw + n * row_bytes, g);
        for (int j = 0; j < 16; j++) u[r][j] = c[j] & 0xF, u[r][j + 16] = c[j] >> 4;
        continue;
      }
      if constexpr (k.lut) {  // MXFP4: byte 0 e, bytes 1..16 codes (value j low nibble, j + 16 high)
        const uint8_t* b = raw + n * row_bytes + 17 * g;
        e[r] = b[0];
        for (int j = 0; j < 16; j++) u[r][j] = b[1 + j] & 0xF, u[r][j + 16] = b[1 + j] >> 4;
        continue;
      }
      Group gr;
      gr.m[0] = gr.m[1] = 0.f;
      row_group<QT>(raw + n * row_bytes, static_cast<int>(g), gr);
      _mm256_store_si256(reinterpret_cast<__m256i*>(u[r]), gr.u);
      s[0][r] = gr.s[0], s[1][r] = gr.s[1], m[r] = gr.m[0];
      if constexpr (k.i8s) {  // Q6_K block: scales at 192 (2 a group), fp16 d at 208
        const uint8_t* blk = raw + n * row_bytes + (g / 8) * 210;
        sc8[0][r] = blk[192 + 2 * (g % 8)], sc8[1][r] = blk[193 + 2 * (g % 8)];
        std::memcpy(d16[r], blk + 208, 2);
      }
    }
    for (int i = 0; i < 8; i++)
      for (int r = 0; r < 8; r++)
        for (int j = 0; j < 4; j++) vec[i][4 * r + j] = u[r][4 * i + j];
    if constexpr (k.bits == 8) {
      std::memcpy(dst, vec, 256);
    } else {
      for (int p = 0; p < 4; p++)
        for (int b = 0; b < 32; b++) dst[32 * p + b] = (vec[p][b] & 0xF) | ((vec[p + 4][b] & 0xF) << 4);
      if constexpr (k.bits == 5) {  // the 5th-bit plane: bit i of byte b = bit 4 of vector i's byte b
        for (int b = 0; b < 32; b++) {
          uint8_t plane = 0;
          for (int i = 0; i < 8; i++) plane |= static_cast<uint8_t>(((vec[i][b] >> 4) & 1) << i);
          dst[128 + b] = plane;
        }
      }
      if constexpr (k.bits == 6) {  // 2-bit planes: bits 2j, 2j+1 of plane p's byte b = bits 4, 5 of vector 4p + j
        for (int p = 0; p < 2; p++)
          for (int b = 0; b < 32; b++) {
            uint8_t plane = 0;
            for (int j = 0; j < 4; j++) plane |= static_cast<uint8_t>(((vec[4 * p + j][b] >> 4) & 3) << (2 * j));
            dst[128 + 32 * p + b] = plane;
          }
      }
    }
    uint8_t* sp = dst + k.quant_bytes();
    if constexpr (k.e8m0) {
      std::memcpy(sp, e, 8);
      continue;
    }
    if constexpr (k.i8s) {
      std::memcpy(sp, sc8, 16);
      std::memcpy(sp + 16, d16, 16);
      continue;
    }
    store_scales<k.s32>(sp, s[0]);
    if constexpr (k.halves) store_scales<k.s32>(sp + k.scale_bytes() / 2, s[1]);
    if constexpr (k.has_min) store_scales<k.s32>(sp + k.scale_bytes(), m);
  }
}

// One group's integer row sums (values 0..15, 16..31; half[0] alone holds both where one scale serves
// both) into the fp32 accumulator: s * d * sum (a scale a half, or one for both) plus m * d * sum(x) for formats with a min term.
template <class V, TileKind k>
inline typename V::F accumulate(const typename V::I half[2], typename V::F s0, typename V::F s1, typename V::F m,
                                const QX& x, int64_t ti, typename V::F acc) {
  const auto dx = V::fset(x.d[ti]);
  if constexpr (k.halves) {
    acc = V::fmadd(V::to_float(half[0]), V::mul(s0, dx), acc);
    acc = V::fmadd(V::to_float(half[1]), V::mul(s1, dx), acc);
  } else {
    acc = V::fmadd(V::to_float(half[0]), V::mul(s0, dx), acc);  // half[0]: both halves' sum
  }
  if constexpr (k.has_min) acc = V::fmadd(m, V::fset(x.half_sums[2 * ti] + x.half_sums[2 * ti + 1]), acc);
  return acc;
}

// Without VNNI, 5-bit quants (u <= 31) take x as its two bytes (QX lo, hi: q = 256 hi + lo): u8 x s8
// pair products (vpmaddubsw: lo x u, then u x hi) summed in int16 -- 2 vectors of lo products
// (<= 2 * 2 * 255 * 31 = 31620), 4 of hi ones (|.| <= 4 * 2 * 31 * 128 = 31744), so never past 2^15 --
// then into int32 rows: no widening of the quants; the same exact integers as tile_dot's int16 products.
// Measured ~12% faster than widening for Q5_0 on the AVX2 EPYC (4-bit and Q6_K tiles: none; they keep it).
template <class V, int NV>
inline typename V::I bytes_dot(const typename V::I* v, const uint8_t* lo, const int8_t* hi) {
  auto acc = V::zero();
  for (int i0 = 0; i0 < NV; i0 += 2) {
    auto s = V::zero();
    for (int i = i0; i < i0 + 2; i++) {
      int32_t b;
      std::memcpy(&b, lo + 4 * i, 4);  // values 4i..4i+3 of x: byte j of each row's 4 meets value j
      s = V::add16(s, V::maddubs(V::set32(b), v[i]));
    }
    acc = V::add(acc, V::pairs16(s, 1));
  }
  for (int i0 = 0; i0 < NV; i0 += 4) {
    auto s = V::zero();
    for (int i = i0; i < i0 + 4; i++) {
      int32_t b;
      std::memcpy(&b, hi + 4 * i, 4);
      s = V::add16(s, V::maddubs(v[i], V::set32(b)));
    }
    acc = V::add(acc, V::pairs16(s, 256));
  }
  return acc;  // int32 lane r: row r
}

// Bytes ahead of the group being read that tile_dot prefetches, as cpu_quant.cpp DENSE_PREFETCH.
constexpr int64_t TILE_PREFETCH = 1024;

// acc[t] (lane r = row r of the tile, or of the pair with Z) for NT rows of x from t0, over every group.
// Vector i holds 4 values of each row; widened to int16, its low and high 8 bytes of each 128-bit
// lane (rows 0,1 / 4,5 and 2,3 / 6,7) multiply x's 4 values (broadcast as 64 bits) in 2 lanes a row.
// BYTES: bytes_dot (x.lo, x.hi given; 5-bit kinds only).
template <class V, int QT, int NT, bool BYTES = false>
inline void tile_dot(const uint8_t* ta, const uint8_t* tb, const QX& x, int64_t t0, typename V::F acc[NT]) {
  constexpr TileKind k = tile_kind(QT);
  constexpr int sb = k.scale_bytes();
  const int64_t G = x.K / 32;
  for (int t = 0; t < NT; t++) acc[t] = V::fzero();
  typename V::I v[8];
  for (int64_t g = 0; g < G; g++) {
    const uint8_t *pa = ta + g * k.group_bytes(), *pb = tb + g * k.group_bytes();
    for (int b = 0; b < k.group_bytes(); b += 64) {  // the tiles are one stream: run ahead of it
      _mm_prefetch(reinterpret_cast<const char*>(pa + TILE_PREFETCH + b), _MM_HINT_T0);
      if (pb != pa) _mm_prefetch(reinterpret_cast<const char*>(pb + TILE_PREFETCH + b), _MM_HINT_T0);
    }
    unpack<V, k>(pa, pb, v);
    typename V::I wl[8], wh[8];  // widened once, for every row of x
    if constexpr (!BYTES)
      for (int i = 0; i < 8; i++) wl[i] = V::widen_lo(v[i]), wh[i] = V::widen_hi(v[i]);
    const uint8_t *sa = pa + k.quant_bytes(), *sbp = pb + k.quant_bytes();
    const auto s0 = load_scales<V, k>(sa, sbp);
    auto s1 = s0, m = V::fzero();
    if constexpr (k.halves) s1 = load_scales<V, k, 1>(sa, sbp);
    if constexpr (k.has_min) m = V::template scales<k.s32>(sa + sb, sbp + sb);
    for (int t = 0; t < NT; t++) {
      const int64_t ti = (t0 + t) * G + g;
      const int16_t* xq = x.q + (t0 + t) * x.K + 32 * g;
      // values 0..15, then 16..31 (one scale for both: their sum at once, the same integers)
      constexpr int H = k.halves ? 2 : 1;
      typename V::I half[2] = {V::zero(), V::zero()};
      for (int h = 0; h < H; h++) {
        const int32_t xs = H == 2 ? x.sums[2 * ti + h] : x.sums[2 * ti] + x.sums[2 * ti + 1];
        if constexpr (BYTES) {
          static_assert(k.bits == 5 && !k.halves, "bytes_dot's int16 bounds hold for 5-bit quants, 8 vectors");
          const int64_t at = (t0 + t) * x.K + 32 * g;
          half[h] = bytes_dot<V, 8>(v, x.lo + at, x.hi + at);
          if constexpr (k.o != 0) half[h] = V::add(half[h], V::set32(-k.o * xs));
          continue;
        }
        auto lo = V::zero(), hi = V::zero();
        for (int i = 8 / H * h; i < 8 / H * (h + 1); i++) {
          int64_t four;
          std::memcpy(&four, xq + 4 * i, 8);
          const auto xb = V::set64(four);
          lo = V::madd(lo, wl[i], xb);
          hi = V::madd(hi, wh[i], xb);
        }
        half[h] = V::pair_sums(lo, hi);
        if constexpr (k.o != 0) half[h] = V::add(half[h], V::set32(-k.o * xs));
      }
      acc[t] = accumulate<V, k>(half, s0, s1, m, x, ti, acc[t]);
    }
  }
}

// Rows of tiles a (and a + 1 with Z) for every row of x; `rows` of the V::rows lanes are stored.
template <class V, int QT, bool BYTES = false>
void matmul_lanes(const uint8_t* ta, const uint8_t* tb, int64_t rows, const QX& x, float* y, int64_t ldy) {
  alignas(64) float out[16];
  auto emit = [&](typename V::F acc, int64_t t) {
    V::store(out, acc);
    std::copy(out, out + rows, y + t * ldy);
  };
  int64_t t = 0;
  for (; t + V::nt <= x.T; t += V::nt) {  // the unpacked weights serve nt rows of x
    typename V::F acc[V::nt];
    tile_dot<V, QT, V::nt, BYTES>(ta, tb, x, t, acc);
    for (int j = 0; j < V::nt; j++) emit(acc[j], t + j);
  }
  for (; t < x.T; t++) {
    typename V::F acc[1];
    tile_dot<V, QT, 1, BYTES>(ta, tb, x, t, acc);
    emit(acc[0], t);
  }
}

template <int QT>
void matmul_tiles(const uint8_t* tiles, int64_t N, int64_t K, int64_t tile0, int64_t tile1, const QX& x, float* y,
                  int64_t ldy) {
  const int64_t tile_bytes = (K / 32) * tile_kind(QT).group_bytes();
  int64_t tile = tile0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  // Pairs for several rows of x (prompts); one row (decode) measured faster 8 rows at a time.
  for (; x.T > 1 && tile + 2 <= tile1; tile += 2) {
    const uint8_t* ta = tiles + tile * tile_bytes;
    matmul_lanes<Z, QT>(ta, ta + tile_bytes, std::min<int64_t>(16, N - 8 * tile), x, y + 8 * tile, ldy);
  }
#endif
#if !defined(__AVX512VNNI__)
  if constexpr (tile_kind(QT).bits == 5 && !tile_kind(QT).halves) {
    if (x.lo && x.hi) {
      for (; tile < tile1; tile++) {
        const uint8_t* ta = tiles + tile * tile_bytes;
        matmul_lanes<Y, QT, true>(ta, ta, std::min<int64_t>(8, N - 8 * tile), x, y + 8 * tile, ldy);
      }
      return;
    }
  }
#endif
  for (; tile < tile1; tile++) {
    const uint8_t* ta = tiles + tile * tile_bytes;
    matmul_lanes<Y, QT>(ta, ta, std::min<int64_t>(8, N - 8 * tile), x, y + 8 * tile, ldy);
  }
}

template <int QT>
void dequantize_tiles(const uint8_t* tiles, int64_t K, int64_t n0, int64_t n1, float* out) {
  constexpr TileKind k = tile_kind(QT);
  const int64_t G = K / 32;
  alignas(32) uint8_t u[8][32], row[32];
  alignas(32) float s[2][8], m[8];
  __m256i v[8];
  for (int64_t tile = n0 / 8; tile * 8 < n1; tile++) {
    for (int64_t g = 0; g < G; g++) {
      const uint8_t* p = tiles + (tile * G + g) * k.group_bytes();
      unpack<Y, k>(p, p, v);
      for (int i = 0; i < 8; i++) _mm256_store_si256(reinterpret_cast<__m256i*>(u[i]), v[i]);
      const uint8_t* sp = p + k.quant_bytes();
      _mm256_store_ps(s[0], load_scales<Y, k>(sp, sp));
      if constexpr (k.halves) {
        _mm256_store_ps(s[1], load_scales<Y, k, 1>(sp, sp));
      } else {
        std::copy(s[0], s[0] + 8, s[1]);
      }
      if constexpr (k.has_min) _mm256_store_ps(m, Y::scales<k.s32>(sp + k.scale_bytes(), sp));
      for (int r = 0; r < 8; r++) {
        const int64_t n = tile * 8 + r;
        if (n < n0 || n >= n1) continue;
        for (int i = 0; i < 8; i++) std::memcpy(row + 4 * i, &u[i][4 * r], 4);  // row r's values in order
        float* o = out + (n - n0) * K + 32 * g;
        for (int c = 0; c < 4; c++) {  // 8 values at a time; c < 2: the first half's scale
          const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * c));
          const __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(b8), _mm256_set1_epi32(k.o));
          // s * (u - o), then + m: two roundings, as the reference (an fma would round once)
          __m256 w = _mm256_mul_ps(_mm256_set1_ps(s[c / 2][r]), _mm256_cvtepi32_ps(q));
          if constexpr (k.has_min) w = _mm256_add_ps(w, _mm256_set1_ps(m[r]));  // no "+ 0": keeps -0.0
          _mm256_storeu_ps(o + 8 * c, w);
        }
      }
    }
  }
}

}  // namespace

#define LQ_TILED(F, ...)                          \
  switch (qtype) {                                \
    case Q8_0: return F<Q8_0>(__VA_ARGS__);       \
    case Q4_0: return F<Q4_0>(__VA_ARGS__);       \
    case Q4_1: return F<Q4_1>(__VA_ARGS__);       \
    case Q5_0: return F<Q5_0>(__VA_ARGS__);       \
    case Q5_1: return F<Q5_1>(__VA_ARGS__);       \
    case Q4_K: return F<Q4_K>(__VA_ARGS__);       \
    case Q5_K: return F<Q5_K>(__VA_ARGS__);       \
    case Q6_K: return F<Q6_K>(__VA_ARGS__);       \
    case MXFP4: return F<MXFP4>(__VA_ARGS__);     \
    case IQ4_NL: return F<IQ4_NL>(__VA_ARGS__);   \
    case IQ4_XS: return F<IQ4_XS>(__VA_ARGS__);   \
    default: return;                              \
  }

void repack(int qtype, const uint8_t* raw, int64_t N, int64_t row_bytes, int64_t K, uint8_t* tiles, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t tile = 0; tile < (N + 7) / 8; tile++) {
    [&]() { LQ_TILED(repack_tile, raw, N, row_bytes, K, tile, tiles) }();
  }
}

void tile_matmul(int qtype, const uint8_t* tiles, int64_t N, int64_t K, int64_t tile0, int64_t tile1, const QX& x,
                 float* y, int64_t ldy) {
  LQ_TILED(matmul_tiles, tiles, N, K, tile0, tile1, x, y, ldy)
}

void tile_dequantize(int qtype, const uint8_t* tiles, int64_t K, int64_t n0, int64_t n1, float* out) {
  LQ_TILED(dequantize_tiles, tiles, K, n0, n1, out)
}

}  // namespace lq
