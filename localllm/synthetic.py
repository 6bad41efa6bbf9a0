"""Random-weight models of a models.toml shape, built directly on the device (benchmarks, tests).

Weight types: a dense dtype (bf16, f16, f32), one GGUF block type for every linear weight (Q8_0,
Q4_0, Q4_K, ...), or Q4_K_M: llama.cpp's mix for that file type (Q4_K, with Q6_K for the output and
for attn_v / ffn_down in the layers use_more_bits picks). Quantized weights go through
quantize.quantize_tensor on the device, then through load.build_model's pass like a GGUF file's.
To keep building fast, each (shape, type) is quantized once from up to 256 random rows, and each
tensor takes those rows rolled by a per-tensor offset and tiled (non-zero, and distinct per layer).
write_synthetic_gguf writes the same weights as a GGUF file that llama.cpp loads (bench/vs_llamacpp_gpu.py).
Speed runs (random_blocks=True): quantized weights are random valid blocks instead (RandomBlocks: random
bytes with sane fp16 scales, made on the device at once), not quantized random floats: quantizing even
256 rows of 14336 columns to Q4_K takes a minute or more on a CPU, and speed does not depend on the values.
Tensor parallelism (tp): each rank generates only its shard's shapes (tp_shard.local_config), from its
own seed: the ranks' weights are per-rank random, NOT slices of the TP=1 synthetic model (speed only;
tests/test_tp.py proves correctness on files), and a 70B model never exists whole on one rank.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch

from localllm.quantize import quantize_tensor

from .config import ModelConfig
from .fused import FUSED_ARCHS
from .load import build_model
from .model import Transformer
from .parallel import TensorParallel
from .tp_shard import local_config
from .rope import rope_factors
from .runtime import Runtime
from .weights import QuantizedTensor, gguf_name, ours_to_gguf

Q = gguf.GGMLQuantizationType
DENSE_TYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
SAMPLE_ROWS = 256


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for the layers that get more bits in the _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, wtype: str, cfg: ModelConfig) -> Q | None:
    """GGUF type of a linear weight (None: dense) for a --type value, as llama-quantize picks it
    (quantize/presets.py has the whole rule set; these are the branches the presets' shapes meet)."""
    if wtype.lower() in DENSE_TYPES or name.endswith("ffn_gate_inp.weight"):
        return None  # llama-quantize never quantizes a router ("ffn_gate_inp.weight")
    if wtype.upper() in ("MXFP4", "MXFP4_MOE"):  # presets.mxfp4_moe_type: experts MXFP4, the rest Q8_0
        return Q.MXFP4 if "_exps." in name else Q.Q8_0
    if wtype.upper() != "Q4_K_M":
        return Q[wtype.upper()]
    if name == "output.weight":
        return Q.Q6_K
    if cfg.n_experts == 8 and name.endswith(("attn_k.weight", "attn_v.weight", "attn_output.weight")):
        return Q.Q8_0 if not name.endswith("attn_output.weight") else Q.Q5_K  # llama.cpp's 8-expert rules
    if cfg.arch in FUSED_ARCHS and name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight")):
        return Q.Q5_K  # one fused attn_qkv in the file: llama-quantize's Q4_K_M rule for it
    if name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")):
        return Q.Q6_K if use_more_bits(int(name.split(".")[1]), cfg.n_layers) else Q.Q4_K
    return Q.Q4_K


# llama.cpp's fallbacks for rows that are not a multiple of 256 values (K-quants need whole blocks).
FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_1, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.IQ4_XS: Q.IQ4_NL}


def is_linear(name: str, shape: tuple) -> bool:
    """A product's weight: 2-D, or a mixture of experts' 3-D (E, F, C) stack (quantized as E F rows)."""
    experts = len(shape) == 3 and "_exps." in name and name.endswith(".weight")
    return (len(shape) == 2 and name != "token_embd.weight" and not name.endswith(".bias")) or experts


class RawSource:
    """Quantized random rows per (K, type), reused across tensors (rolled, tiled)."""

    def __init__(self, device, gen: torch.Generator):
        self.device, self.gen, self.cache, self.count = device, gen, {}, 0

    def get(self, rows: int, cols: int, qtype: Q) -> torch.Tensor:
        key = (cols, qtype)
        if key not in self.cache:
            w = torch.randn(SAMPLE_ROWS, cols, generator=self.gen, device=self.device) / cols**0.5
            self.cache[key] = torch.from_numpy(quantize_tensor(w, qtype)).to(self.device)
        base = self.cache[key]
        self.count += 1
        base = base.roll(self.count * 37 % SAMPLE_ROWS, dims=0)
        reps = -(-rows // SAMPLE_ROWS)
        return base.repeat(reps, 1)[:rows].contiguous()


# the block types random_blocks makes: every scale of theirs is an fp16 field (MXFP4's E8M0 byte is not)
RANDOM_BLOCK_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
                                Q.IQ4_NL, Q.IQ4_XS})


def unit_rms(qtype: Q) -> float:
    """Root mean square of the values random blocks decode to with every fp16 scale 1 (4096 blocks)."""
    from localllm.quantize.formats import FORMATS

    fmt = FORMATS[qtype]
    raw = torch.randint(0, 256, (4096, fmt.nbytes), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    one = torch.ones(4096, 1, dtype=torch.float16).view(torch.uint8)
    for f in fmt.fields:
        if f.dtype == torch.float16:
            raw[:, f.offset:f.offset + 2] = one
    return float(fmt.decode(raw).double().pow(2).mean().sqrt())


class RandomBlocks:
    """Random valid blocks (RawSource's interface): random bytes, each block's fp16 scales (d, dmin, m) one
    random value s = +-U(0.5, 1.5) / (sqrt(K) * unit_rms) (sign random per block: zero-mean weights), so
    a row's product has the scale of randn(K) / sqrt(K) rows'. Made on the device in one pass a tensor."""

    def __init__(self, device, gen: torch.Generator):
        self.device, self.gen, self.rms = device, gen, {}

    def get(self, rows: int, cols: int, qtype: Q) -> torch.Tensor:
        from localllm.quantize.formats import FORMATS

        if qtype not in RANDOM_BLOCK_TYPES:
            raise ValueError(f"random blocks of {qtype.name}: only {', '.join(sorted(t.name for t in RANDOM_BLOCK_TYPES))}")
        if qtype not in self.rms:
            self.rms[qtype] = unit_rms(qtype)
        fmt = FORMATS[qtype]
        nb = cols // fmt.block
        raw = torch.randint(0, 256, (rows, nb, fmt.nbytes), generator=self.gen, device=self.device, dtype=torch.uint8)
        s = torch.rand(rows, nb, 1, generator=self.gen, device=self.device) + 0.5
        sign = torch.randint(0, 2, (rows, nb, 1), generator=self.gen, device=self.device) * 2 - 1
        s = (s * sign / (cols**0.5 * self.rms[qtype])).half().view(torch.uint8)  # (rows, nb, 2)
        for f in fmt.fields:
            if f.dtype == torch.float16:
                raw[:, :, f.offset:f.offset + 2] = s
        return raw.view(rows, nb * fmt.nbytes)


def synthetic_state(cfg: ModelConfig, wtype: str, device: str, seed: int = 0, tp: TensorParallel | None = None,
                    dense_dtype: torch.dtype | None = None, random_blocks: bool = False) -> tuple[dict, Counter]:
    """module name -> dense tensor or QuantizedTensor; and the weight types (name -> count). tp: rank
    tp.rank's shard only (the module's docstring); dense_dtype: dense tensors cast to it as each is made
    (None: fp32), so that only one fp32 tensor exists at a time. random_blocks: quantized weights are
    RandomBlocks' (speed runs: no quantizing), else quantized random rows (RawSource)."""
    if tp is not None:
        seed += tp.rank
    with torch.device("meta"):
        module = Transformer(cfg) if tp is None else Transformer(local_config(cfg, tp), tp=tp)
        shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    source = RandomBlocks(device, gen) if random_blocks else RawSource(device, gen)
    state, types = {}, Counter()
    for name, shape in shapes.items():
        gguf_name = name.replace(".attn.", ".")
        qtype = tensor_type(gguf_name, wtype, cfg) if is_linear(name, shape) else None
        if qtype in FALLBACK and shape[-1] % 256:
            qtype = FALLBACK[qtype]
        if name == "rope_freqs":
            state[name] = rope_factors(cfg)
        elif name in ("rope_factors_short", "rope_factors_long"):  # LongRoPE divisors: plain rope
            state[name] = torch.ones(shape, device=device)
        elif qtype is not None:
            state[name] = QuantizedTensor(qtype, source.get(math.prod(shape[:-1]), shape[-1], qtype))
        elif name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
        else:
            fan_in = shape[-1] if is_linear(name, shape) else 1
            state[name] = torch.randn(shape, generator=gen, device=device) / fan_in**0.5
        if dense_dtype is not None and isinstance(state[name], torch.Tensor) and name != "rope_freqs":
            state[name] = state[name].to(dense_dtype)
        types[qtype.name if qtype is not None else "dense"] += 1
    return state, types


def synthetic_model(cfg: ModelConfig, wtype: str, device: str, dtype: torch.dtype, seed: int = 0,
                    keep_quantized: bool | None = None, tp: TensorParallel | None = None,
                    random_blocks: bool = False) -> tuple[Runtime, Counter]:
    """-> (the model on its device's backend, laid out as its GGUF file would load (load.build_model),
    Counter of weight types). Dense weights take `dtype`. tp: rank tp.rank's shard, per-rank random
    (the module's docstring), its dense tensors made in dtype one at a time; cfg the whole model's.
    random_blocks: synthetic_state's."""
    state, types = synthetic_state(cfg, wtype, device, seed, tp, None if tp is None else dtype, random_blocks)
    types[str(dtype).removeprefix("torch.")] = types.pop("dense")
    return build_model(cfg, state, device, dtype, keep_quantized, tp=tp), types


def fuse_rows(cfg: ModelConfig, state: dict) -> dict:
    """Phi-3's file layout (fused.py): per layer attn_q|k|v rows as attn_qkv, ffn_gate|up as ffn_up (the
    loader splits them back into the same tensors). Parts of one fused tensor share a type."""
    out = {}
    for name, v in state.items():
        parts = name.replace(".attn.", ".").split(".")
        if parts[0] != "blk" or parts[2] not in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"):
            out[name] = v
        elif parts[2] in ("attn_q", "ffn_gate"):
            p = f"blk.{parts[1]}"
            group = ([f"{p}.attn.attn_{x}.weight" for x in "qkv"] if parts[2] == "attn_q"
                     else [f"{p}.ffn_gate.weight", f"{p}.ffn_up.weight"])
            ws = [state[g] for g in group]
            key = f"{p}.attn_qkv.weight" if parts[2] == "attn_q" else f"{p}.ffn_up.weight"
            if isinstance(ws[0], QuantizedTensor):
                assert len({w.qtype for w in ws}) == 1, f"{key}: its parts have different types"
                out[key] = QuantizedTensor(ws[0].qtype, torch.cat([w.data for w in ws]))
            else:
                out[key] = torch.cat(ws)
    return out


def write_synthetic_gguf(cfg: ModelConfig, wtype: str, out: Path, tokenizer: dict, device: str = "cpu",
                         seed: int = 0, progress: bool = False, quantized_embedding: bool = False,
                         random_blocks: bool = False) -> Path:
    """synthetic_state's weights as a GGUF file: wtype a file type (F16, BF16, Q8_0, Q4_0, Q4_K_M...).

    Written as convert_hf_to_gguf + llama-quantize lay a file out: the architecture keys of
    hf_to_gguf.hf_metadata, q/k rows permuted for the llama architecture (load.py undoes it),
    1-D tensors (norms, rope_freqs) F32, dense 2-D tensors F16 (BF16, F32 in such files), quantized ones
    as their blocks; the token embedding stays dense as synthetic_model keeps it (llama-quantize would
    quantize it). tokenizer: the tokenizer.* keys (name -> MetaValue) of a vocabulary of cfg.vocab_size
    tokens, e.g. quantize_cmd.read_gguf_metadata(vocab.gguf, keep=lambda k: k.startswith("tokenizer.")).
    One tensor at a time reaches host memory; the file appears under OUT only when complete.
    random_blocks: synthetic_state's (speed comparisons: a Q4_K_M file of the 8B shape in seconds)."""
    from localllm.quantize.presets import find_preset
    from localllm.quantize.writer import MetaValue, TensorSlot, write_gguf

    from .hf_to_gguf import gguf_arch, hf_metadata, permute_qk

    preset = find_preset(wtype)
    if preset is None:
        raise ValueError(f"unknown GGUF file type {wtype!r}")
    n_tokens = len(tokenizer["tokenizer.ggml.tokens"].value)
    if n_tokens != cfg.vocab_size:
        raise ValueError(f"the tokenizer has {n_tokens} tokens, the model's vocabulary {cfg.vocab_size}")
    arch = gguf_arch(cfg.arch)
    hp = {"max_position_embeddings": cfg.context_length, "rope_theta": cfg.rope_theta,
          "rms_norm_eps": cfg.norm_eps, "head_dim": cfg.head_dim,
          "original_max_position_embeddings": cfg.rope_original_context, "sliding_window": cfg.sliding_window}
    meta = hf_metadata(hp, cfg, Path(out).parent, arch) | tokenizer
    meta[gguf.Keys.General.NAME] = MetaValue(f"synthetic {Path(out).stem}", gguf.GGUFValueType.STRING)
    meta[gguf.Keys.General.FILE_TYPE] = MetaValue(int(preset.file_type), gguf.GGUFValueType.UINT32)
    meta[gguf.Keys.General.QUANTIZATION_VERSION] = MetaValue(gguf.GGML_QUANT_VERSION, gguf.GGUFValueType.UINT32)
    state, _ = synthetic_state(cfg, wtype, device, seed, random_blocks=random_blocks)
    if quantized_embedding:  # as llama-quantize stores it (the CPU's one-call decoder reads its blocks)
        state = quantize_embedding(state, wtype)
    if cfg.rope_scaling is None or cfg.rope_scaling.kind != "llama3":
        # ones, or scaling the metadata says (linear, YaRN): llama.cpp wants no tensor then
        del state["rope_freqs"]
    if cfg.arch in FUSED_ARCHS:
        state = fuse_rows(cfg, state)
    dense = preset.default if preset.default in (Q.F32, Q.F16, Q.BF16) else Q.F16
    names, slots = list(state), []
    with torch.device("meta"):  # the experts' 3-D shapes (their blocks are E F rows)
        full = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    for name in names:
        v, file_name = state[name], ours_to_gguf(arch, gguf_name(name))  # gpt-oss: its ffn_norm's name
        if isinstance(v, QuantizedTensor):
            block, size = gguf.GGML_QUANT_SIZES[v.qtype]
            shape = (v.data.shape[0], v.data.shape[1] // size * block)
            slots.append(TensorSlot(file_name, full[name] if len(full.get(name, ())) == 3 else shape, v.qtype))
        else:
            f32 = v.dim() == 1 or name.endswith(".bias")  # gpt-oss's expert biases (E, F): F32 as converted
            slots.append(TensorSlot(file_name, tuple(v.shape), Q.F32 if f32 else dense))
    torch_types = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}

    def make_tensor(i: int) -> np.ndarray:
        v, slot = state.pop(names[i]), slots[i]  # popped: written tensors leave the device
        data = v.data if isinstance(v, QuantizedTensor) else v.to(torch_types[slot.type])
        if arch == "llama" and slot.name.endswith(("attn_q.weight", "attn_k.weight")):
            data = permute_qk(data, cfg.n_heads if ".attn_q." in slot.name else cfg.n_kv_heads)
        # numpy has no bfloat16: its bytes travel as int16
        return (data.view(torch.int16) if data.dtype == torch.bfloat16 else data).contiguous().cpu().numpy()

    return write_gguf(Path(out), arch, meta, slots, make_tensor, progress=progress)


def quantize_embedding(state: dict, wtype: str) -> dict:
    """state with token_embd.weight as a QuantizedTensor of wtype's block type (Q4_K_M: Q4_K), as
    llama-quantize stores it: the CPU's one-call decoder reads the embedding's blocks (backends/cpu.py)."""
    qtype = {"Q4_K_M": Q.Q4_K, "MXFP4_MOE": Q.Q8_0}.get(wtype.upper()) or Q[wtype.upper()]
    emb = state["token_embd.weight"]
    if qtype in FALLBACK and emb.shape[1] % 256:
        qtype = FALLBACK[qtype]
    blocks = torch.from_numpy(quantize_tensor(emb.float().cpu(), qtype)).to(emb.device)
    return {**state, "token_embd.weight": QuantizedTensor(qtype, blocks)}
