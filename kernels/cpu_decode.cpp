// The decode step of cpu_decode.h. Reference: localllm/model.py Transformer.forward for one token
// (RMSNorm in fp32, neox rope on the first rot dims (rope.rope_rotate), causal attention with grouped
// kv heads, scale, soft cap, window and sinks as attention.attend, SiLU or tanh-GELU GLU, Gemma's post
// norms, fp32 residual; Gemma 4: project_qkv's k_eq_v / value norm / KV-shared layers, Block.forward's
// per-layer input and output scale); tests/test_cpu_kernels.py, tests/test_cpu_families.py and
// tests/test_cpu_gemma4.py check its logits against that forward and greedy output for 64 tokens.
#include "cpu_decode.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>

#include "cpu_quant.h"
#include "cpu_vmath.h"

namespace lq {
namespace {

// Buffers of one step, reused across steps (one decoder runs at a time per thread).
struct Scratch {
  std::vector<float> x, xn, tmp, q, k, v, att, gate, up, scores, xd, xhs, ple, ptok, pg;
  std::vector<int16_t> xq;
  std::vector<int32_t> xl;
  std::vector<uint8_t> xlo;  // xq's bytes (QX lo, hi)
  std::vector<int8_t> xhi;
};

Scratch& scratch(const ModelW& m, int64_t S, int64_t B) {
  thread_local Scratch s;
  int64_t D = 0, Hkv = 0, F = 0;  // the widest layer's (Gemma 4's differ)
  for (const LayerW& w : m.layers) D = std::max(D, w.D), Hkv = std::max(Hkv, w.Hkv), F = std::max(F, w.F);
  const int64_t C = m.dim, widest = std::max({C, F, m.H * D, m.P}), G = widest / 32;
  const int64_t L = static_cast<int64_t>(m.layers.size());
  s.x.resize(B * C), s.xn.resize(B * C), s.tmp.resize(B * C);
  s.q.resize(B * m.H * D), s.k.resize(B * Hkv * D), s.v.resize(B * Hkv * D), s.att.resize(B * m.H * D);
  s.gate.resize(B * F), s.up.resize(B * F), s.scores.resize(B * m.H * S);
  s.ple.resize(B * L * m.P), s.ptok.resize(B * L * m.P), s.pg.resize(B * m.P);
  s.xq.resize(B * widest), s.xlo.resize(B * widest), s.xhi.resize(B * widest), s.xd.resize(B * G), s.xhs.resize(2 * B * G), s.xl.resize(2 * B * G);
  return s;
}

void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

// x / rms(x) without a weight (model.py unit_rmsnorm: Gemma 4's value norm), in place.
void unit_rmsnorm(float* x, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; i++) x[i] *= r;
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  return hsum(acc);
}

// The first R dims: x' (first half, second half) = (x1 cos - x2 sin, x2 cos + x1 sin), the rest
// unchanged: rope.rope_rotate.
void rope(float* x, int64_t R, const float* cos, const float* sin) {
  const int64_t h = R / 2;
  for (int64_t i = 0; i < h; i++) {
    const float a = x[i], b = x[i + h];
    x[i] = a * cos[i] - b * sin[i];
    x[i + h] = b * cos[i] + a * sin[i];
  }
}

// Rows of several weights that share the input x, split over the team (inside the parallel region).
void products(std::initializer_list<std::pair<const Mat*, float*>> jobs, const QX& qx, const float* xf) {
  constexpr int64_t chunk = 16;  // a multiple of the 8-row tiles
  int64_t total = 0;
  for (const auto& j : jobs) total += (j.first->N + chunk - 1) / chunk;
#pragma omp for schedule(static)
  for (int64_t c = 0; c < total; c++) {
    int64_t first = c;
    for (const auto& j : jobs) {
      const Mat& m = *j.first;
      const int64_t chunks = (m.N + chunk - 1) / chunk;
      if (first >= chunks) {
        first -= chunks;
        continue;
      }
      const int64_t n0 = first * chunk, n1 = std::min(m.N, n0 + chunk);
      mat_rows(m, n0, n1, qx, xf, j.second, m.N);
      break;
    }
  }
}

// B rows of K values -> qx (each row rounded on its own: the same groups as one row alone).
void quantize(const float* x, int64_t B, int64_t K, Scratch& s, QX& qx) {
  quantize_x(x, B, K, s.xq.data(), s.xd.data(), s.xhs.data(), s.xl.data(), 1);
  split_x(s.xq.data(), B * K, s.xlo.data(), s.xhi.data());
  qx = QX{s.xq.data(), s.xd.data(), s.xhs.data(), s.xl.data(), B, K, s.xlo.data(), s.xhi.data()};
}

// Row b of qx as a one-row QX.
QX row_of(const QX& qx, int64_t b) {
  const int64_t G = qx.K / 32;
  return QX{qx.q + b * qx.K, qx.d + b * G, qx.half_sums + 2 * b * G, qx.sums + 2 * b * G, 1, qx.K,
            qx.lo ? qx.lo + b * qx.K : nullptr, qx.hi ? qx.hi + b * qx.K : nullptr};
}

void add_bias(float* y, const float* b, int64_t n) {
  if (b) for (int64_t i = 0; i < n; i++) y[i] += b[i];
}

// 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))): torch's F.gelu(approximate="tanh").
constexpr float GELU_BETA = 0.7978845608028654f, GELU_KAPPA = 0.044715f;

inline float gelu_tanh(float g) {
  return 0.5f * g * (1.f + std::tanh(GELU_BETA * (g + GELU_KAPPA * g * g * g)));
}

// The GLU's product input: act(gate) * up, written over gate.
void glu(int act, float* gate, const float* up, int64_t F) {
  if (act == GELU_TANH) {
    const __m256 beta = _mm256_set1_ps(GELU_BETA), kappa = _mm256_set1_ps(GELU_KAPPA), half = _mm256_set1_ps(0.5f);
    int64_t i = 0;
    for (; i + 8 <= F; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 inner = _mm256_mul_ps(beta, _mm256_fmadd_ps(_mm256_mul_ps(kappa, g), _mm256_mul_ps(g, g), g));
      const __m256 t = _mm256_add_ps(_mm256_set1_ps(1.f), tanh8(inner));
      _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(half, g), t), _mm256_loadu_ps(up + i)));
    }
    for (; i < F; i++) gate[i] = gelu_tanh(gate[i]) * up[i];
  } else {
    for (int64_t i = 0; i < F; i++) gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  }
}

// c tanh(x / c) over n values (attention scores, final logits).
void softcap(float* x, int64_t n, float c) {
  const __m256 vc = _mm256_set1_ps(c);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(vc, tanh8(_mm256_div_ps(_mm256_loadu_ps(x + i), vc))));
  for (; i < n; i++) x[i] = c * std::tanh(x[i] / c);
}

// One query head over cache rows [t0, pos]: softmax(cap(scale q k^T), sink) v (attention.attend; the
// sink, when given, joins the softmax's denominator only).
void attend(const float* q, const float* kc, const float* vc, int64_t t0, int64_t pos, int64_t D, float scale,
            float cap, const float* sink, float* scores, float* out) {
  float mx = -INFINITY;
  for (int64_t t = t0; t <= pos; t++) {
    scores[t] = dot(q, kc + t * D, D) * scale;
    mx = std::max(mx, scores[t]);
  }
  if (cap > 0.f) {  // monotonic: the capped maximum is the cap of the maximum
    softcap(scores + t0, pos + 1 - t0, cap);
    mx = cap * std::tanh(mx / cap);
  }
  if (sink) mx = std::max(mx, *sink);
  float sum = sink ? std::exp(*sink - mx) : 0.f;
  for (int64_t t = t0; t <= pos; t++) {
    scores[t] = std::exp(scores[t] - mx);
    sum += scores[t];
  }
  for (int64_t d = 0; d < D; d++) out[d] = 0.f;
  for (int64_t t = t0; t <= pos; t++) {
    const float p = scores[t] / sum;
    for (int64_t d = 0; d < D; d++) out[d] += p * vc[t * D + d];
  }
}

// Gemma 4 per-layer inputs of each row's token (Transformer.per_layer_inputs), into s.ple (B, L, P): the
// token's row times sqrt(P), plus the RMS-normed projection of the scaled embedding x times C^-1/2, over
// sqrt(2). Called by every thread of the team.
void per_layer_inputs(const ModelW& m, int64_t B, const int64_t* tokens, const float* x, Scratch& s, QX& qx) {
  const int64_t L = static_cast<int64_t>(m.layers.size()), P = m.P, C = m.dim;
  float *ple = s.ple.data(), *rows = s.ptok.data();
#pragma omp single
  {
    for (int64_t b = 0; b < B; b++) mat_dequantize(m.ple_embd, tokens[b], tokens[b] + 1, rows + b * L * P);
    quantize(x, B, C, s, qx);
  }
  products({{&m.ple_proj, ple}}, qx, x);
#pragma omp single
  {
    // the reference's Python scalars, rounded to fp32 as torch rounds them
    const float proj_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(C)));
    const float tok_scale = static_cast<float>(std::sqrt(static_cast<double>(P)));
    const float out_scale = static_cast<float>(1.0 / std::sqrt(2.0));
    for (int64_t b = 0; b < B; b++) {
      const float* row = rows + b * L * P;
      for (int64_t l = 0; l < L; l++) {
        float* p = ple + (b * L + l) * P;
        for (int64_t i = 0; i < P; i++) p[i] *= proj_scale;
        rmsnorm(p, m.ple_norm, P, m.eps, p);
        for (int64_t i = 0; i < P; i++) p[i] = (p[i] + row[l * P + i] * tok_scale) * out_scale;
      }
    }
  }
}

}  // namespace

void decode_step(const ModelW& m, int64_t token, int64_t pos, const Cache& c, const float* cos, const float* sin,
                 float* logits, int threads) {
  const int64_t slot = 0;
  decode_rows(m, 1, &token, &pos, &slot, c, cos, sin, 0, logits, threads);
}

void decode_rows(const ModelW& m, int64_t B, const int64_t* tokens, const int64_t* pos, const int64_t* slots,
                 const Cache& c, const float* cos, const float* sin, int64_t rope_row, float* logits, int threads) {
  Scratch& s = scratch(m, c.S, B);
  const int64_t C = m.dim, H = m.H, S = c.S, L = static_cast<int64_t>(m.layers.size());
  float *x = s.x.data(), *xn = s.xn.data(), *tmp = s.tmp.data();
  float *q = s.q.data(), *k = s.k.data(), *v = s.v.data(), *att = s.att.data();
  float *gate = s.gate.data(), *up = s.up.data();
  for (int64_t b = 0; b < B; b++) {
    mat_dequantize(m.embd, tokens[b], tokens[b] + 1, x + b * C);
    if (m.embed_scale != 1.f) for (int64_t i = 0; i < C; i++) x[b * C + i] *= m.embed_scale;
  }
  const int64_t stride = m.rot / 2;  // of the rope rows
  QX qx{};
  std::vector<const MoEW*> moes;
  for (const LayerW& w : m.layers) moes.push_back(w.moe);
  MoEScratch* ms = moe_scratch(moes, C);  // shared by the team (nullptr: no experts)
#pragma omp parallel num_threads(threads)
  {
    if (m.P) per_layer_inputs(m, B, tokens, x, s, qx);
    for (const LayerW& w : m.layers) {
      const int64_t l = &w - m.layers.data();
      const int64_t D = w.D, Hkv = w.Hkv, QD = H * D, KD = Hkv * D;
      const bool own_kv = w.k.N > 0;  // else a KV-shared layer: kc, vc are its source layer's, row pos written
#pragma omp single
      {
        for (int64_t b = 0; b < B; b++) rmsnorm(x + b * C, w.attn_norm, C, m.eps, xn + b * C);
        quantize(xn, B, C, s, qx);
      }
      products({{&w.q, q}, {&w.k, k}, {&w.v, v}}, qx, xn);  // (no rows where k or v are absent)
#pragma omp single
      for (int64_t b = 0; b < B; b++) {
        float *qb = q + b * QD, *kb = k + b * KD, *vb = v + b * KD;
        float* kc = c.k[l] + slots[b] * c.slot_stride[l];
        float* vc = c.v[l] + slots[b] * c.slot_stride[l];
        add_bias(qb, w.bq, QD), add_bias(kb, w.bk, KD), add_bias(vb, w.bv, KD);
        if (own_kv && w.v.N == 0) std::copy(kb, kb + KD, vb);  // k_eq_v: the values before k's norm
        const float *lc = cos + b * rope_row + w.rope * stride, *ls = sin + b * rope_row + w.rope * stride;
        for (int64_t h = 0; h < H; h++) {  // (lc, ls unread where w.rope < 0)
          if (w.q_norm) rmsnorm(qb + h * D, w.q_norm, D, m.eps, qb + h * D);
          if (w.rope >= 0) rope(qb + h * D, w.rot, lc, ls);
        }
        for (int64_t h = 0; own_kv && h < Hkv; h++) {
          if (w.k_norm) rmsnorm(kb + h * D, w.k_norm, D, m.eps, kb + h * D);
          if (m.v_norm) unit_rmsnorm(vb + h * D, D, m.eps);
          if (w.rope >= 0) rope(kb + h * D, w.rot, lc, ls);
          std::copy(kb + h * D, kb + (h + 1) * D, kc + (h * S + pos[b]) * D);
          std::copy(vb + h * D, vb + (h + 1) * D, vc + (h * S + pos[b]) * D);
        }
      }
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H;
        const int64_t hk = h / (H / Hkv);  // grouped-query attention: H / Hkv query heads per kv head
        const int64_t t0 = w.window > 0 ? std::max<int64_t>(0, pos[b] - w.window + 1) : 0;
        const float* kc = c.k[l] + slots[b] * c.slot_stride[l];
        const float* vc = c.v[l] + slots[b] * c.slot_stride[l];
        attend(q + b * QD + h * D, kc + hk * S * D, vc + hk * S * D, t0, pos[b], D, m.attn_scale, m.attn_softcap,
               w.sinks ? w.sinks + h : nullptr, s.scores.data() + bh * S, att + b * QD + h * D);
      }
#pragma omp single
      quantize(att, B, QD, s, qx);
      products({{&w.o, tmp}}, qx, att);
#pragma omp single
      {
        for (int64_t b = 0; b < B; b++) {
          float *tb = tmp + b * C, *xb = x + b * C;
          add_bias(tb, w.bo, C);
          if (w.post_attn_norm) rmsnorm(tb, w.post_attn_norm, C, m.eps, tb);
          for (int64_t i = 0; i < C; i++) xb[i] += tb[i];
          rmsnorm(xb, w.ffn_norm, C, m.eps, xn + b * C);
        }
        quantize(xn, B, C, s, qx);
      }
      if (w.moe) {
        const QX all = qx;  // (moe_ffn's barriers keep every thread on the same row)
        for (int64_t b = 0; b < B; b++) moe_ffn(*w.moe, l, xn + b * C, row_of(all, b), *ms, C, tmp + b * C);
      } else {
        const int64_t F = w.F;
        products({{&w.gate, gate}, {&w.up, up}}, qx, xn);
#pragma omp single
        {
          for (int64_t b = 0; b < B; b++) glu(w.act, gate + b * F, up + b * F, F);
          quantize(gate, B, F, s, qx);
        }
        products({{&w.down, tmp}}, qx, gate);
      }
#pragma omp single
      {
        for (int64_t b = 0; b < B; b++) {
          float *tb = tmp + b * C, *xb = x + b * C;
          if (w.post_ffn_norm) rmsnorm(tb, w.post_ffn_norm, C, m.eps, tb);
          for (int64_t i = 0; i < C; i++) xb[i] += tb[i];
        }
        if (w.inp_gate.N) quantize(x, B, C, s, qx);
      }
      if (w.inp_gate.N) {  // Gemma 4 PLE (model.py Block.forward): x += norm(proj(gelu_tanh(gate(x)) * ple_l))
        const int64_t P = m.P;
        float* pg = s.pg.data();
        products({{&w.inp_gate, pg}}, qx, x);
#pragma omp single
        {
          for (int64_t b = 0; b < B; b++) glu(GELU_TANH, pg + b * P, s.ple.data() + (b * L + l) * P, P);
          quantize(pg, B, P, s, qx);
        }
        products({{&w.proj, tmp}}, qx, pg);
#pragma omp single
        for (int64_t b = 0; b < B; b++) {
          float *tb = tmp + b * C, *xb = x + b * C;
          rmsnorm(tb, w.post_norm, C, m.eps, tb);
          for (int64_t i = 0; i < C; i++) xb[i] += tb[i];
        }
      }
      if (w.out_scale) {
#pragma omp single
        for (int64_t i = 0; i < B * C; i++) x[i] *= *w.out_scale;
      }
    }
#pragma omp single
    {
      for (int64_t b = 0; b < B; b++) rmsnorm(x + b * C, m.out_norm, C, m.eps, xn + b * C);
      quantize(xn, B, C, s, qx);
    }
    products({{&m.out, logits}}, qx, xn);
    if (m.final_softcap > 0.f) {
      constexpr int64_t chunk = 256;  // from each row's start, as one row alone
      const int64_t V = m.out.N, chunks = (V + chunk - 1) / chunk;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < B * chunks; i++) {
        const int64_t b = i / chunks, i0 = i % chunks * chunk;
        softcap(logits + b * V + i0, std::min(chunk, V - i0), m.final_softcap);
      }
    }
  }
}

}  // namespace lq
