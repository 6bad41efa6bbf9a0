"""Random-weight models of a models.toml shape, built directly on the device (benchmarks, tests).

Weight types: a dense dtype (bf16, f16, f32), one GGUF block type for every linear weight (Q8_0,
Q4_0, Q4_K, ...), or Q4_K_M: llama.cpp's mix for that file type (Q4_K, with Q6_K for the output and
for attn_v / ffn_down in the layers use_more_bits picks). Quantized weights go through
quantize.quantize_tensor on the device, then through load.build_model's pass like a GGUF file's.
To keep building fast, each (shape, type) is quantized once from up to 256 random rows, and each
tensor takes those rows rolled by a per-tensor offset and tiled (non-zero, and distinct per layer).
"""

from __future__ import annotations

from collections import Counter

import gguf
import torch

from quantize import quantize_tensor

from .config import ModelConfig
from .load import build_model
from .model import Transformer, llama3_rope_factors
from .weights import QuantizedTensor

Q = gguf.GGMLQuantizationType
DENSE_TYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
SAMPLE_ROWS = 256


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for the layers that get more bits in the _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, wtype: str, cfg: ModelConfig) -> Q | None:
    """GGUF type of a linear weight (None: dense) for a --type value."""
    if wtype.lower() in DENSE_TYPES:
        return None
    if wtype.upper() != "Q4_K_M":
        return Q[wtype.upper()]
    if name == "output.weight":
        return Q.Q6_K
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        return Q.Q6_K if use_more_bits(int(name.split(".")[1]), cfg.n_layers) else Q.Q4_K
    return Q.Q4_K


# llama.cpp's fallbacks for rows that are not a multiple of 256 values (K-quants need whole blocks).
FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_1, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def is_linear(name: str, shape: tuple) -> bool:
    return len(shape) == 2 and name != "token_embd.weight"


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


def synthetic_state(cfg: ModelConfig, wtype: str, device: str, seed: int = 0) -> tuple[dict, Counter]:
    """module name -> dense tensor or QuantizedTensor; and the weight types (name -> count)."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    source = RawSource(device, gen)
    state, types = {}, Counter()
    for name, shape in shapes.items():
        gguf_name = name.replace(".attn.", ".")
        qtype = tensor_type(gguf_name, wtype, cfg) if is_linear(name, shape) else None
        if qtype in FALLBACK and shape[1] % 256:
            qtype = FALLBACK[qtype]
        if name == "rope_freqs":
            state[name] = llama3_rope_factors(cfg)
        elif qtype is not None:
            state[name] = QuantizedTensor(qtype, source.get(shape[0], shape[1], qtype))
        elif name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
        else:
            fan_in = shape[-1] if is_linear(name, shape) else 1
            state[name] = torch.randn(shape, generator=gen, device=device) / fan_in**0.5
        types[qtype.name if qtype is not None else "dense"] += 1
    return state, types


def synthetic_model(cfg: ModelConfig, wtype: str, device: str, dtype: torch.dtype, seed: int = 0,
                    keep_quantized: bool | None = None):
    """-> (Transformer on device, Counter of weight types). Dense weights take `dtype`."""
    state, types = synthetic_state(cfg, wtype, device, seed)
    types[str(dtype).removeprefix("torch.")] = types.pop("dense")
    return build_model(cfg, state, device, dtype, keep_quantized), types
