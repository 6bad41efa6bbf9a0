// The MoE MLP of cpu_moe.h. Reference: localllm/moe.py (route: the tie order of torch.topk, larger
// value first and equal values by lower index; MoE.forward: expert outputs times their weights summed
// in ascending expert order into zeros) and model.glu (silu; gpt-oss's clamped swiglu_oai, alpha
// 1.702). tests/test_cpu_moe.py checks logits and chosen experts against the torch forward.
#include "cpu_moe.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

namespace lq {
namespace {

constexpr float OAI_ALPHA = 1.702f;  // model.glu's (transformers' GptOssExperts, llama.cpp's swiglu_oai)
constexpr int64_t CHUNK = 16;        // rows a task: a multiple of the 8-row tiles

// Rows [n0, n1) of m . x -> y[n - n0]: one expert's product (n0 a multiple of 8 when tiled: build_decoder).
struct Job {
  const Mat* m;
  int64_t n0, n1;
  QX qx;
  const float* xf;
  float* y;
};

// Every job's rows split into CHUNK-row tasks over the team (inside the parallel region).
void run_jobs(const Job* jobs, int n) {
  int64_t total = 0;
  for (int j = 0; j < n; j++) total += (jobs[j].n1 - jobs[j].n0 + CHUNK - 1) / CHUNK;
#pragma omp for schedule(static)
  for (int64_t c = 0; c < total; c++) {
    int64_t first = c;
    for (int j = 0; j < n; j++) {
      const Job& b = jobs[j];
      const int64_t chunks = (b.n1 - b.n0 + CHUNK - 1) / CHUNK;
      if (first >= chunks) {
        first -= chunks;
        continue;
      }
      const int64_t r0 = b.n0 + first * CHUNK, r1 = std::min(b.n1, r0 + CHUNK);
      mat_rows(*b.m, r0, r1, b.qx, b.xf, b.y - b.n0, b.m->N);  // y indexed by the absolute row
      break;
    }
  }
}

// The k largest of v (E,) in torch.topk's order: larger first, equal values by lower index.
void top_k(const float* v, int64_t E, int64_t k, int64_t* idx) {
  for (int64_t j = 0; j < k; j++) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; e++) {
      if (std::find(idx, idx + j, e) != idx + j) continue;
      if (best < 0 || v[e] > v[best]) best = e;
    }
    idx[j] = best;
  }
}

// Softmax of n values in place (fp32, max subtracted: torch.softmax's form).
void softmax(float* v, int64_t n) {
  float mx = v[0], sum = 0.f;
  for (int64_t i = 1; i < n; i++) mx = std::max(mx, v[i]);
  for (int64_t i = 0; i < n; i++) sum += (v[i] = std::exp(v[i] - mx));
  for (int64_t i = 0; i < n; i++) v[i] /= sum;
}

// moe.route for one token: router logits (E,) -> experts (k,) ascending, their weights (k,).
void route(const MoEW& w, float* logits, int64_t* experts, float* weights) {
  const int64_t E = w.E, k = w.k;
  int64_t top[256];
  float p[256];
  if (w.gating == TOPK_SOFTMAX) {
    top_k(logits, E, k, top);
    for (int64_t j = 0; j < k; j++) p[j] = logits[top[j]];
    softmax(p, k);
  } else {
    softmax(logits, E);
    top_k(logits, E, k, top);
    float sum = 0.f;
    for (int64_t j = 0; j < k; j++) sum += (p[j] = logits[top[j]]);
    if (w.norm_topk) for (int64_t j = 0; j < k; j++) p[j] /= sum;
  }
  // ascending expert order: MoE.forward's loop over torch.unique(experts)
  int64_t order[256];
  for (int64_t j = 0; j < k; j++) order[j] = j;
  std::sort(order, order + k, [&](int64_t a, int64_t b) { return top[a] < top[b]; });
  for (int64_t j = 0; j < k; j++) experts[j] = top[order[j]], weights[j] = p[order[j]];
}

void add_bias(float* y, const float* b, int64_t n) {
  if (b) for (int64_t i = 0; i < n; i++) y[i] += b[i];
}

// model.glu over F values, written over gate.
void glu(const MoEW& w, float* gate, const float* up, int64_t F) {
  if (w.act == EXPERT_SWIGLU_OAI) {
    const float lim = w.limit > 0.f ? w.limit : INFINITY;
    for (int64_t i = 0; i < F; i++) {
      const float g = std::min(gate[i], lim), u = std::clamp(up[i], -lim, lim);
      gate[i] = (u + 1.f) * (g / (1.f + std::exp(-(g * OAI_ALPHA))));
    }
  } else {
    for (int64_t i = 0; i < F; i++) gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  }
}

}  // namespace

MoEScratch* moe_scratch(const std::vector<const MoEW*>& layers, int64_t C) {
  thread_local MoEScratch s;
  int64_t E = 0, kF = 0, kC = 0, k = 0;
  for (const MoEW* w : layers) {
    if (!w) continue;
    E = std::max(E, w->E), k = std::max(k, w->k), kF = std::max(kF, w->k * w->F), kC = std::max(kC, w->k * C);
  }
  if (!E) return nullptr;
  s.logits.resize(E), s.weights.resize(k), s.experts.resize(k);
  s.gate.resize(kF), s.up.resize(kF), s.out.resize(kC);
  s.chosen.resize(layers.size() * k);
  s.xq.resize(kF), s.xd.resize(kF / 32), s.xhs.resize(2 * kF / 32), s.xl.resize(2 * kF / 32);
  return &s;
}

void moe_ffn(const MoEW& w, int64_t layer, const float* xn, const QX& qx, MoEScratch& s, int64_t C, float* out) {
  const int64_t k = w.k, F = w.F, G = F / 32;
  Job jobs[2 * 256];
  jobs[0] = Job{&w.router, 0, w.E, qx, xn, s.logits.data()};
  run_jobs(jobs, 1);
#pragma omp single
  {
    add_bias(s.logits.data(), w.router_b, w.E);
    route(w, s.logits.data(), s.experts.data(), s.weights.data());
    const int64_t kmax = static_cast<int64_t>(s.experts.size());
    std::copy(s.experts.begin(), s.experts.begin() + k, s.chosen.begin() + layer * kmax);
  }
  // every thread builds the same job list from the shared routing (after single's barrier)
  for (int64_t j = 0; j < k; j++) {
    const int64_t e = s.experts[j];
    jobs[2 * j] = Job{&w.gate, e * F, (e + 1) * F, qx, xn, s.gate.data() + j * F};
    jobs[2 * j + 1] = Job{&w.up, e * F, (e + 1) * F, qx, xn, s.up.data() + j * F};
  }
  run_jobs(jobs, static_cast<int>(2 * k));
#pragma omp single
  {
    for (int64_t j = 0; j < k; j++) {
      const int64_t e = s.experts[j];
      float *g = s.gate.data() + j * F, *u = s.up.data() + j * F;
      if (w.gate_b) add_bias(g, w.gate_b + e * F, F);
      if (w.up_b) add_bias(u, w.up_b + e * F, F);
      glu(w, g, u, F);
    }
    // each expert's input rounded on its own (the same per-32 groups as one row each)
    quantize_x(s.gate.data(), k, F, s.xq.data(), s.xd.data(), s.xhs.data(), s.xl.data(), 1);
  }
  for (int64_t j = 0; j < k; j++) {
    const int64_t e = s.experts[j];
    const QX xj{s.xq.data() + j * F, s.xd.data() + j * G, s.xhs.data() + 2 * j * G, s.xl.data() + 2 * j * G, 1, F};
    jobs[j] = Job{&w.down, e * C, (e + 1) * C, xj, s.gate.data() + j * F, s.out.data() + j * C};
  }
  run_jobs(jobs, static_cast<int>(k));
#pragma omp single
  {
    for (int64_t i = 0; i < C; i++) out[i] = 0.f;
    for (int64_t j = 0; j < k; j++) {  // ascending experts, as MoE.forward's index_add_ into zeros
      const int64_t e = s.experts[j];
      float* y = s.out.data() + j * C;
      if (w.down_b) add_bias(y, w.down_b + e * C, C);
      const float p = s.weights[j];
      for (int64_t i = 0; i < C; i++) out[i] += y[i] * p;
    }
  }
}

}  // namespace lq
