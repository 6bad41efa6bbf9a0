// The mixture-of-experts MLP of one decode step (batch 1, one token) for the C++ decoder
// (cpu_decode.cpp): Mixtral, Qwen3-MoE, gpt-oss. Reference: localllm/moe.py (route(), MoE.forward) and
// model.glu: router product (+ bias), routing, the k chosen experts' GLU products on their own rows of
// the stacked (E * F, K) expert tensors, their weighted sum in ascending expert order in fp32.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu_quant.h"

namespace lq {

// moe.route's two gatings (ModelConfig.moe_gating).
enum Gating : int {
  SOFTMAX = 0,       // softmax over all E in fp32, top-k, renormalised when norm_topk (Mixtral, Qwen3-MoE)
  TOPK_SOFTMAX = 1,  // top-k of the logits, softmax over those k (gpt-oss)
};

// The experts' gate function (model.glu).
enum ExpertAct : int { EXPERT_SILU = 0, EXPERT_SWIGLU_OAI = 1 };

// One layer's experts; null biases are absent. E experts, k used, F an expert's hidden width, C = dim.
struct MoEW {
  Mat router;                    // (E, C)
  Mat gate, up, down;            // (E * F, C), (E * F, C), (E * C, F): expert e's rows e * F .. (e + 1) * F
  const float* router_b = nullptr;                                     // (E,)
  const float *gate_b = nullptr, *up_b = nullptr, *down_b = nullptr;  // (E, F), (E, F), (E, C)
  int64_t E = 0, k = 0, F = 0;
  int gating = SOFTMAX;
  bool norm_topk = false;
  int act = EXPERT_SILU;
  float limit = 0.f;  // swiglu_oai's clamp (gate above, up both sides); <= 0: none
};

// Buffers of one step (sized for the widest MoE layer of a model).
struct MoEScratch {
  std::vector<float> logits, weights, gate, up, out, xd, xhs;
  std::vector<int64_t> experts;
  std::vector<int64_t> chosen;  // (layers, k): each layer's experts of the last step, ascending (tests)
  std::vector<int16_t> xq;
  std::vector<int32_t> xl;
};

// The calling thread's scratch for these layers (nullptr when no layer has experts). Call it outside
// the parallel region and hand the result to every thread.
MoEScratch* moe_scratch(const std::vector<const MoEW*>& layers, int64_t C);

// Inside an OpenMP parallel region, called by every thread of the team: xn (C) the normed input and qx
// its int16 rounding (cpu_quant.h) -> out (C) the MoE MLP's output (moe.MoE.forward for one token).
// The chosen experts, ascending -> s.chosen row `layer`.
void moe_ffn(const MoEW& w, int64_t layer, const float* xn, const QX& qx, MoEScratch& s, int64_t C, float* out);

}  // namespace lq
