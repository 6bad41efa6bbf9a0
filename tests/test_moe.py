"""Mixture of experts (localllm/moe.py): Mixtral and Qwen3-MoE against transformers.

Oracles: transformers 5.24 on the tiny safetensors folders (tiny_models.MOE_CASES) for logits and for
routing (the experts its routers choose, token by token, layer by layer); our GGUF F32 load equals our
safetensors load of the same weights (transformers' GGUF loader cannot read a Mixtral GGUF); a Q8_0
GGUF against transformers on a folder holding the Q8_0-decoded values (gguf.quants); the row-range
products of quantized weights against the dense product of the decoded rows.
"""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import tiny_models as tm
from tiny_gguf import gguf_tensors, write_gguf
from tiny_hf import hf_config, write_hf_folder
from tiny_raw import random_tensor_data
from tiny_tokenizer import vocab_size
from tiny_weights import make_weights
from localllm.backends.cpu import CpuEagerRuntime
from localllm.cache import make_cache
from localllm.config_hf import config_from_hf
from localllm.kernels.cpu import BlockQWeight, load_extension, pack_for_cpu, row_view
from localllm.kernels.linear import linear_rows
from localllm.load import load_model
from localllm.moe import ExpertLinear
from localllm.moe_weights import HF_MOE_NAMES
from localllm.quantize.decode import dequantize_torch
from localllm.settings import DEFAULT_CPU

pytestmark = pytest.mark.usefixtures("one_thread")

Q = gguf.GGMLQuantizationType
TOL = 1e-3
BATCH, T = 2, 16


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, vocab_size(), (BATCH, T), generator=torch.Generator().manual_seed(4321))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """case -> written checkpoints, on first use: .hf(case), .gguf(case, qtype)."""
    root = tmp_path_factory.mktemp("moe")
    made: dict = {}

    class Files:
        def hf(self, case):
            if (case, "hf") not in made:
                made[case, "hf"] = write_hf_folder(tm.MOE_CASES[case], root / case / "hf")
            return made[case, "hf"]

        def gguf(self, case, qtype=Q.F32):
            if (case, qtype) not in made:
                made[case, qtype] = write_gguf(tm.MOE_CASES[case], root / case / f"{case}-{qtype.name}.gguf", qtype)
            return made[case, qtype]

    return Files()


@torch.inference_mode()
def our_logits(path, tokens, record: list | None = None, **kw) -> torch.Tensor:
    lm = load_model(str(path), "cpu", torch.float32, **kw)
    if record is not None:
        for blk in lm.model.blk:  # record each layer's routing (instance attribute shadows the method)
            blk.moe.route = _recorder(blk.moe.route, record)
    return lm.model(tokens, make_cache(lm.config, tokens.shape[1], batch=tokens.shape[0]), 0)


def _recorder(route, record):
    def wrapped(h):
        weights, experts = route(h)
        record.append((weights, experts))
        return weights, experts
    return wrapped


@torch.inference_mode()
def hf_logits(folder, tokens, record: list | None = None) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if record is not None:  # MixtralTopKRouter / Qwen3MoeTopKRouter: (logits, scores, indices)
        routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        assert len(routers) == model.config.num_hidden_layers
        for r in routers:
            r.register_forward_hook(lambda mod, args, out: record.append((out[1], out[2])))
    return model(tokens).logits.float()


def assert_close(ours, ref, tol=TOL):
    assert ref.std() > 0.1 and torch.isfinite(ref).all()
    diff = (ours - ref).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol}"


# ---- logits and routing against transformers

@pytest.mark.parametrize("case", list(tm.MOE_CASES))
def test_safetensors_matches_transformers(files, tokens, case):
    assert_close(our_logits(files.hf(case), tokens), hf_logits(files.hf(case), tokens))


@pytest.mark.parametrize("case", list(tm.MOE_CASES))
def test_routing_matches_transformers(files, tokens, case):
    """Every token of every layer goes to the experts transformers' router picks, in its order, with
    its weights; and the tiny models spread tokens over at least half the experts of each layer (a test
    of routing at all)."""
    ours, theirs = [], []
    our_logits(files.hf(case), tokens, ours)
    hf_logits(files.hf(case), tokens, theirs)
    spec = tm.MOE_CASES[case]
    assert len(ours) == len(theirs) == spec.n_layers
    for (w, e), (w_ref, e_ref) in zip(ours, theirs):
        assert e.shape == e_ref.shape == (BATCH * T, spec.n_experts_used)
        assert torch.equal(e, e_ref)
        torch.testing.assert_close(w, w_ref.float(), rtol=1e-5, atol=1e-6)
        assert len(set(e.flatten().tolist())) >= spec.n_experts // 2


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_gguf_equals_safetensors(files, tokens, case):
    """GGUF F32 (stacked ffn_*_exps, Mixtral as `llama` with q/k permuted) loads to the safetensors model."""
    assert_close(our_logits(files.gguf(case), tokens), our_logits(files.hf(case), tokens), tol=1e-5)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda t: t.name)
def test_per_expert_gguf_layout(files, tokens, tmp_path, qtype):
    """Early Mixtral GGUFs store each expert as its own tensor (blk.N.ffn_gate.E.weight): they load to the
    model of the stacked layout."""
    path = write_gguf(tm.MOE_CASES["mixtral"], tmp_path / "old.gguf", qtype, per_expert=True)
    assert "blk.1.ffn_down.7.weight" in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert_close(our_logits(path, tokens), our_logits(files.gguf("mixtral", qtype), tokens), tol=1e-5)
    if qtype == Q.F32:  # and requantize (llama.cpp's rules read their layer from the names)
        from localllm.commands.quantize_cmd import quantize_model

        out = tmp_path / "q.gguf"
        quantize_model(str(path), out, "Q8_0", progress=False, device="cpu")
        assert_close(our_logits(out, tokens), our_logits(files.gguf("mixtral", Q.Q8_0), tokens), tol=1e-5)


def test_sharded_folder(files, tokens, tmp_path):
    """Experts spread over shards (save_pretrained's split) stack as from one file."""
    folder = write_hf_folder(replace(tm.MOE_CASES["qwen3_moe"], shards=3), tmp_path / "sharded")
    assert len(list(folder.glob("*.safetensors"))) == 3
    assert_close(our_logits(folder, tokens), our_logits(files.hf("qwen3_moe"), tokens), tol=0)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda t: t.name)
def test_qwen3_moe_gguf_matches_transformers_gguf_loader(files, tokens, qtype):
    """transformers reads a qwen3moe GGUF itself (its Qwen2MoeTensorProcessor splits ffn_*_exps and
    dequantizes with gguf): a second oracle for our reading of the stacked expert tensors. Its GGUF
    config mapping skips expert_feed_forward_length, so the folder's config.json comes along."""
    from transformers import AutoConfig

    path = files.gguf("qwen3_moe", qtype)
    config = AutoConfig.from_pretrained(str(files.hf("qwen3_moe")))
    with torch.inference_mode():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                     dtype=torch.float32)
        ref = model.eval()(tokens).logits.float()
    assert_close(our_logits(path, tokens), ref)


def test_qwen3_moe_gguf_renormalises_as_llama_cpp(files, tokens, tmp_path):
    """A Qwen3-MoE GGUF carries no norm_topk_prob (the converter writes none; llama.cpp's qwen3moe graph
    renormalises): it loads renormalised, unless `expert_weights_norm` says false."""
    spec = tm.MOE_CASES["qwen3_moe_nonorm"]
    normed = write_hf_folder(replace(spec, norm_topk=True), tmp_path / "normed")
    assert_close(our_logits(files.gguf("qwen3_moe_nonorm"), tokens), our_logits(normed, tokens), tol=1e-5)
    assert (our_logits(normed, tokens) - our_logits(files.hf("qwen3_moe_nonorm"), tokens)).abs().max() > 0.05


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_q8_0_gguf_matches_transformers(files, tokens, case, tmp_path):
    """Q8_0 expert tensors kept as blocks (the CPU's C++ products on each expert's rows) against
    transformers on a folder of the decoded values (router F32, as the converter keeps it)."""
    spec = tm.MOE_CASES[case]
    decoded = {k: _q8_roundtrip(v, transposed=k.endswith(("experts.gate_up_proj", "experts.down_proj")))
               if v.ndim >= 2 and not k.endswith(("bias", ".gate.weight", "router.weight")) else v
               for k, v in make_weights(spec).items()}
    folder = write_hf_folder(spec, tmp_path / "decoded", weights=decoded)
    path = files.gguf(case, Q.Q8_0)
    assert_close(our_logits(path, tokens), hf_logits(folder, tokens))


def _q8_roundtrip(w: torch.Tensor, transposed: bool = False, qtype: Q = Q.Q8_0) -> torch.Tensor:
    """Blocks run along rows, so quantizing the stacked, q/k-permuted or gate/up-split GGUF tensor
    decodes to the same values as quantizing each HF matrix's rows; gpt-oss stores its experts
    transposed (x @ W): their GGUF rows are its columns."""
    if transposed:
        return _q8_roundtrip(w.transpose(-1, -2).contiguous(), qtype=qtype).transpose(-1, -2).contiguous()
    raw = gguf.quants.quantize(w.numpy().reshape(-1, w.shape[-1]), qtype)
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype)).reshape(w.shape)


@pytest.mark.parametrize("case", ["gpt_oss", "qwen3_moe"])
def test_mxfp4_experts_match_transformers(files, tokens, case, tmp_path):
    """Expert tensors in MXFP4 (as llama.cpp's gpt-oss files hold them; the rest F32) against
    transformers on a folder of the decoded values: the MXFP4 rows of each expert through the CPU's
    products, from the common quantized paths."""
    spec = tm.MOE_CASES[case]
    exps = {n: (gguf.quants.quantize(d.reshape(-1, d.shape[-1]), Q.MXFP4).reshape(*d.shape[:-1], -1), Q.MXFP4)
            for n, d in gguf_tensors(spec).items() if "_exps.weight" in n}
    path = write_gguf(spec, tmp_path / "mxfp4.gguf", raw=exps)
    expert = ("experts.gate_up_proj", "experts.down_proj", "_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")
    decoded = {k: _q8_roundtrip(v, transposed=k.endswith(expert[:2]), qtype=Q.MXFP4)
               if "experts" in k and k.endswith(expert) else v for k, v in make_weights(spec).items()}
    folder = write_hf_folder(spec, tmp_path / "decoded", weights=decoded)
    lm = load_model(str(path), "cpu", torch.float32)
    assert lm.model.blk[0].moe.ffn_up_exps.qweight.qtype == Q.MXFP4
    assert_close(our_logits(path, tokens), hf_logits(folder, tokens))


def test_decode_runs_only_the_chosen_experts(files, tokens, monkeypatch):
    """A one-token step of the torch forward runs k experts per layer (each product on its own rows),
    never all E (CpuEagerRuntime: CpuRuntime's steps run in C++, tests/test_cpu_moe.py)."""
    spec = tm.MOE_CASES["qwen3_moe"]
    lm = load_model(str(files.gguf("qwen3_moe", Q.Q8_0)), "cpu", torch.float32, backend=CpuEagerRuntime)
    assert isinstance(lm.model.blk[0].moe.ffn_down_exps.qweight, BlockQWeight)
    calls: list[int] = []
    forward = ExpertLinear.forward
    monkeypatch.setattr(ExpertLinear, "forward", lambda self, x, e: calls.append(e) or forward(self, x, e))
    with torch.inference_mode():
        cache = make_cache(lm.config, 8)
        lm.model(tokens[:1, :4], cache, 0)
        calls.clear()
        lm.runtime.decode(cache, tokens[0, 4:5])
    assert len(calls) == 3 * spec.n_experts_used * spec.n_layers


# ---- names and configs

def test_hf_moe_names_are_gguf_s():
    """Our HF -> GGUF table for expert tensors says what gguf's TensorNameMap says (per architecture)."""
    archs = {"block_sparse_moe": gguf.MODEL_ARCH.LLAMA, "mlp.gate": gguf.MODEL_ARCH.QWEN3MOE,
             "mlp.experts.{e}": gguf.MODEL_ARCH.QWEN3MOE, "mlp.router": gguf.MODEL_ARCH.GPT_OSS,
             "mlp.experts.down_proj": gguf.MODEL_ARCH.GPT_OSS, "mlp.experts.gate_up": gguf.MODEL_ARCH.GPT_OSS,
             "self_attn": gguf.MODEL_ARCH.GPT_OSS}
    for key, targets in HF_MOE_NAMES.items():
        arch = next(a for part, a in archs.items() if part in key)
        name_map = gguf.get_tensor_name_map(arch, 4)
        base = key.replace("{i}", "3").replace(".{e}", "").removesuffix(".weight").removesuffix(".bias")
        base = base.removesuffix("_bias").removesuffix("_blocks").removesuffix("_scales")  # MXFP4 pairs
        for name, _ in targets:
            if "gate_up_proj" in base:  # gpt-oss's interleaved pair: the converter names each half
                base_half = base.replace("gate_up_proj", "gate_proj" if "gate_exps" in name else "up_proj")
                assert name_map.get_name(base_half) == name.replace("{i}", "3").rsplit(".", 1)[0], key
            else:
                assert name_map.get_name(base) == name.replace("{i}", "3").rsplit(".", 1)[0], key


@pytest.mark.parametrize("case", ["mixtral", "gpt_oss"])
def test_info_counts_the_experts(files, case):
    """`localllm info`: the folder's parameters (per-expert keys, gpt-oss's stacked ones) = the GGUF's."""
    from localllm.commands.info import model_info

    folder, path = model_info(str(files.hf(case))), model_info(str(files.gguf(case)))
    assert folder["parameters"] == path["parameters"]
    spec = tm.MOE_CASES[case]
    assert folder["experts"] == path["experts"] == f"{spec.n_experts} ({spec.n_experts_used} used, expert ffn {spec.expert_ffn_dim})"


def test_qwen3_moe_dense_layers_are_refused():
    base = hf_config(tm.MOE_CASES["qwen3_moe"])
    assert config_from_hf(base).n_experts == 16
    with pytest.raises(Exception, match="mlp_only_layers"):
        config_from_hf(base | {"mlp_only_layers": [0]})


def test_quantized_gpt_oss_config_other_than_mxfp4_is_one_line():
    """The released files' "mxfp4" is read (tests/test_gpt_oss_mxfp4.py); another method is refused by name."""
    from localllm.errors import LocalLLMError

    base = hf_config(tm.MOE_CASES["gpt_oss"])
    assert config_from_hf(base | {"quantization_config": {"quant_method": "mxfp4"}}).n_experts == 8
    with pytest.raises(LocalLLMError, match="fp8"):
        config_from_hf(base | {"quantization_config": {"quant_method": "fp8"}})


def test_gpt_oss_config_bad_values_are_one_line():
    """Found by the fuzzer on the MXFP4 seed: a non-string layer type, a rope base of 1 under YaRN, a clamp
    limit beyond float range."""
    from localllm.errors import LocalLLMError

    base = hf_config(tm.MOE_CASES["gpt_oss"])
    with pytest.raises(LocalLLMError, match="layer_types"):
        config_from_hf(base | {"layer_types": [[], "full_attention", "sliding_attention"]})
    with pytest.raises(LocalLLMError, match="rope base 1.0 with YaRN"):
        config_from_hf(base | {"rope_theta": 1})
    with pytest.raises(LocalLLMError, match="swiglu_limit"):
        config_from_hf(base | {"swiglu_limit": 1e308})


def test_missing_expert_is_one_line(files, tmp_path):
    from safetensors.torch import load_file, save_file

    from localllm.errors import LocalLLMError

    folder = tmp_path / "m"
    import shutil

    shutil.copytree(files.hf("mixtral"), folder)
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LocalLLMError, match="expert 5 is missing"):
        load_model(str(folder), "cpu", torch.float32)


# ---- products on a row range of a quantized weight (one expert's rows)

@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q3_K, Q.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [(16, 32), (8, 12), (5, 13)])
@pytest.mark.parametrize("cpp", [True, False], ids=["cpp", "torch"])
def test_block_weight_row_range(qtype, rows, cpp):
    """BlockQWeight rows [n0, n1) (tiled or raw, C++ or the torch fallback) against the dense product
    of the decoded rows; a tiled range off a tile boundary decodes only its rows."""
    rng = np.random.default_rng(3)
    raw = torch.from_numpy(np.ascontiguousarray(random_tensor_data(qtype, 48, 256, rng)).view(np.uint8).reshape(48, -1))
    w = BlockQWeight.from_blocks(raw, qtype, torch.float32)
    if cpp:
        w = pack_for_cpu(w, load_extension(DEFAULT_CPU.cache_dir))
    n0, n1 = rows
    dense = dequantize_torch(raw, qtype)[n0:n1]
    for t in (1, 3, 70):  # decode, a few rows, a prompt past QMATVEC_MAX_ROWS
        x = torch.randn(t, 256, generator=torch.Generator().manual_seed(t))
        ref = x @ dense.T
        got = linear_rows(x, w, n0, n1)
        assert got.shape == ref.shape
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 2e-4
    view = row_view(w, n0, n1)
    assert view is None or view.data.data_ptr() >= w.data.data_ptr()  # a view: no copy
    if view is not None and view.tiled:
        assert view.data.untyped_storage().data_ptr() == w.data.untyped_storage().data_ptr()


def test_dense_row_range():
    w = torch.randn(6, 8, 16)
    x = torch.randn(3, 16)
    b = torch.randn(6, 8)
    lin = ExpertLinear(6, 16, 8, bias=True)
    lin.weight.data, lin.bias.data = w, b
    for e in range(6):
        torch.testing.assert_close(lin(x, e), x @ w[e].T + b[e])
    flat = w.reshape(48, 16)
    torch.testing.assert_close(linear_rows(x, flat, 16, 24), x @ w[2].T)


# ---- gpt-oss: the tiny case exercises what it claims to

@pytest.mark.parametrize("change", ["no_yarn", "truncate", "no_sliding", "no_sinks"])
def test_gpt_oss_features_matter(files, tokens, change, tmp_path):
    """Each gpt-oss feature changes transformers' logits on the tiny case (which we match to 1e-3 above):
    YaRN (divisors and attention factor), its untruncated correction range, the sliding layers, the sinks."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(files.hf("gpt_oss"), tmp_path / change)
    cfg = json.loads((folder / "config.json").read_text())
    if change == "no_yarn":  # (no rope_scaling at all would be GptOssConfig's default YaRN)
        cfg["rope_scaling"] = None
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    elif change == "truncate":
        cfg["rope_scaling"]["truncate"] = True
    elif change == "no_sliding":
        cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    else:
        state = load_file(str(folder / "model.safetensors"))
        state = {k: torch.full_like(v, -1e4) if k.endswith("sinks") else v for k, v in state.items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg))
    changed = hf_logits(folder, tokens)
    assert (changed - hf_logits(files.hf("gpt_oss"), tokens)).abs().max() > 1e-3
    assert_close(our_logits(folder, tokens), changed)


@pytest.mark.parametrize("qtype,tol", [(Q.F32, 1e-5), (Q.Q8_0, 1e-3)], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("case", list(tm.MOE_CASES))
def test_decode_steps_equal_one_pass(files, tokens, case, qtype, tol):
    """Prefill then one-token steps (the cache, sliding masks past the window, one token's routing)
    give the logits of one pass over the whole sequence (Q8_0: the C++ products' int16 activations
    sum in another order for one row than for many)."""
    lm = load_model(str(files.gguf(case, qtype)), "cpu", torch.float32)
    seq = tokens[:1]
    with torch.inference_mode():
        full = lm.model(seq, make_cache(lm.config, T), 0)[0]
        cache = make_cache(lm.config, T)
        steps = [lm.runtime.prefill(cache, [seq[0, :10].tolist()])[0]]
        steps += [lm.runtime.decode(cache, seq[0, t:t + 1])[0].clone() for t in range(10, T - 1)]
    torch.testing.assert_close(torch.stack(steps), full[9:T - 1], rtol=0, atol=tol)


def test_expected_shapes_match_the_model():
    """validate.expected_shapes (the loader's tensor set) is exactly what the MoE Transformer holds."""
    from localllm.model import Transformer
    from localllm.validate import expected_shapes
    from localllm.weights import gguf_name

    for case in tm.MOE_CASES:
        cfg = config_from_hf(hf_config(tm.MOE_CASES[case]))
        with torch.device("meta"):
            model = Transformer(cfg)
        built = {gguf_name(n): tuple(t.shape) for n, t in model.state_dict().items()}
        assert built == expected_shapes(cfg), case


# ---- llama.cpp's quantization rules for expert models (quantize/presets.py, llama-quant.cpp)

def _moe_tensors(n_layers: int, per_expert: int = 0, biases: bool = False) -> list[tuple[str, tuple]]:
    """A Mixtral-like file's tensors (numpy order); per_expert: the old one-tensor-per-expert layout."""
    out = [("token_embd.weight", (100, 256)), ("output.weight", (100, 256))]
    for i in range(n_layers):
        p = f"blk.{i}."
        out += [(p + n, (256, 256)) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")]
        out += [(p + "attn_norm.weight", (256,)), (p + "ffn_norm.weight", (256,)), (p + "ffn_gate_inp.weight", (8, 256))]
        if per_expert:
            out += [(p + f"ffn_{w}.{e}.weight", (256, 256)) for e in range(per_expert) for w in ("gate", "down", "up")]
        else:
            out += [(p + f"ffn_{w}_exps.weight", (8, 256, 256)) for w in ("gate", "down", "up")]
        if biases:
            out += [(p + f"ffn_{w}_exps.bias", (8, 256)) for w in ("gate", "down", "up")]
    return out


def _types(tensors, preset: str, n_expert: int, n_layers: int) -> dict[str, Q | None]:
    from localllm.quantize.presets import PRESETS, ModelShape, preset_types

    shape = ModelShape("llama", n_layers, 32, 8, n_expert)
    return dict(zip([n for n, _ in tensors], preset_types(PRESETS[preset], tensors, shape)))


def test_eight_expert_rules():
    tensors = _moe_tensors(8, biases=True)
    types = _types(tensors, "Q4_K_M", 8, 8)
    assert types["blk.3.attn_v.weight"] == types["blk.3.attn_k.weight"] == Q.Q8_0
    assert types["blk.3.attn_output.weight"] == Q.Q5_K and types["blk.3.attn_q.weight"] == Q.Q4_K
    assert types["blk.3.ffn_gate_inp.weight"] is None and types["blk.3.ffn_down_exps.bias"] is None
    # ffn_down by layer: use_more_bits(i, 8) for i = 0..7 -> layers 0, 2, 5, 7 (and 7 >= 7 * 8 // 8)
    more = {i for i in range(8) if types[f"blk.{i}.ffn_down_exps.weight"] == Q.Q6_K}
    assert more == {i for i in range(8) if i < 1 or i >= 7 or (i - 1) % 3 == 2}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.ffn_up_exps.weight"] == Q.Q4_K
    q2 = _types(tensors, "Q2_K", 8, 8)
    assert q2["blk.3.attn_output.weight"] == Q.Q5_K and q2["blk.3.attn_v.weight"] == Q.Q8_0
    assert q2["blk.3.ffn_down_exps.weight"] == Q.Q3_K
    # not 8 experts (Qwen3-MoE's 128, gpt-oss's 32): the dense rules
    dense = _types(tensors, "Q4_K_M", 128, 8)
    assert dense["blk.3.attn_k.weight"] == Q.Q4_K and dense["blk.3.attn_output.weight"] == Q.Q4_K


def test_per_expert_layout_reads_the_layer_from_the_name():
    """The old Mixtral GGUF layout (blk.N.ffn_down.E.weight): llama.cpp's layer_info takes N, not a counter."""
    tensors = _moe_tensors(16, per_expert=8)
    types = _types(tensors, "Q4_K_S", 8, 16)
    # Q4_K_S: ffn_down of the first eighth of the layers (0, 1) Q5_K
    for i in range(16):
        assert {types[f"blk.{i}.ffn_down.{e}.weight"] for e in range(8)} == {Q.Q5_K if i < 2 else Q.Q4_K}


# ---- quantize: a safetensors MoE folder to GGUF (the converter's layout), and a MoE GGUF requantized

@pytest.mark.parametrize("case", list(tm.MOE_CASES))
def test_quantize_folder_to_gguf(files, tokens, case, tmp_path):
    """`localllm quantize FOLDER Q8_0`: experts stacked (gpt-oss's gate/up split), routers and biases
    kept, metadata as the converter writes it; the file loads to the tiny Q8_0 GGUF's logits, which
    gguf.quants quantized from the same values (Qwen3-MoE without norm_topk_prob: a GGUF renormalises,
    as llama.cpp does, so it is compared with its own GGUF)."""
    from localllm.commands.quantize_cmd import quantize_model

    out = tmp_path / "q.gguf"
    quantize_model(str(files.hf(case)), out, "Q8_0", progress=False, device="cpu")
    ours = gguf.GGUFReader(str(out))
    ref = gguf.GGUFReader(str(files.gguf(case, Q.Q8_0)))
    assert {t.name: t.tensor_type for t in ours.tensors} == {t.name: t.tensor_type for t in ref.tensors}
    assert_close(our_logits(out, tokens), our_logits(files.gguf(case, Q.Q8_0), tokens), tol=1e-5)


def test_requantize_moe_gguf(files, tokens, tmp_path):
    """A MoE GGUF (3-D expert tensors) requantized F32 -> Q8_0 equals the Q8_0 file written from the weights."""
    from localllm.commands.quantize_cmd import quantize_model

    out = tmp_path / "q.gguf"
    quantize_model(str(files.gguf("qwen3_moe")), out, "Q8_0", progress=False, device="cpu")
    assert_close(our_logits(out, tokens), our_logits(files.gguf("qwen3_moe", Q.Q8_0), tokens), tol=1e-5)
