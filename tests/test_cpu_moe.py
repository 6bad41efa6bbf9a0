"""The C++ one-call decoder's mixture of experts (kernels/cpu_moe.cpp) against the torch forward of
model.py / moe.py (the reference; itself checked against transformers in tests/test_moe.py).

- tiny random MoE models of each family's shape (synthetic.synthetic_state: Q8_0 / Q4_0 / Q4_K blocks,
  experts included), each step's logits against (a) the torch forward on the same blocks (the eager
  runtime, CpuEagerRuntime: the same C++ products per expert) and (b) the dense reference with the
  inputs of quantized products rounded as the kernels round them; the experts each layer chose equal
  the torch routing's;
- greedy ids over 64 tokens equal the dense reference's, per family;
- the tiny MoE GGUF files of tiny_models.MOE_CASES (Q8_0; MXFP4 experts as llama.cpp's gpt-oss files
  hold them) loaded as a user loads them: C++ steps against the dense load's forward;
- ties in the router: moe.top_k's order (larger first, equal values by lower index).
"""

from __future__ import annotations

from dataclasses import replace

import gguf
import pytest
import torch

import tiny_models as tm
from tiny_gguf import gguf_tensors, write_gguf
from localllm.backends import runtime_class
from localllm.backends.cpu import CpuEagerRuntime, CpuRuntime, cpp_covers
from localllm.cache import make_cache
from localllm.config import ModelConfig
from localllm.kernels.cpu import BlockQWeight
from localllm.load import build_model, load_model
from localllm.moe import MoE, ExpertLinear
from localllm.runtime import Runtime
from localllm.quantize import quantize_tensor
from localllm.synthetic import quantize_embedding, synthetic_state
from localllm.weights import QuantizedTensor
from test_cpu_families import TOL, greedy
from test_cpu_kernels import DENSE, hooked_reference, rel, rounded

Q = gguf.GGMLQuantizationType

BASE = ModelConfig(arch="llama", n_layers=3, dim=64, ffn_dim=128, n_heads=4, n_kv_heads=2, head_dim=32,
                   vocab_size=256, context_length=256, norm_eps=1e-6, rope_theta=10000.0)
# Each MoE family's fields (as their config readers set them) on small shapes; expert widths a
# multiple of 32 (the down product's rows) and of 8 (tiles).
FAMILIES = {
    "mixtral": replace(BASE, n_experts=8, n_experts_used=2, expert_ffn_dim=64),
    "qwen3_moe": replace(BASE, arch="qwen3moe", qk_norm=True, n_experts=16, n_experts_used=4, expert_ffn_dim=32,
                         moe_norm_topk=False),
    "qwen3_moe_norm": replace(BASE, arch="qwen3moe", qk_norm=True, n_experts=16, n_experts_used=4,
                              expert_ffn_dim=32),
    "gpt_oss": replace(BASE, arch="gpt-oss", head_dim=16, qkv_bias=True, attn_out_bias=True, attn_sinks=True,
                       sliding_window=4, sliding_layers=(True, False, True), activation="swiglu_oai",
                       swiglu_limit=7.0, moe_bias=True, moe_gating="topk_softmax", n_experts=8, n_experts_used=2,
                       expert_ffn_dim=32),
}
# Q4_K needs rows of 256 values: the same families at dim 256 / expert width 256.
WIDE = {name: replace(cfg, dim=256, ffn_dim=256, head_dim=64, expert_ffn_dim=256) for name, cfg in FAMILIES.items()}


def hook_experts(ref, fast) -> None:
    """hooked_reference for the experts too: ref's expert products see their input rounded as fast's."""
    hooked_reference(ref, fast)
    mods = dict(ref.named_modules())
    for name, m in fast.named_modules():
        if isinstance(m, ExpertLinear) and isinstance(m.qweight, BlockQWeight) and m.qweight.qtype not in DENSE:
            mods[name].register_forward_pre_hook(lambda _m, a: (rounded(a[0]), *a[1:]))


def models(cfg: ModelConfig, wtype: str, router: Q | None = None) -> tuple[Runtime, Runtime, Runtime]:
    """(CpuRuntime on the blocks, CpuEagerRuntime on the same blocks, the dense hooked reference).
    router: a block type for the routers (synthetic_state keeps them dense, as llama-quantize does)."""
    state = quantize_embedding(synthetic_state(cfg, wtype, "cpu", seed=7)[0], wtype)
    for name in [n for n in state if router is not None and "ffn_gate_inp.weight" in n]:
        state[name] = QuantizedTensor(router, torch.from_numpy(quantize_tensor(state[name].float(), router)))
    fast = build_model(cfg, dict(state), "cpu", torch.float32)
    eager = build_model(cfg, dict(state), "cpu", torch.float32, backend=CpuEagerRuntime)
    ref = build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=False, backend=Runtime)
    hook_experts(ref.model, fast.model)
    return fast, eager, ref


def record_routes(model) -> list:
    """Each MoE.route call's experts (N, k), appended in call order (layer order within a step)."""
    calls: list = []
    for blk in model.blk:
        route = blk.moe.route
        blk.moe.route = lambda h, route=route: calls.append(route(h)) or calls[-1]
    return calls


def steps(rt, eager, ref, n_prompt: int, n: int, seed: int = 3):
    """Prompt through each runtime's forward, then one token a step: per step the fast logits, the
    eager logits, the reference logits, the C++ experts (L, k), the eager routing's experts (L, k)."""
    cfg = rt.cfg
    tokens = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    caches = [rt.new_cache(n), eager.new_cache(n), make_cache(cfg, n)]
    assert isinstance(rt, CpuRuntime) and rt.cpp_decoder(caches[0]) is not None
    routes = record_routes(eager.model)
    out = []
    with torch.inference_mode():
        rt.prefill(caches[0], tokens[:, :n_prompt].tolist(), 0)
        eager.prefill(caches[1], tokens[:, :n_prompt].tolist(), 0)
        ref.model(tokens[:, :n_prompt], caches[2], 0)
        for i in range(n_prompt, n):
            routes.clear()
            got = rt.decode(caches[0], tokens[:, i])[:, None]
            chosen = rt.decoder.native.experts()
            want_eager = eager.decode(caches[1], tokens[:, i])[:, None]
            want = ref.model(tokens[:, i:i + 1], caches[2], i)
            eager_experts = torch.stack([e[0].sort().values for _, e in routes])
            out.append((got, want_eager, want, chosen, eager_experts))
    return out


def check_steps(rt, eager, ref, n_prompt=4, n=12):
    for i, (got, want_eager, want, chosen, eager_experts) in enumerate(steps(rt, eager, ref, n_prompt, n)):
        assert torch.equal(chosen, eager_experts), f"step {i}: experts {chosen} vs {eager_experts}"
        assert rel(got, want_eager) < TOL, f"step {i}"  # the same products: rounding flips of the int16 grid only
        assert rel(got, want) < TOL, f"step {i}"


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_decode_steps_match_torch_forward(name, wtype):
    cfg = FAMILIES[name]
    assert cpp_covers(cfg) and runtime_class("cpu", cfg) is CpuRuntime
    check_steps(*models(cfg, wtype))


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_quantized_router(name):
    """A router stored as blocks (the products' rounded input, then the router bias)."""
    fast, eager, ref = models(FAMILIES[name], "Q4_0", router=Q.Q8_0)
    assert isinstance(fast.model.blk[0].moe.ffn_gate_inp.w, BlockQWeight)
    check_steps(fast, eager, ref)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_q4_k_experts(name):
    fast, eager, ref = models(WIDE[name], "Q4_K")
    assert fast.model.blk[0].moe.ffn_gate_exps.qweight.qtype == Q.Q4_K
    check_steps(fast, eager, ref, n_prompt=3, n=7)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_64_equals_reference(name):
    cfg = FAMILIES[name]
    rt, _, ref = models(cfg, "Q4_0")
    assert rt.cpp_decoder(rt.new_cache(80)) is not None
    ids = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    got = greedy(rt, ids, 64)
    assert got == greedy(ref, ids, 64)
    assert len(set(got)) > 4  # not one token repeated: the steps' logits differ


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_moe")
    made = {}

    def get(case: str, kind: str):
        if (case, kind) not in made:
            spec, path = tm.MOE_CASES[case], root / f"{case}-{kind}.gguf"
            if kind == "MXFP4":  # experts MXFP4, the rest Q8_0 (llama.cpp's gpt-oss files: MXFP4_MOE)
                raw = {n: (gguf.quants.quantize(d.reshape(-1, d.shape[-1]), Q.MXFP4).reshape(*d.shape[:-1], -1),
                           Q.MXFP4) for n, d in gguf_tensors(spec).items() if "_exps.weight" in n}
                made[case, kind] = write_gguf(spec, path, Q.Q8_0, raw=raw)
            else:
                made[case, kind] = write_gguf(spec, path, Q[kind])
        return str(made[case, kind])

    return get


@pytest.mark.parametrize("case,kind", [("mixtral", "Q8_0"), ("qwen3_moe", "Q8_0"), ("qwen3_moe_nonorm", "Q8_0"),
                                       ("gpt_oss", "Q8_0"), ("gpt_oss", "MXFP4"), ("qwen3_moe", "MXFP4")])
def test_moe_gguf_decode_steps(moe_files, case, kind):
    """A MoE GGUF through the loader: the C++ steps give the eager forward's and the dense load's logits."""
    path = moe_files(case, kind)
    rt = load_model(path, "cpu").runtime
    eager = load_model(path, "cpu", torch.float32, backend=CpuEagerRuntime).runtime
    ref = load_model(path, "cpu", torch.float32, keep_quantized=False).runtime
    hook_experts(ref.model, rt.model)
    if kind == "MXFP4":
        assert rt.model.blk[0].moe.ffn_up_exps.qweight.qtype == Q.MXFP4
    check_steps(rt, eager, ref, n_prompt=3, n=12)


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_moe_gguf_greedy_64(moe_files, case):
    """Greedy decoding of a quantized MoE file (Q8_0; gpt-oss: MXFP4 experts): the dense load's ids."""
    path = moe_files(case, "MXFP4" if case == "gpt_oss" else "Q8_0")
    lm = load_model(path, "cpu")
    ref = load_model(path, "cpu", torch.float32, keep_quantized=False)
    hook_experts(ref.model, lm.model)
    assert isinstance(lm.runtime, CpuRuntime) and lm.runtime.cpp_decoder(lm.runtime.new_cache(80)) is not None
    ids = torch.randint(0, lm.config.vocab_size, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    got = greedy(lm.runtime, ids, 64)
    assert got == greedy(ref.runtime, ids, 64)
    assert len(set(got)) > 4


def zero_router(rt) -> None:
    """Every layer's router weight zero (its blocks zeroed: scale 0); a router bias 1 at experts 3 and 5."""
    for blk in rt.model.blk:
        r = blk.moe.ffn_gate_inp
        with torch.no_grad():
            (r.weight if r.qweight is None else r.qweight.data).zero_()
            if r.bias is not None:
                r.bias.zero_()
                r.bias[3] = r.bias[5] = 1.0


@pytest.mark.parametrize("name,want", [("mixtral", [0, 1]), ("qwen3_moe", [0, 1, 2, 3]), ("gpt_oss", [3, 5])])
def test_router_ties_take_torch_topk_order(name, want):
    """Router logits all equal (a zero router), or two equal maxima past index 0 (gpt-oss's bias): the
    C++ routing picks what moe.route picks (moe.top_k: larger first, equal values by lower index)."""
    fast, eager, ref = models(FAMILIES[name], "Q8_0")
    for rt in (fast, eager, ref):
        zero_router(rt)
    for got, want_eager, want_ref, chosen, eager_experts in steps(fast, eager, ref, 2, 5):
        assert chosen.tolist() == eager_experts.tolist() == [want] * FAMILIES[name].n_layers
        assert rel(got, want_eager) < TOL and rel(got, want_ref) < TOL


def test_runtime_class_takes_the_cpp_decoder_for_moe():
    for cfg in FAMILIES.values():
        assert runtime_class("cpu", cfg) is CpuRuntime
    dense_oai = replace(BASE, activation="swiglu_oai", swiglu_limit=7.0)  # the clamped GLU off the experts
    gemma4_style = replace(FAMILIES["mixtral"], moe_with_mlp=True)
    for cfg in (dense_oai, gemma4_style):
        assert not cpp_covers(cfg) and runtime_class("cpu", cfg) is CpuEagerRuntime
    assert MoE  # the module the reference runs
