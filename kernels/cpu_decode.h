// One whole decode step (every layer, batch 1, one token) in C++: what localllm/model.py's forward
// computes for T = 1, with the linear products of cpu_quant.cpp and one OpenMP region per step, so
// no Python or torch dispatch runs between the ~300 small operations of a token.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu_quant.h"

namespace lq {

// Per layer, named as the GGUF tensors; null vectors are absent (no q/k norm, no bias).
struct LayerW {
  Mat q, k, v, o, gate, up, down;
  const float *attn_norm = nullptr, *ffn_norm = nullptr;
  const float *q_norm = nullptr, *k_norm = nullptr;
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr;
};

struct ModelW {
  int64_t dim = 0, ffn = 0, H = 0, Hkv = 0, D = 0;
  float eps = 0.f;
  Mat embd, out;  // out is embd when the output is tied
  const float* out_norm = nullptr;
  std::vector<LayerW> layers;
};

// The KV cache of model.py's KVCache for batch 1, fp32: k, v (L, 1, Hkv, S, D).
struct Cache {
  float *k = nullptr, *v = nullptr;
  int64_t S = 0;
};

// token at position pos (cache rows [0, pos) already filled) -> logits (V,); writes row pos of the
// cache. cos, sin: the rope row of pos (D/2 each), from model.rope_tables.
void decode_step(const ModelW& m, int64_t token, int64_t pos, const Cache& c, const float* cos, const float* sin,
                 float* logits, int threads);

}  // namespace lq
