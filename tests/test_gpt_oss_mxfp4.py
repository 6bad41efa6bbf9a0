"""The released gpt-oss safetensors layout (experts as MXFP4 _blocks / _scales, localllm/moe_mxfp4.py).

Oracles (tests/tiny_mxfp4.py writes the folder and the GGUF from one gguf.quants quantization):
(a) our load of the folder equals our load of the same blocks as an MXFP4 GGUF (the rows bit for bit,
    logits within 1e-5); (b) the folder's experts as we decode them equal transformers' own
    dequantization (convert_moe_packed_tensors) of the same blocks, bit for bit; (c) transformers 5.24
    loading the quantized folder on the CPU (Mxfp4Config(dequantize=True)) against our logits (1e-3).
`localllm quantize` from the folder writes the experts' blocks unchanged. Bad folders: one line.
"""

from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch

import tiny_models as tm
from tiny_hf import write_hf_folder
from tiny_tokenizer import vocab_size
import tiny_mxfp4 as tx
from localllm.cache import make_cache
from localllm.errors import LocalLLMError
from localllm.kernels.cpu import BlockQWeight
from localllm.load import load_model
from localllm.quantize.decode import dequantize_torch
from localllm.validate import check_gguf, check_hf_folder
from localllm.weights import QuantizedTensor, gguf_state_dict, hf_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")

Q = gguf.GGMLQuantizationType
SPEC = tx.SPEC
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return tx.write_released_folder(root / "hf"), tx.write_mxfp4_gguf(root / "mxfp4.gguf")


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, vocab_size(), (2, 16), generator=torch.Generator().manual_seed(4321))


@torch.inference_mode()
def our_logits(path, tokens, **kw) -> torch.Tensor:
    lm = load_model(str(path), "cpu", torch.float32, **kw)
    return lm.model(tokens, make_cache(lm.config, tokens.shape[1], batch=tokens.shape[0]), 0)


def folder_state(folder) -> dict:
    cfg, keys = check_hf_folder(folder)
    return hf_state_dict(folder, keys, cfg)


def test_folder_rows_are_the_gguf_s(files):
    """(a) The expert tensors read from the folder are the GGUF's MXFP4 rows, byte for byte; the rest
    of the state equal."""
    from localllm.gguf_file import open_gguf

    folder, path = files
    ours = folder_state(folder)
    f = open_gguf(path)
    theirs = gguf_state_dict(f, check_gguf(f), frozenset({Q.MXFP4}))
    assert set(ours) == set(theirs)
    n_quantized = 0
    for name, t in ours.items():
        if isinstance(t, QuantizedTensor):
            n_quantized += 1
            assert t.qtype == Q.MXFP4 and isinstance(theirs[name], QuantizedTensor)
            assert torch.equal(t.data, theirs[name].data), name
        else:
            assert torch.equal(t, theirs[name]), name
    assert n_quantized == 3 * SPEC.n_layers


def test_folder_logits_equal_mxfp4_gguf(files, tokens):
    """(a) Logits of the folder and of the GGUF; the experts stay MXFP4 blocks on the CPU backend."""
    folder, path = files
    lm = load_model(str(folder), "cpu", torch.float32)
    for blk in lm.model.blk:
        for name in EXPERTS:
            qw = getattr(blk.moe, name).qweight
            assert isinstance(qw, BlockQWeight) and qw.qtype == Q.MXFP4
    assert lm.tensor_types["MXFP4"] == 3 * SPEC.n_layers
    tm.assert_close(our_logits(folder, tokens), our_logits(path, tokens), tol=1e-5)


def test_dense_layout_decodes_the_blocks(files, tokens):
    """keep_quantized=False: the experts decoded to float at load, as the GGUF's are."""
    folder, path = files
    assert load_model(str(folder), "cpu", torch.float32, keep_quantized=False).model.blk[0].moe.ffn_up_exps.qweight is None
    tm.assert_close(our_logits(folder, tokens, keep_quantized=False), our_logits(path, tokens, keep_quantized=False),
                    tol=1e-5)
    # the blocks' products quantize activations (the CPU's MXFP4 kernels): the GPU tests' 1e-3
    tm.assert_close(our_logits(folder, tokens, keep_quantized=False), our_logits(folder, tokens))


def test_scales_in_another_shard(files, tmp_path, tokens):
    """A pair whose blocks and scales lie in two shards (the index names both) reads the same rows."""
    folder = tx.write_released_folder(tmp_path / "sharded", split_scales=True)
    ours, ref = folder_state(folder), folder_state(files[0])
    assert all(torch.equal(ours[n].data, t.data) for n, t in ref.items() if isinstance(t, QuantizedTensor))
    tm.assert_close(our_logits(folder, tokens), our_logits(files[0], tokens), tol=0.0)


def test_decoded_experts_equal_transformers_dequantization(files):
    """(b) transformers' convert_moe_packed_tensors on the folder's blocks gives gate_up (E, C, 2F) /
    down (E, F, C), x @ W, gate = columns 0::2: our rows decoded, transposed, are those values exactly."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder, _ = files
    ours = folder_state(folder)
    raw = load_file(str(folder / "model.safetensors"))
    E, F, C = SPEC.n_experts, SPEC.expert_ffn_dim, SPEC.dim

    def decoded(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = ours[name]
        return dequantize_torch(t.data, t.qtype).reshape(shape).transpose(-1, -2)  # x @ W layout

    for i in range(SPEC.n_layers):
        p = f"model.layers.{i}.mlp.experts."
        gate_up = convert_moe_packed_tensors(raw[p + "gate_up_proj_blocks"], raw[p + "gate_up_proj_scales"],
                                             dtype=torch.float32)
        down = convert_moe_packed_tensors(raw[p + "down_proj_blocks"], raw[p + "down_proj_scales"], dtype=torch.float32)
        assert gate_up.shape == (E, C, 2 * F) and down.shape == (E, F, C)
        assert torch.equal(decoded(f"blk.{i}.moe.ffn_gate_exps.weight", (E, F, C)), gate_up[..., 0::2])
        assert torch.equal(decoded(f"blk.{i}.moe.ffn_up_exps.weight", (E, F, C)), gate_up[..., 1::2])
        assert torch.equal(decoded(f"blk.{i}.moe.ffn_down_exps.weight", (E, C, F)), down)
        assert gate_up.abs().max() > 0.1  # not a degenerate decode


def test_folder_matches_transformers(files, tokens):
    """(c) transformers 5.24 loads the quantized folder on the CPU (dequantized) and agrees with us."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    folder, _ = files
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True)).eval()
    with torch.inference_mode():
        ref = model(tokens).logits.float()
    tm.assert_close(our_logits(folder, tokens), ref)


def test_experts_read_once_one_expert_at_a_time(files, monkeypatch):
    """Each checkpoint tensor is read and converted once, expert by expert (gate and up from one pass
    over gate_up_proj_blocks; a 120b layer's blocks never held twice, never as floats)."""
    import localllm.moe_mxfp4 as mx

    seen = []
    convert = mx.from_hf_blocks
    monkeypatch.setattr(mx, "from_hf_blocks", lambda b, s: seen.append(tuple(b.shape)) or convert(b, s))
    folder_state(files[0])
    F, C = SPEC.expert_ffn_dim, SPEC.dim
    assert sorted(set(seen)) == sorted({(2 * F, C // 32, 16), (C, F // 32, 16)})
    assert len(seen) == 2 * SPEC.n_experts * SPEC.n_layers


def test_info_counts_the_mxfp4_experts(files):
    """`localllm info`: the folder's parameters (blocks: 2 values a byte) = the MXFP4 GGUF's."""
    from localllm.commands.info import model_info

    folder, path = model_info(str(files[0])), model_info(str(files[1]))
    assert folder["parameters"] == path["parameters"]


# ---- `localllm quantize` from the folder

@pytest.mark.parametrize("preset", ["MXFP4_MOE", "Q8_0", "Q4_K_M"])
def test_quantize_keeps_the_blocks(files, tmp_path, preset):
    """The output's expert tensors are the folder's MXFP4 blocks byte for byte (the GGUF's rows, from
    the same quantization), whatever the preset, as llama.cpp's converter writes them; the file loads."""
    from localllm.commands.quantize_cmd import quantize_model
    from localllm.gguf_file import open_gguf

    folder, path = files
    out = tmp_path / f"{preset}.gguf"
    quantize_model(str(folder), out, preset, progress=False)
    written, ref = open_gguf(out), open_gguf(path)
    for i in range(SPEC.n_layers):
        for name in EXPERTS:
            t, r = written.tensors[f"blk.{i}.{name}.weight"], ref.tensors[f"blk.{i}.{name}.weight"]
            assert t.tensor_type == Q.MXFP4
            assert list(t.shape) == list(r.shape) and bytes(t.data) == bytes(r.data), (i, name)
    assert written.tensors["blk.0.attn_q.weight"].tensor_type != Q.F32  # the preset did quantize the rest
    load_model(str(out), "cpu", torch.float32)


def test_quantize_override_reencodes_experts(files, tmp_path):
    """--tensor-type names an expert tensor: it is re-encoded from the decoded blocks (the others kept)."""
    from localllm.commands.quantize_cmd import quantize_model
    from localllm.gguf_file import open_gguf

    out = tmp_path / "override.gguf"
    quantize_model(str(files[0]), out, "MXFP4_MOE", ["ffn_up_exps=Q8_0"], progress=False)
    written = open_gguf(out)
    assert written.tensors["blk.1.ffn_up_exps.weight"].tensor_type == Q.Q8_0
    assert written.tensors["blk.1.ffn_gate_exps.weight"].tensor_type == Q.MXFP4


# ---- bad folders: one line each

def _variant(files, tmp_path, edit_tensors=None, edit_config=None):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    shutil.copytree(files[0], folder)
    if edit_tensors is not None:
        state = load_file(str(folder / "model.safetensors"))
        edit_tensors(state)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        edit_config(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _one_line(folder) -> str:
    with pytest.raises(LocalLLMError) as info:
        load_model(str(folder), "cpu", torch.float32)
    message = str(info.value)
    assert message and "\n" not in message, repr(message)
    return message


P = "model.layers.1.mlp.experts."


def _drop(key):
    return lambda state: state.pop(key)


def _set(key, value_of):
    def edit(state):
        state[key] = value_of(state[key])
    return edit


BAD_TENSORS = {
    "missing scales": (_drop(P + "gate_up_proj_scales"), "gate_up_proj_scales"),
    "missing blocks": (_drop(P + "down_proj_blocks"), "down_proj_blocks"),
    # scales of another row count than their blocks
    "scales shape": (_set(P + "down_proj_scales", lambda t: t[:, :-1].contiguous()), "no MXFP4 pair"),
    # a consistent pair of the wrong width (K/32 groups 1 instead of 2): the config's shape check
    "blocks width": (lambda s: s.update({P + "gate_up_proj_blocks": s[P + "gate_up_proj_blocks"][:, :, :1].contiguous(),
                                         P + "gate_up_proj_scales": s[P + "gate_up_proj_scales"][:, :, :1].contiguous()}),
                     "has shape"),
    "odd rows": (lambda s: s.update({P + "gate_up_proj_blocks": s[P + "gate_up_proj_blocks"][:, :-1].contiguous(),
                                     P + "gate_up_proj_scales": s[P + "gate_up_proj_scales"][:, :-1].contiguous()}),
                 "interleaved"),
    "float blocks": (_set(P + "down_proj_blocks", lambda t: t.float()), "expected U8"),
    "both layouts": (lambda s: s.update({P + "down_proj": torch.zeros(SPEC.n_experts, SPEC.expert_ffn_dim, SPEC.dim)}),
                     "appears twice"),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_bad_blocks_are_one_line(files, tmp_path, case):
    edit, words = BAD_TENSORS[case]
    assert words in _one_line(_variant(files, tmp_path, edit_tensors=edit))


def test_quant_config_must_say_mxfp4(files, tmp_path):
    """MXFP4 tensors without quantization_config, and "mxfp4" over dense experts: one line each; another
    quant_method is refused by the config reader."""
    assert "quant_method None" in _one_line(_variant(files, tmp_path, edit_config=lambda c: c.pop("quantization_config")))
    dense = write_hf_folder(SPEC, tmp_path / "dense")
    cfg = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps(cfg | {"quantization_config": tx.QUANT_CONFIG}))
    assert "not stored as MXFP4" in _one_line(dense)
    (dense / "config.json").write_text(json.dumps(cfg | {"quantization_config": {"quant_method": "bitsandbytes"}}))
    assert "bitsandbytes" in _one_line(dense)


def test_truncated_file_is_one_line(files, tmp_path):
    folder = _variant(files, tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-100])
    assert "model.safetensors" in _one_line(folder)
