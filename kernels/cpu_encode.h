// Encoders of the 32-value block formats Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: llama.cpp's reference rules
// (ggml-quants.c quantize_row_*_ref; byte for byte gguf.quants.quantize's) and with an imatrix the
// weighted searches of quantize/simple.py, byte for byte its torch encoders (tests/test_cpu_encode.py).
#pragma once

#include <cstdint>

namespace lq {

// Bytes of one 32-value block of qtype, or 0 where encode_simple does not take the type.
int simple_block_bytes(int qtype);

// x (rows, cols) fp32, or IEEE fp16 where `half` (widened exactly), cols % 32 == 0 -> out (rows,
// cols / 32 * simple_block_bytes) in the GGUF layout (quantize/formats/legacy_types.py); rows spread over
// `threads` threads. imp: the imatrix (row r's at imp + r * imp_stride: stride 0 for one (cols,) vector),
// or null for the reference rule: with it, each block is the better of the reference rule and
// quantize/simple.py's weighted search. Returns false where x holds a NaN or Inf (its rows not written).
bool encode_simple(int qtype, const void* x, bool half, int64_t rows, int64_t cols, const float* imp,
                   int64_t imp_stride, uint8_t* out, int threads);

}  // namespace lq
