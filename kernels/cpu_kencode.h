// K-quant encoders (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) in C++: the same candidates, in the same float
// arithmetic, as quantize/kquants.py + quantize/ksearch.py (llama.cpp's ggml-quants.c searches, then
// our refits, then the candidate of least error), so the bytes are equal bit for bit
// (tests/test_kencode.py). One block of 256 values at a time, in locals; blocks in parallel.
#pragma once

#include <cstdint>

namespace lq {

// Whether kquant_encode takes ggml type `qtype`.
bool kquant_encodes(int qtype);

// x (rows, cols) fp32, or IEEE fp16 where `half` (widened exactly), cols % 256 == 0 -> out (rows,
// cols / 256 * block bytes) GGUF blocks. qw: nullptr (no importance), or the importance of each value's
// column with row stride qw_stride (0: one row of cols for all rows). Returns false where x holds a NaN
// or Inf (its blocks not written).
bool kquant_encode(int qtype, const void* x, bool half, int64_t rows, int64_t cols, const float* qw,
                   int64_t qw_stride, uint8_t* out, int threads);

}  // namespace lq
