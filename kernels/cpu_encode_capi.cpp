// A C interface to the encoders of cpu_encode.cpp and cpu_kencode.cpp, for a shared library without
// torch (kernels/cpu_encode_lib.py loads it with ctypes: `localllm quantize`'s torch-free preset path).
// The same functions as cpu_bind.cpp's encode_simple / kquant_encode, on raw pointers: the same bytes.
#include <cstdint>

#include "cpu_encode.h"
#include "cpu_kencode.h"

extern "C" {

// Bytes of one 32-value block of qtype, or 0 where lq_encode_simple does not take it.
int lq_simple_block_bytes(int qtype) { return lq::simple_block_bytes(qtype); }

// Whether lq_kquant_encode takes ggml type qtype.
int lq_kquant_encodes(int qtype) { return lq::kquant_encodes(qtype) ? 1 : 0; }

// x (rows, cols) fp32, or fp16 where half != 0 -> out (rows, cols / 32 * block bytes). 1, or 0 where x
// holds a NaN or Inf. imp: null, or the importance with row stride imp_stride (0: one row for all).
int lq_encode_simple(int qtype, const void* x, int half, int64_t rows, int64_t cols, const float* imp,
                     int64_t imp_stride, uint8_t* out, int threads) {
  return lq::encode_simple(qtype, x, half != 0, rows, cols, imp, imp_stride, out, threads) ? 1 : 0;
}

// x (rows, cols) fp32 / fp16 -> out (rows, cols / 256 * block bytes) K-quant blocks; 1, or 0 on NaN / Inf.
int lq_kquant_encode(int qtype, const void* x, int half, int64_t rows, int64_t cols, const float* qw,
                     int64_t qw_stride, uint8_t* out, int threads) {
  return lq::kquant_encode(qtype, x, half != 0, rows, cols, qw, qw_stride, out, threads) ? 1 : 0;
}
}
