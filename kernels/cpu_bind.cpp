// Python bindings of the CPU kernels (built by kernels/cpu.py with torch.utils.cpp_extension).
// Tensors arrive checked by cpu.py: contiguous, on the CPU, uint8 blocks or fp32 values.
#include <torch/extension.h>

#include <deque>

#include "cpu_decode.h"
#include "cpu_encode.h"
#include "cpu_gemm.h"
#include "cpu_kencode.h"
#include "cpu_quant.h"
#include "cpu_tiles.h"

namespace {

// A weight as the kernels see it: w uint8, (N, row bytes) GGUF blocks or dense rows, or 1-D tiles.
lq::Mat mat(const at::Tensor& w, int64_t qtype, int64_t N, int64_t K, bool tiled) {
  const int64_t row_bytes = tiled ? 0 : w.size(1);
  return lq::Mat{static_cast<int>(qtype), static_cast<const uint8_t*>(w.data_ptr()), N, K, row_bytes, tiled};
}

// x (T, K) fp32 @ w.T -> (T, N) fp32 (x rounded to int16 per 32 values unless w is dense).
at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t N, int64_t K, bool tiled,
                   int64_t threads) {
  const int64_t T = x.size(0), G = K / 32;
  at::Tensor y = at::empty({T, N}, x.options());
  auto q = at::empty({T, K}, at::kShort);
  auto d = at::empty({T, G}, at::kFloat), hs = at::empty({T, G, 2}, at::kFloat);
  auto sums = at::empty({T, G, 2}, at::kInt);
  lq::quantize_x(x.data_ptr<float>(), T, K, q.data_ptr<int16_t>(), d.data_ptr<float>(), hs.data_ptr<float>(),
                 sums.data_ptr<int32_t>(), static_cast<int>(threads));
  auto lo = at::empty({T, K}, at::kByte), hi = at::empty({T, K}, at::kChar);
  lq::split_x(q.data_ptr<int16_t>(), T * K, lo.data_ptr<uint8_t>(), hi.data_ptr<int8_t>());
  lq::QX qx{q.data_ptr<int16_t>(), d.data_ptr<float>(), hs.data_ptr<float>(), sums.data_ptr<int32_t>(), T, K,
            lo.data_ptr<uint8_t>(), hi.data_ptr<int8_t>()};
  lq::mat_matmul(mat(w, qtype, N, K, tiled), qx, x.data_ptr<float>(), y.data_ptr<float>(), static_cast<int>(threads));
  return y;
}

// x (T, K) fp32 @ w.T -> (T, N) fp32 for dense rows (F32 / F16 / BF16; cpu_gemm.h): prompts.
at::Tensor dense_gemm(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t N, int64_t K,
                      int64_t threads) {
  const int64_t T = x.size(0);
  at::Tensor y = at::empty({T, N}, x.options());
  lq::dense_gemm(static_cast<int>(qtype), w.data_ptr<uint8_t>(), N, K, x.data_ptr<float>(), T, y.data_ptr<float>(),
                 static_cast<int>(threads));
  return y;
}

// Rows [n0, n1) of w -> (n1 - n0, K) fp32, equal to quantize.decode.dequantize_torch.
at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t N, int64_t K, bool tiled, int64_t n0, int64_t n1,
                      int64_t threads) {
  at::Tensor out = at::empty({n1 - n0, K}, at::kFloat);
  const lq::Mat m = mat(w, qtype, N, K, tiled);
  if (n0 == 0 && n1 == N) {
    lq::mat_dequantize_all(m, out.data_ptr<float>(), static_cast<int>(threads));
  } else {
    lq::mat_dequantize(m, n0, n1, out.data_ptr<float>());
  }
  return out;
}

// raw (N, row bytes) GGUF blocks -> 1-D uint8 tiles (cpu_tiles.h); empty where the type is not tiled.
at::Tensor repack(const at::Tensor& raw, int64_t qtype, int64_t K, int64_t threads) {
  const lq::TileKind k = lq::tile_kind(static_cast<int>(qtype));
  if (!k.bits) return at::empty({0}, at::kByte);
  const int64_t N = raw.size(0);
  at::Tensor tiles = at::empty({(N + 7) / 8 * (K / 32) * k.group_bytes()}, at::kByte);
  lq::repack(static_cast<int>(qtype), raw.data_ptr<uint8_t>(), N, raw.size(1), K, tiles.data_ptr<uint8_t>(),
             static_cast<int>(threads));
  return tiles;
}

const float* ptr_or_null(const at::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

// The encoders' x: a contiguous (rows, cols) fp32 or fp16 CPU tensor (read in place).
void check_encoder_input(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf),
              "encoder input: a contiguous 2-D fp32 or fp16 CPU tensor");
}

// Holds the tensors (so the pointers stay valid) and the model's layout; see cpu.py CpuDecoder.
struct Decoder {
  std::vector<at::Tensor> keep;
  lq::ModelW m;
  std::deque<lq::MoEW> moes;  // the layers' experts (a deque: the layers keep pointers)

  // dims: dim, ffn, H, Hkv, D, rot. scalars: eps, embed_scale, attn_scale, attn_softcap, final_softcap
  // (0: none). mats: per layer q k v o gate up down, then embd, out (as qmatmul takes them; F32 weights
  // viewed as bytes); qtypes, Ns, Ks and tiled alike. vecs: per layer attn_norm ffn_norm q_norm k_norm
  // bq bk bv post_attention_norm post_ffw_norm bo sinks (empty when absent), then output_norm.
  // layers: per layer rope set (-1: none), window (0: all keys), activation (lq::Act).
  Decoder(std::vector<int64_t> dims, std::vector<double> scalars, std::vector<at::Tensor> mats,
          std::vector<int64_t> qtypes, std::vector<int64_t> Ns, std::vector<int64_t> Ks, std::vector<bool> tiled,
          std::vector<at::Tensor> vecs, std::vector<int64_t> layers) {
    constexpr size_t NM = 7, NV = 11, NL = 3;  // per layer: matrices, vectors, layer ints
    keep = mats;
    keep.insert(keep.end(), vecs.begin(), vecs.end());
    m.dim = dims[0], m.ffn = dims[1], m.H = dims[2], m.Hkv = dims[3], m.D = dims[4], m.rot = dims[5];
    m.eps = static_cast<float>(scalars[0]), m.embed_scale = static_cast<float>(scalars[1]);
    m.attn_scale = static_cast<float>(scalars[2]), m.attn_softcap = static_cast<float>(scalars[3]);
    m.final_softcap = static_cast<float>(scalars[4]);
    const size_t L = (mats.size() - 2) / NM;
    for (size_t l = 0; l < L; l++) {
      auto M = [&](size_t i) {
        const size_t j = NM * l + i;
        return mat(mats[j], qtypes[j], Ns[j], Ks[j], tiled[j]);
      };
      auto V = [&](size_t i) { return ptr_or_null(vecs[NV * l + i]); };
      lq::LayerW w{M(0), M(1), M(2), M(3), M(4), M(5), M(6), V(0), V(1), V(2), V(3),
                   V(4), V(5), V(6), V(7), V(8), V(9), V(10)};
      w.rope = static_cast<int>(layers[NL * l]), w.window = layers[NL * l + 1];
      w.act = static_cast<int>(layers[NL * l + 2]);
      w.D = m.D, w.Hkv = m.Hkv, w.F = m.ffn, w.rot = m.rot;
      m.layers.push_back(w);
    }
    m.embd = mat(mats[NM * L], qtypes[NM * L], Ns[NM * L], Ks[NM * L], tiled[NM * L]);
    m.out = mat(mats[NM * L + 1], qtypes[NM * L + 1], Ns[NM * L + 1], Ks[NM * L + 1], tiled[NM * L + 1]);
    m.out_norm = vecs[NV * L].data_ptr<float>();
  }

  // Layer `layer`'s MLP becomes a mixture of experts (cpu_moe.h). mats: router, gate, up, down (qtypes,
  // Ns, Ks, tiled alike); vecs: router, gate, up, down biases (empty when absent); ints: E, k, F,
  // gating (lq::Gating), norm_topk, act (lq::ExpertAct); limit: swiglu_oai's clamp (<= 0: none).
  void add_moe(int64_t layer, std::vector<at::Tensor> mats, std::vector<int64_t> qtypes, std::vector<int64_t> Ns,
               std::vector<int64_t> Ks, std::vector<bool> tiled, std::vector<at::Tensor> vecs,
               std::vector<int64_t> ints, double limit) {
    keep.insert(keep.end(), mats.begin(), mats.end());
    keep.insert(keep.end(), vecs.begin(), vecs.end());
    auto M = [&](size_t i) { return mat(mats[i], qtypes[i], Ns[i], Ks[i], tiled[i]); };
    lq::MoEW w{M(0), M(1), M(2), M(3), ptr_or_null(vecs[0]), ptr_or_null(vecs[1]), ptr_or_null(vecs[2]),
               ptr_or_null(vecs[3])};
    w.E = ints[0], w.k = ints[1], w.F = ints[2], w.gating = static_cast<int>(ints[3]);
    w.norm_topk = ints[4] != 0, w.act = static_cast<int>(ints[5]), w.limit = static_cast<float>(limit);
    moes.push_back(w);
    m.layers.at(layer).moe = &moes.back();
  }

  // (L, k) each layer's experts of the last step on this thread, ascending (-1 rows: no experts).
  at::Tensor experts() {
    std::vector<const lq::MoEW*> layers;
    for (const auto& w : m.layers) layers.push_back(w.moe);
    lq::MoEScratch* s = lq::moe_scratch(layers, m.dim);
    const int64_t L = static_cast<int64_t>(layers.size()), k = s ? static_cast<int64_t>(s->experts.size()) : 0;
    at::Tensor out = at::full({L, k}, -1, at::kLong);
    int64_t* o = out.data_ptr<int64_t>();
    for (int64_t l = 0; l < L; l++)
      if (layers[l]) std::copy(s->chosen.begin() + l * k, s->chosen.begin() + (l + 1) * k, o + l * k);
    return out;
  }

  // Gemma 4's layer fields (cpu_gemma4.py gemma4_args). shapes: per layer D, Hkv, F, rot. mats: per layer
  // inp_gate, proj (empty without PLE), then per_layer_token_embd, per_layer_model_proj; vecs: per layer
  // post_norm, layer_output_scale, then per_layer_proj_norm. P: PLE width (0: none).
  void gemma4(std::vector<int64_t> shapes, std::vector<at::Tensor> mats, std::vector<int64_t> qtypes,
              std::vector<int64_t> Ns, std::vector<int64_t> Ks, std::vector<bool> tiled, std::vector<at::Tensor> vecs,
              bool v_norm, int64_t P) {
    keep.insert(keep.end(), mats.begin(), mats.end());
    keep.insert(keep.end(), vecs.begin(), vecs.end());
    auto M = [&](size_t j) { return mat(mats[j], qtypes[j], Ns[j], Ks[j], tiled[j]); };
    const size_t L = m.layers.size();
    for (size_t l = 0; l < L; l++) {
      lq::LayerW& w = m.layers[l];
      w.D = shapes[4 * l], w.Hkv = shapes[4 * l + 1], w.F = shapes[4 * l + 2], w.rot = shapes[4 * l + 3];
      w.inp_gate = M(2 * l), w.proj = M(2 * l + 1);
      w.post_norm = ptr_or_null(vecs[2 * l]), w.out_scale = ptr_or_null(vecs[2 * l + 1]);
    }
    m.ple_embd = M(2 * L), m.ple_proj = M(2 * L + 1), m.ple_norm = ptr_or_null(vecs[2 * L]);
    m.v_norm = v_norm, m.P = P;
  }

  // k, v: (L, 1, Hkv, S, D) fp32 cache; cos, sin: (n sets, rot/2) rope rows of pos -> logits (V,).
  at::Tensor step(int64_t token, int64_t pos, at::Tensor& k, at::Tensor& v, const at::Tensor& cos,
                  const at::Tensor& sin, int64_t threads) {
    return run(token, pos, cache(k, v), cos, sin, threads);
  }

  // k, v: per layer (1, Hkv_l, S, D_l) fp32 buffers (model.py's layered KVCache: a KV-shared layer's
  // are its source layer's).
  at::Tensor step_layers(int64_t token, int64_t pos, std::vector<at::Tensor> k, std::vector<at::Tensor> v,
                         const at::Tensor& cos, const at::Tensor& sin, int64_t threads) {
    return run(token, pos, layer_cache(k, v), cos, sin, threads);
  }

  // B rows (lq::decode_rows): tokens, pos, slots (B,) int64; k, v: (L, n, Hkv, S, D) fp32 cache of n slots;
  // cos, sin: (B, n sets, rot/2) rope rows of each row's position -> logits (B, V).
  at::Tensor step_rows(const at::Tensor& tokens, const at::Tensor& pos, const at::Tensor& slots, at::Tensor& k,
                       at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin, int64_t threads) {
    return rows(tokens, pos, slots, cache(k, v), cos, sin, threads);
  }

  // The same over per-layer (n, Hkv_l, S, D_l) buffers.
  at::Tensor step_rows_layers(const at::Tensor& tokens, const at::Tensor& pos, const at::Tensor& slots,
                              std::vector<at::Tensor> k, std::vector<at::Tensor> v, const at::Tensor& cos,
                              const at::Tensor& sin, int64_t threads) {
    return rows(tokens, pos, slots, layer_cache(k, v), cos, sin, threads);
  }

  static lq::Cache cache(at::Tensor& k, at::Tensor& v) {
    lq::Cache c{{}, {}, {}, k.size(3)};
    const int64_t L = k.size(0), per_layer = k.numel() / L;
    for (int64_t l = 0; l < L; l++) {
      c.k.push_back(k.data_ptr<float>() + l * per_layer);
      c.v.push_back(v.data_ptr<float>() + l * per_layer);
      c.slot_stride.push_back(k.stride(1));
    }
    return c;
  }

  static lq::Cache layer_cache(std::vector<at::Tensor>& k, std::vector<at::Tensor>& v) {
    lq::Cache c{{}, {}, {}, k.at(0).size(2)};
    for (auto& t : k) c.k.push_back(t.data_ptr<float>()), c.slot_stride.push_back(t.stride(0));
    for (auto& t : v) c.v.push_back(t.data_ptr<float>());
    return c;
  }

  at::Tensor run(int64_t token, int64_t pos, const lq::Cache& c, const at::Tensor& cos, const at::Tensor& sin,
                 int64_t threads) {
    at::Tensor logits = at::empty({m.out.N}, at::kFloat);
    lq::decode_step(m, token, pos, c, cos.data_ptr<float>(), sin.data_ptr<float>(), logits.data_ptr<float>(),
                    static_cast<int>(threads));
    return logits;
  }

  at::Tensor rows(const at::Tensor& tokens, const at::Tensor& pos, const at::Tensor& slots, const lq::Cache& c,
                  const at::Tensor& cos, const at::Tensor& sin, int64_t threads) {
    const int64_t B = tokens.size(0);
    at::Tensor logits = at::empty({B, m.out.N}, at::kFloat);
    lq::decode_rows(m, B, tokens.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), c,
                    cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(1) * cos.size(2), logits.data_ptr<float>(),
                    static_cast<int>(threads));
    return logits;
  }
};

}  // namespace

// Every kernel runs without the GIL (nogil): a server's HTTP thread parses requests and streams replies
// on the other cores while the engine thread computes (a decode step is one call of ~50 ms at 16 rows
// with the default model on one thread). The calls touch no Python object; each caller's tensors are
// its own (one engine thread uses a model's Decoder).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  mod.def("qmatmul", &qmatmul, nogil);
  mod.def("dense_gemm", &dense_gemm, nogil);
  mod.def("dequantize", &dequantize, nogil);
  mod.def("repack", &repack, nogil);
  // x (rows, cols) fp32 or fp16 -> (rows, cols / 32 * block bytes) Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 blocks; imp:
  // empty, (cols,) or (rows, cols) imatrix. ValueError where x holds a NaN or Inf.
  mod.def("encode_simple", [](const at::Tensor& x, int64_t qtype, const at::Tensor& imp, int64_t threads) {
    check_encoder_input(x);
    at::Tensor out = at::empty({x.size(0), x.size(1) / 32 * lq::simple_block_bytes(static_cast<int>(qtype))}, at::kByte);
    if (!lq::encode_simple(static_cast<int>(qtype), x.data_ptr(), x.scalar_type() == at::kHalf, x.size(0), x.size(1),
                           ptr_or_null(imp), imp.dim() == 2 ? imp.size(1) : 0, out.data_ptr<uint8_t>(),
                           static_cast<int>(threads)))
      throw pybind11::value_error("non-finite values");
    return out;
  }, nogil);
  // x (rows, cols) fp32 or fp16 -> (rows, cols / 256 * block bytes) K-quant blocks; qw: empty, (cols,) or
  // (rows, cols). ValueError where x holds a NaN or Inf.
  mod.def("kquant_encode", [](const at::Tensor& x, int64_t qtype, int64_t nbytes, const at::Tensor& qw,
                              int64_t threads) {
    check_encoder_input(x);
    at::Tensor out = at::empty({x.size(0), x.size(1) / 256 * nbytes}, at::kByte);
    const int64_t stride = qw.dim() == 2 ? qw.size(1) : 0;
    if (!lq::kquant_encode(static_cast<int>(qtype), x.data_ptr(), x.scalar_type() == at::kHalf, x.size(0), x.size(1),
                           ptr_or_null(qw), stride, out.data_ptr<uint8_t>(), static_cast<int>(threads)))
      throw pybind11::value_error("non-finite values");
    return out;
  }, nogil);
  pybind11::class_<Decoder>(mod, "Decoder")
      .def(pybind11::init<std::vector<int64_t>, std::vector<double>, std::vector<at::Tensor>, std::vector<int64_t>,
                          std::vector<int64_t>, std::vector<int64_t>, std::vector<bool>, std::vector<at::Tensor>,
                          std::vector<int64_t>>())
      .def("add_moe", &Decoder::add_moe, nogil)
      .def("experts", &Decoder::experts, nogil)
      .def("gemma4", &Decoder::gemma4, nogil)
      .def("step", &Decoder::step, nogil)
      .def("step_layers", &Decoder::step_layers, nogil)
      .def("step_rows", &Decoder::step_rows, nogil)
      .def("step_rows_layers", &Decoder::step_rows_layers, nogil);
}
