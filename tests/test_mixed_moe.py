"""Mixed precision (`--target-bpw` / `--target-size`) and the imatrix on mixture-of-experts models.

An expert stack (E, F, C) is one tensor of one type, its E * F rows quantized like a 2-D weight's; its
imatrix is per expert (E, C), from the tokens routed to each (llama.cpp's MUL_MAT_ID statistics), and
each expert's rows are rounded with their own row of it.

Oracles: quantize.plan's total_bpw and the file's own size (targets); the gguf package's reader and
decoder (every expert's slice of the written file against that expert's F32 values); the F32 model's
logits; transformers' own routing and expert inputs (the imatrix); per-expert quantize_tensor calls
(the grouped importance); calibrate.weighted_error, the error the imatrix measures.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import tiny_models as tm
from tiny_gguf import write_gguf
from tiny_hf import write_hf_folder
from cli_helpers import assert_one_error
from cli_helpers import invoke_quantize as invoke
from localllm import calibrate as C
from localllm import imatrix as IM
from localllm import mixed
from localllm.cache import make_cache
from localllm.imatrix_files import ImatrixStats
from localllm.commands.quantize_cmd import quantize_model
from localllm.load import load_model
from localllm.moe import route
from localllm.quantize import dequantize_torch, quantize_tensor
from localllm.quantize.plan import total_bpw
from localllm.weights import gguf_name

Q = gguf.GGMLQuantizationType
IDS = torch.tensor([[1, 5, 9, 30, 40, 100, 200, 300, 7, 64, 128, 250, 3, 17, 90, 333]])
EXPERT_KINDS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: small passes run faster on one thread

# case -> (target bits per weight, bound on ||logits - F32 logits|| / ||F32 logits|| over IDS). Measured
# at these targets: mixtral 0.161, qwen3_moe 0.061, gpt_oss 0.123 (Q8_0 presets 0.064, 0.016, 0.083;
# Q4_0 presets 0.39, 0.24, 0.64: tiny random routers flip easily); experts misplaced in the file: ~1.
TARGETS = {"mixtral": (6.0, 0.25), "qwen3_moe": (6.0, 0.12), "gpt_oss": (7.5, 0.2)}


@pytest.fixture(scope="module")
def moe_sources(tmp_path_factory):
    """case -> {"gguf": F32 GGUF, "hf": safetensors folder}, written on first use."""
    root, made = tmp_path_factory.mktemp("mixed_moe"), {}

    def get(case: str, kind: str):
        if (case, kind) not in made:
            spec = tm.MOE_CASES[case]
            made[case, kind] = (write_gguf(spec, root / case / "f32.gguf") if kind == "gguf"
                                else write_hf_folder(spec, root / case / "hf"))
        return made[case, kind]
    return get


@torch.inference_mode()
def logits(path) -> torch.Tensor:
    lm = load_model(str(path), "cpu", torch.float32)
    return lm.model(IDS, make_cache(lm.config, IDS.shape[1]), 0)[0].float()


def f32_experts(path) -> dict[str, np.ndarray]:
    """GGUF name -> (E, F, C) float32 expert stacks of the F32 source (GGUF file, or folder via its load)."""
    lm = load_model(str(path), "cpu", torch.float32, keep_quantized=False)
    return {gguf_name(n): p.detach().numpy() for n, p in lm.model.named_parameters()
            if n.split(".")[-2] in EXPERT_KINDS + ("ffn_gate_up_exps",) and n.endswith(".weight")}


def check_experts_in_file(out, source_experts: dict[str, np.ndarray], plan) -> None:
    """Each expert stack as the gguf package reads it back: the plan's type, shape (E, F, C), and every
    expert's slice close to that expert's own F32 values (much closer than to any other expert's)."""
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    types = {r.name: r.target for r in plan}
    assert set(source_experts) <= set(types)
    for name, w in source_experts.items():
        t = tensors[name]
        assert t.tensor_type == types[name] and t.tensor_type in mixed.candidates(w.shape[-1]), name
        back = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
        for e in range(w.shape[0]):
            err = np.linalg.norm(back[e] - w[e]) / np.linalg.norm(w[e])
            other = np.linalg.norm(back[e] - w[(e + 1) % w.shape[0]]) / np.linalg.norm(w[e])
            assert err < 0.1 and err < other / 5, (name, e, err, other)


# ---- targets -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gguf", "hf"])
@pytest.mark.parametrize("case", list(TARGETS))
def test_target_bpw_moe(moe_sources, tmp_path, case, kind):
    """Used to fail with KeyError 'blk.0.moe.ffn_gate_exps.weight' (no Fisher diagonal for 3-D stacks)."""
    target, bound = TARGETS[case]
    src = moe_sources(case, kind)
    out = tmp_path / "mixed.gguf"
    result = quantize_model(str(src), out, None, target_bpw=target, progress=False)
    bpw = total_bpw(result.plan)
    assert target - 0.02 <= bpw <= target, bpw
    experts = [r for r in result.plan if r.name.endswith("_exps.weight")]
    assert len(experts) == 3 * tm.MOE_CASES[case].n_layers and all(r.note == "" for r in experts)
    assert len({r.target for r in result.plan if r.note != "kept"}) > 1  # mixed, not one type
    check_experts_in_file(out, f32_experts(src), result.plan)
    ref, ours = logits(src), logits(out)
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < bound, rel


def test_target_size_moe(moe_sources, tmp_path):
    src = moe_sources("qwen3_moe", "gguf")
    target = int(src.stat().st_size * 0.22)  # ~6.5 bits per weight of the F32 file's 32
    out = tmp_path / "sized.gguf"
    result = quantize_model(str(src), out, None, target_size=target, progress=False)
    assert target * 0.99 <= out.stat().st_size <= target, (out.stat().st_size, target)
    check_experts_in_file(out, f32_experts(src), result.plan)


def test_dry_run_lists_the_experts(moe_sources):
    src = moe_sources("mixtral", "gguf")
    result = invoke(src, "--dry-run", "--target-bpw", "6")
    assert result.exit_code == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.strip()}
    for i in range(tm.MOE_CASES["mixtral"].n_layers):
        for k in EXPERT_KINDS:
            row = rows[f"blk.{i}.{k}.weight"]
            assert row[1:4] == ["[64,", "64,", "8]"] and row[4] == "F32", row  # GGUF order [C, F, E]
            assert Q[row[5]] in mixed.candidates(64), row


# ---- the imatrix of experts ----------------------------------------------------------------------


def hf_expert_imatrix(folder, chunks) -> dict[str, torch.Tensor]:
    """Per-expert mean x^2 of the inputs of each expert's gate/up and down products in transformers'
    own forward pass: its routing (top_k_index handed to the experts module), its weights and act_fn."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}

    def hook(mod, args, layer):
        h, top = args[0].double(), args[1]
        E = mod.gate_up_proj.shape[0]
        for kind in EXPERT_KINDS:
            sums.setdefault(f"blk.{layer}.{kind}.weight", torch.zeros(E, mod.gate_up_proj.shape[-1] if kind != "ffn_down_exps"
                                                                     else mod.down_proj.shape[-1], dtype=torch.float64))
            counts.setdefault(f"blk.{layer}.{kind}.weight", torch.zeros(E, dtype=torch.float64))
        for e in range(E):
            x = h[(top == e).any(-1)]
            gate, up = torch.nn.functional.linear(x, mod.gate_up_proj[e].double()).chunk(2, dim=-1)
            a = mod.act_fn(gate) * up
            for kind, v in (("ffn_gate_exps", x), ("ffn_up_exps", x), ("ffn_down_exps", a)):
                sums[f"blk.{layer}.{kind}.weight"][e] += v.pow(2).sum(0)
                counts[f"blk.{layer}.{kind}.weight"][e] += v.shape[0]

    hooks = [m.register_forward_pre_hook(lambda mod, args, layer=int(n.split(".")[2]): hook(mod, args, layer))
             for n, m in model.named_modules() if n.endswith("mlp.experts") or n.endswith("block_sparse_moe.experts")]
    assert hooks
    with torch.inference_mode():
        for chunk in chunks:
            model(torch.tensor([chunk]))
    for h in hooks:
        h.remove()
    return {n: torch.where(counts[n][:, None] > 0, s / counts[n].clamp(min=1)[:, None], 1.0) for n, s in sums.items()}


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
def test_expert_imatrix_matches_transformers(moe_sources, case):
    folder = moe_sources(case, "hf")
    lm = load_model(str(folder), "cpu", torch.float32)
    chunks = [list(range(3, 43)), list(range(200, 240))]
    ours, ref = IM.collect_imatrix(lm.model, chunks), hf_expert_imatrix(folder, chunks)
    spec = tm.MOE_CASES[case]
    assert set(ref) <= set(ours) and len(ref) == 3 * spec.n_layers
    for name, v in ref.items():
        assert ours[name].shape == (spec.n_experts, spec.expert_ffn_dim if "down" in name else spec.dim), name
        assert ours[name].dtype == torch.float32
        torch.testing.assert_close(ours[name].double(), v, rtol=1e-4, atol=1e-7, msg=name)


def test_imatrix_refuses_a_forward_that_skips_the_experts(moe_sources):
    # CUDA's prompt ops run the experts as grouped products, not through each ExpertLinear: statistics
    # recorded there would silently lack the expert stacks (quantize then encodes them without an
    # imatrix); the recorder refuses such a model, naming the backend to load instead
    from dataclasses import replace

    from localllm.model import TORCH_OPS
    from localllm.runtime import Runtime

    class GroupedExperts(Runtime):  # a backend whose MoE op is not the reference forward
        ops = replace(TORCH_OPS, moe=lambda moe, h: moe(h))

    path = str(moe_sources("mixtral", "gguf"))
    grouped = load_model(path, "cpu", torch.float32, keep_quantized=False, backend=GroupedExperts)
    with pytest.raises(ValueError, match="backend=Runtime"):
        IM.collect_imatrix(grouped.model, [[5, 9]])
    im = IM.collect_imatrix(load_model(path, "cpu", torch.float32, keep_quantized=False, backend=Runtime).model,
                            [[5, 9]])
    assert "blk.0.ffn_gate_exps.weight" in im


def test_unrouted_expert_gets_ones(moe_sources):
    """Two tokens reach at most 4 of 8 experts: the others' rows are 1 (llama-quantize's zero count)."""
    lm = load_model(str(moe_sources("mixtral", "gguf")), "cpu", torch.float32)
    im = IM.collect_imatrix(lm.model, [[5, 9]])
    # the experts layer 0 routes to: its input is the normed embedding after attention; recompute it
    seen = {}
    hook = lm.model.blk[0].moe.register_forward_pre_hook(lambda mod, args: seen.setdefault("h", args[0]))
    lm.model(torch.tensor([[5, 9]]), make_cache(lm.config, 2), 0)
    hook.remove()
    used = set(route(lm.config, lm.model.blk[0].moe.ffn_gate_inp(seen["h"].reshape(2, -1)))[1].flatten().tolist())
    v = im["blk.0.ffn_gate_exps.weight"]
    assert 0 < len(used) < 8
    for e in range(8):
        assert torch.equal(v[e], torch.ones(v.shape[1])) == (e not in used), e


# ---- using it ------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_0, Q.Q3_K])
def test_grouped_importance_is_per_expert_quantization(qtype):
    """(E, C) importance on (E * F, C) rows encodes exactly as E calls, expert e's rows with row e."""
    g = torch.Generator().manual_seed(0)
    E, F, cols = 4, 6, 256
    w = torch.randn(E, F, cols, generator=g)
    imp = torch.rand(E, cols, generator=g) * 3
    whole = quantize_tensor(w.reshape(-1, cols), qtype, imp)
    parts = np.concatenate([quantize_tensor(w[e], qtype, imp[e]) for e in range(E)])
    assert np.array_equal(whole, parts)
    assert not np.array_equal(whole, quantize_tensor(w.reshape(-1, cols), qtype, imp.mean(0)))
    with pytest.raises(ValueError, match="importance"):
        quantize_tensor(w.reshape(-1, cols)[:-1], qtype, imp)  # 23 rows in 4 groups
    with pytest.raises(ValueError, match="importance"):
        quantize_tensor(w.reshape(-1, cols), qtype, imp[:, :128])


def test_imatrix_changes_and_improves_the_experts(moe_sources, tmp_path):
    """Q4_0 of the tiny Mixtral with its calibration imatrix: the expert tensors' bytes change, and the
    error the imatrix measures (per expert, with its own row) drops for every expert stack, and also
    against the same imatrix pooled over experts (one (C,) row for all)."""
    src = moe_sources("mixtral", "gguf")
    lm = load_model(str(src), "cpu", torch.float32, keep_quantized=False)
    chunks = C.calibration_chunks(lm.tokenizer, C.calibration_text(), 64, 4)
    im = IM.collect_imatrix(lm.model, chunks)
    pooled = {n: v.mean(0) if v.dim() == 2 else v for n, v in im.items()}
    files = {}
    for label, imatrix in (("none", None), ("experts", im), ("pooled", pooled)):
        files[label] = tmp_path / f"{label}.gguf"
        quantize_model(str(src), files[label], "Q4_0", imatrix=imatrix, progress=False)
    read = {label: {t.name: t for t in gguf.GGUFReader(p).tensors} for label, p in files.items()}
    weights = f32_experts(src)
    errors = {label: 0.0 for label in files}
    for name, w in weights.items():
        raw = {label: np.array(r[name].data) for label, r in read.items()}  # (E, F, row bytes)
        assert all(r[name].tensor_type == Q.Q4_0 for r in read.values())
        assert not np.array_equal(raw["none"], raw["experts"]), name
        err = {label: C.weighted_error(torch.from_numpy(w), dequantize_torch(
            torch.from_numpy(r.reshape(-1, r.shape[-1])), Q.Q4_0).reshape(w.shape), im[name]) for label, r in raw.items()}
        assert err["experts"] < err["none"], (name, err)
        for label in errors:
            errors[label] += err[label]
    assert errors["experts"] < errors["pooled"] < errors["none"], errors


def test_weighted_error_per_expert():
    g = torch.Generator().manual_seed(1)
    w, w_hat, imp = torch.randn(3, 5, 32, generator=g), torch.randn(3, 5, 32, generator=g), torch.rand(3, 32, generator=g)
    want = sum(C.weighted_error(w[e], w_hat[e], imp[e]) for e in range(3))
    assert C.weighted_error(w, w_hat, imp) == pytest.approx(want, rel=1e-12)
    assert C.weighted_error(w.reshape(15, 32), w_hat.reshape(15, 32), imp) == pytest.approx(want, rel=1e-12)


def test_imatrix_file_of_a_moe_model(moe_sources, tmp_path):
    """--imatrix FILE on a MoE model: measured and saved with the per-expert rows, read back equal, and
    used by the encoders (the preset path)."""
    src = moe_sources("qwen3_moe", "gguf")
    path = tmp_path / "moe.imatrix"
    out = tmp_path / "q.gguf"
    quantize_model(str(src), out, "Q4_0", imatrix_file=path, progress=False)
    back, meta = IM.load_imatrix(path, load_model(str(src), "cpu", torch.float32).model)
    spec = tm.MOE_CASES["qwen3_moe"]
    assert back["blk.1.ffn_down_exps.weight"].shape == (spec.n_experts, spec.expert_ffn_dim)
    again = tmp_path / "again.gguf"
    quantize_model(str(src), again, "Q4_0", imatrix_file=path, progress=False)  # read, not measured
    assert again.read_bytes() == out.read_bytes()


# ---- MXFP4 experts (gpt-oss as released) ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_mxfp4_experts_kept_under_a_target(tmp_path, kind):
    """gpt-oss's MXFP4 experts: keeping them costs 4.25 bits per weight and no loss, so no re-rounding
    to another type is better (rows of 64 and 32 values take no K-quant): every expert stack stays
    MXFP4, its bytes copied from the source; the rest is allocated to hit the target."""
    import tiny_mxfp4 as mx

    src = (mx.write_mxfp4_gguf(tmp_path / "mxfp4.gguf") if kind == "gguf"
           else mx.write_released_folder(tmp_path / "released"))
    raw = mx.released_tensors()[1]
    out = tmp_path / "mixed.gguf"
    result = quantize_model(str(src), out, None, target_bpw=6.0, progress=False)
    assert 6.0 - 0.02 <= total_bpw(result.plan) <= 6.0
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    for name, (data, qtype) in raw.items():
        assert qtype == Q.MXFP4 and tensors[name].tensor_type == Q.MXFP4, name
        assert np.array_equal(np.asarray(tensors[name].data).reshape(-1), data.reshape(-1)), name
    assert any(r.target not in (Q.MXFP4, Q.F32) for r in result.plan)
    ref, ours = logits(src), logits(out)
    assert ((ours - ref).norm() / ref.norm()).item() < 0.2


def test_target_bpw_gemma4_moe(tmp_path):
    """Gemma 4's experts beside the MLP (ffn_gate_up_exps (E, 2F, C), ffn_down_exps (E, C, F)): allocated
    as E * 2F and E * C rows too. (Their products run in gemma4_moe.moe_ffn, outside moe.ExpertLinear:
    no imatrix rows for them, so they round without one.)"""
    import tiny_gemma4 as g4

    spec = g4.CASES["moe"]
    src = g4.write_gguf(spec, g4.write_hf_folder(spec, tmp_path / "hf"), tmp_path / "f32.gguf")
    out = tmp_path / "mixed.gguf"
    result = quantize_model(str(src), out, None, target_bpw=7.0, progress=False)
    assert 7.0 - 0.02 <= total_bpw(result.plan) <= 7.0
    experts = [r for r in result.plan if r.name.endswith("_exps.weight")]
    assert len(experts) == 2 * spec.n_layers and all(r.target in mixed.candidates(r.shape[-1]) for r in experts)
    check_experts_in_file(out, f32_experts(src), result.plan)
    ref, ours = logits(src), logits(out)
    # measured 0.24 (the tiny Gemma 4 is touchy: its Q8_0 preset file 0.27, Q5_0 0.70, Q4_0 0.83)
    assert ((ours - ref).norm() / ref.norm()).item() < 0.35


@pytest.mark.parametrize("flags", [("--type", "Q4_0"), ("--target-bpw", "6")])
@pytest.mark.parametrize("bad", ["experts", "columns", "dense"])
def test_imatrix_entry_of_a_wrong_shape_is_one_error(moe_sources, tmp_path, bad, flags):
    """A file whose expert entry has 3 rows for 8 experts, or rows of the wrong length, or a dense
    weight with an (E, C) entry: refused in one line before any work (it would fail the encoders mid-file)."""
    src = moe_sources("mixtral", "gguf")
    model = load_model(str(src), "cpu", torch.float32).model
    im = {"blk.0.attn_q.weight": torch.ones(64), "blk.0.ffn_down_exps.weight": torch.ones(8, 64)}
    name, value = {"experts": ("blk.0.ffn_down_exps.weight", torch.ones(3, 64)),
                   "columns": ("blk.0.ffn_down_exps.weight", torch.ones(8, 32)),
                   "dense": ("blk.0.attn_q.weight", torch.ones(8, 64))}[bad]
    path = tmp_path / "bad.imatrix"
    IM.save_imatrix(path, ImatrixStats.from_means(im | {name: value}))
    result = invoke(src, tmp_path / "o.gguf", *flags, "--imatrix", path)
    assert_one_error(result, name)
    assert not (tmp_path / "o.gguf").exists()
    IM.save_imatrix(path, ImatrixStats.from_means(im))  # the good one is read
    assert torch.equal(IM.load_imatrix(path, model)[0]["blk.0.ffn_down_exps.weight"], torch.ones(8, 64))
