// One whole decode step (every layer, batch 1, one token) in C++: what localllm/model.py's forward
// computes for T = 1, with the linear products of cpu_quant.cpp and one OpenMP region per step, so
// no Python or torch dispatch runs between the ~300 small operations of a token.
// Beyond the Llama layer (issue 19's dense families: Gemma 2/3, Phi-3, SmolLM3) each layer carries its
// own rope set, window and activation, and the model its scales and soft caps; every choice is made
// once per layer or per head, never per element, so a Llama model runs the loops it ran before.
// Gemma 4's dense layer adds per-layer shapes (head dim, kv heads, MLP width, rotated dims), values
// that are the key projection (k_eq_v: no v), KV-shared layers (no k, v: they read an earlier layer's
// cache), a weightless value norm, per-layer embeddings (PLE) and a scalar on each layer's output.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu_moe.h"
#include "cpu_quant.h"

namespace lq {

// The GLU's gate function (ModelConfig.activation).
enum Act : int { SILU = 0, GELU_TANH = 1 };

// Per layer, named as the GGUF tensors; null vectors are absent (no q/k norm, no bias, no post norm).
struct LayerW {
  Mat q, k, v, o, gate, up, down;
  const float *attn_norm = nullptr, *ffn_norm = nullptr;
  const float *q_norm = nullptr, *k_norm = nullptr;
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr;
  const float *post_attn_norm = nullptr, *post_ffn_norm = nullptr;  // Gemma: on sublayer outputs
  const float *bo = nullptr;     // attn_output bias (C,)
  const float *sinks = nullptr;  // one sink logit per query head (H,)
  int rope = 0;                  // which of the step's rope rows rotates q and k; -1: none (NoPE layer)
  int64_t window = 0;            // keys a query sees, itself included (sliding layers); 0: all
  int act = SILU;
  const MoEW* moe = nullptr;  // a mixture of experts in place of gate/up/down (cpu_moe.h)
  // This layer's shape (the model's unless Gemma 4 sets its own): head dim, kv heads, MLP width, rotated
  // dims of a head. k.N == 0: a KV-shared layer (it reads the cache it is handed, writes none);
  // v.N == 0 with k: the values are the key projection before k's norm (Gemma 4 attention_k_eq_v).
  int64_t D = 0, Hkv = 0, F = 0, rot = 0;
  Mat inp_gate, proj;                // Gemma 4 PLE: gate (C -> P), projection (P -> C); N == 0: none
  const float* post_norm = nullptr;  // PLE: norm of the projection's output (C,)
  const float* out_scale = nullptr;  // the layer's output (residual included) times this (1,)
};

struct ModelW {
  int64_t dim = 0, ffn = 0, H = 0, Hkv = 0, D = 0;
  int64_t rot = 0;  // leading dims of a head that rope rotates (partial rotary); the rope rows' stride
  float eps = 0.f;
  float embed_scale = 1.f;     // token embeddings times this
  float attn_scale = 0.f;      // scores times this (the config's attn_scale or 1/sqrt(D))
  float attn_softcap = 0.f;    // scores -> c tanh(scores / c); 0: none
  float final_softcap = 0.f;   // logits -> c tanh(logits / c); 0: none
  Mat embd, out;  // out is embd when the output is tied
  const float* out_norm = nullptr;
  std::vector<LayerW> layers;
  bool v_norm = false;  // values RMS-normalised without a weight before the cache (Gemma 4)
  // Gemma 4 per-layer embeddings (model.py Transformer.per_layer_inputs): P values per layer, from the
  // token's row of ple_embd (L * P) and the projection ple_proj (C -> L * P) of the embedding; P == 0: none
  int64_t P = 0;
  Mat ple_embd, ple_proj;
  const float* ple_norm = nullptr;  // (P,)
};

// The KV cache of model.py's KVCache, fp32: per layer the base of its k, v (n, Hkv, S, D) buffers (a
// KV-shared layer's are its source layer's) and the floats from one slot (batch row) to the next.
struct Cache {
  std::vector<float*> k, v;
  std::vector<int64_t> slot_stride;  // per layer; unread with one slot
  int64_t S = 0;
};

// token at position pos (cache rows [0, pos) already filled) -> logits (V,); writes row pos of the
// cache (slot 0). cos, sin: (n sets, rot/2) rows of pos, one per rope set a layer names (rope.layer_ropes;
// a set of fewer dims than rot fills the first layer.rot/2 of its row).
void decode_step(const ModelW& m, int64_t token, int64_t pos, const Cache& c, const float* cos, const float* sin,
                 float* logits, int threads);

// B rows at once (localllm/slots.py decode_slots): row b is tokens[b] at position pos[b] of cache slot
// slots[b] (distinct slots) -> logits (B, V); cos, sin (B, n sets, rot/2), rope_row floats a row. Each weight is read once for
// all B rows (the products' several-row kernels), and each row is computed exactly as decode_step
// computes it alone: the products round and sum a row the same whatever the other rows (cpu_quant.cpp,
// cpu_tiles.cpp: per-row int16 rounding, per-row accumulators), every other op runs per row.
void decode_rows(const ModelW& m, int64_t B, const int64_t* tokens, const int64_t* pos, const int64_t* slots,
                 const Cache& c, const float* cos, const float* sin, int64_t rope_row, float* logits, int threads);

}  // namespace lq
