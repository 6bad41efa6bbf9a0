// Prompt products of dense weights (F32 / F16 / BF16 rows): y (T, N) = x (T, K) fp32 @ w.T in fp32,
// a register-blocked GEMM whose packing decodes the weight's rows to fp32 a cache-sized panel at a
// time (cpu_gemm.cpp), instead of decoding the whole matrix for torch's GEMM.
#pragma once

#include <cstdint>

namespace lq {

// w: N rows of K values of ggml type qtype (0 F32, 1 F16, 30 BF16), end to end; x (T, K) fp32 row-major;
// y (T, N) fp32 row-major, overwritten. K % 8 == 0.
void dense_gemm(int qtype, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t T, float* y, int threads);

}  // namespace lq
