// 8-row tiles: the layout the CPU repacks most GGUF formats into at load (kernels/cpu.py), so a few
// integer dot-product instructions serve 8 weight rows at once, with one horizontal step a group:
//
// A (N, K) weight becomes ceil(N / 8) tiles x K / 32 groups, each tile-group (8 rows x 32 values)
// stored contiguously, tile-major:
//   quants  vector i (i = 0..7) holds, for rows r = 0..7, the 4 values 4i..4i+3 of row r (32 bytes),
//           stored as  8 bits: the 8 vectors (256 bytes);
//                      4 bits: 4 x 32 bytes, byte b of block p = vector p (low nibble), p + 4 (high);
//                      5 bits: as 4 bits, then a 32-byte plane of 5th bits (bit i of byte b: byte b of
//                              vector i), so each vector's bit is one shift and mask of one load
//                      6 bits (Q6_K): as 4 bits, then two 32-byte planes of the top 2 bits (bits 2j, 2j+1
//                              of byte b of plane p: bits 4, 5 of byte b of vector 4p + j)
//           4 bits through a table (MXFP4): the file's E2M1 codes, looked up as u at unpack
//   scales  s of rows 0..7 (fp16 where the file stores fp16 scales, else fp32 d * sc; MXFP4: the
//           file's E8M0 bytes, 8 bytes), twice (values 0..15, 16..31) for formats with 16-value sub-blocks;
//           Q6_K: the file's int8 scales (rows 0..7 of values 0..15, then of 16..31: 16 bytes) and the
//           block's fp16 d of rows 0..7 (16 bytes); s = d * sc in fp32 (exact: 11 x 8 bits)
//   mins    m of rows 0..7 (same dtype), for formats with a min term
// so w = s * (u - o) + m exactly as quantize.decode's decoders compute it (cpu_quant.h: Group).
// Rows past N (the last tile) are zero. Sizes: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 equal the file's;
// Q4_K +33%, Q5_K +27% (fp32 scales per 32 values instead of 6-bit ones), Q6_K +6.7% (d once a group). MXFP4
// keeps its size (136 bytes a tile-group = 8 blocks of 17): its 4-bit E2M1 codes, expanded at unpack
// by a 16-byte shuffle table into the integers u = 2 value + 12 (0..24, cpu_quant.h Fmt<MXFP4>), and
// its E8M0 bytes, turned into the fp32 scale 2^(e - 128) (exact) per group, so its products take the
// tiles' integer kernels with the same integers and scales as Fmt<MXFP4> (bit for bit). IQ4_NL and
// IQ4_XS keep their 4-bit codes the same way, looked up as u = value + 127 (0..240, Fmt<IQ4_NL>), with
// IQ4_NL's fp16 d (its size kept) or IQ4_XS's fp32 d * (scale - 32) per group (+18%).
#pragma once

#include <cstdint>

namespace lq {

struct TileKind {
  int bits;        // 4, 5, 6 or 8 bits a quant
  bool s32;        // fp32 scales (else fp16)
  bool has_min;
  bool halves;     // a scale per 16 values
  int o;           // integer offset: w = s * (u - o) + m
  bool lut = false;   // 4-bit codes looked up as u (MXFP4's E2M1 table, or IQ4's kvalues: `table`)
  bool e8m0 = false;  // scales as E8M0 bytes: s = 2^(e - 128)
  int table = 0;      // lut: 0 MXFP4's u = 2 value + 12, 1 IQ4_NL / IQ4_XS's u = value + 127
  bool i8s = false;   // scales as the file's int8 sub-block scales (both halves) + the fp16 d of rows 0..7
  constexpr int quant_bytes() const { return bits == 8 ? 256 : bits == 6 ? 192 : bits == 5 ? 160 : 128; }
  constexpr int scale_bytes() const { return e8m0 ? 8 : i8s ? 32 : 8 * (s32 ? 4 : 2) * (halves ? 2 : 1); }
  constexpr int group_bytes() const { return quant_bytes() + scale_bytes() + (has_min ? 8 * (s32 ? 4 : 2) : 0); }
};

// The kind a ggml type is repacked as; bits == 0: not tiled (kept as GGUF blocks).
constexpr TileKind tile_kind(int qtype) {
  switch (qtype) {
    case 8: return {8, false, false, false, 128};  // Q8_0
    case 2: return {4, false, false, false, 8};    // Q4_0
    case 3: return {4, false, true, false, 0};     // Q4_1
    case 6: return {5, false, false, false, 16};   // Q5_0
    case 7: return {5, false, true, false, 0};     // Q5_1
    case 12: return {4, true, true, false, 0};     // Q4_K
    case 13: return {5, true, true, false, 0};     // Q5_K
    case 14: return {6, false, false, true, 32, false, false, 0, true};  // Q6_K (int8 sc, fp16 d)
    case 39: return {4, true, false, false, 12, true, true};  // MXFP4 (codes -> integers 0..24)
    case 20: return {4, false, false, false, 127, true, false, 1};  // IQ4_NL (codes -> 0..240, fp16 d)
    case 23: return {4, true, false, false, 127, true, false, 1};   // IQ4_XS (fp32 d * (scale - 32))
    default: return {0, false, false, false, 0};   // Q2_K, Q3_K, dense: not tiled
  }
}

// raw (N, row_bytes) GGUF blocks -> tiles (ceil(N/8) * K/32 * group_bytes bytes, see above).
void repack(int qtype, const uint8_t* raw, int64_t N, int64_t row_bytes, int64_t K, uint8_t* tiles, int threads);

struct QX;
// y[t * ldy + n] for rows n in [8 * t0, 8 * t1) (tiles t0..t1), every row t of x.
void tile_matmul(int qtype, const uint8_t* tiles, int64_t N, int64_t K, int64_t tile0, int64_t tile1, const QX& x,
                 float* y, int64_t ldy);
// rows [n0, n1) -> out (n1 - n0, K) fp32, equal to dequantize_torch of the original blocks.
void tile_dequantize(int qtype, const uint8_t* tiles, int64_t K, int64_t n0, int64_t n1, float* out);

}  // namespace lq
