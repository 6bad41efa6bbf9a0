"""The CPU backend: decode in one C++ call per token (kernels/cpu_decode.cpp), the model's weights,
norms and rope tables handed over once, then each step runs every layer without returning to Python.

A GGUF file's quantized tensors stay as its blocks, repacked for the C++ products (kernels/cpu.py);
F32/F16/BF16 linear weights and embeddings (of GGUF files and safetensors folders: dense_blocks) stay
rows of their stored type, multiplied in fp32 (no fp32 copy of an F16 file); the vectors beside them
are fp32 (the kernels compute in fp32). One-token steps of a batch-1 fp32 cache go through the C++
decoder when the extension is built and every linear weight is a BlockQWeight the C++ products read
(or a dense fp32 matrix), and so do decode_slots' steps over many slots of one cache (one C++ call for all
rows, each weight read once for them: `serve`'s batches, localllm/slots.py); everything else (prompts,
batches of equal positions) runs the portable torch forward. Both give the same results up to the int16 activation
rounding of the products (tests/test_cpu_kernels.py, tests/test_cpu_error.py).

The decoder runs the Llama layer and the dense families' fields (cpp_covers: Gemma 2/3, Phi-3,
SmolLM3; tests/test_cpu_families.py): per layer its rope set (rope.layer_ropes, the tables the forward
uses), window and activation, and the model's scales and soft caps; Gemma 4's dense layer (cpu_gemma4.py:
per-layer shapes, shared caches, per-layer embeddings); and the mixture-of-experts MLP of Mixtral,
Qwen3-MoE and gpt-oss (cpu_moe.py, kernels/cpu_moe.cpp; tests/test_cpu_moe.py). Other configs (Gemma 4's
experts beside its MLP, a dense clamped GLU) run the torch forward on the same blocks (CpuEagerRuntime).
"""

from __future__ import annotations

from dataclasses import fields

import torch

from localllm.kernels.cpu import BlockQWeight, args, load_extension, pack_for_cpu, runs_in_cpp

from ..cache import KVCache
from ..config import FAMILY_FIELDS, ModelConfig
from ..model import QEmbedding, Transformer
from ..rope import layer_ropes, rotary_dims
from ..runtime import Runtime
from ..settings import DEFAULT_CPU
from ..slots import Slots, check_rows
from ..weights import to_module_name
from .cpu_moe import MOE_FIELDS, NO_MATRIX, add_moe_layers, moe_covers, moe_layers, parameter_names
from .cpu_gemma4 import EMPTY_MAT, GEMMA4_FIELDS, gemma4_args, param_names, shapes_fit

LINEARS = ("attn.attn_q", "attn.attn_k", "attn.attn_v", "attn.attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Per layer, as GGUF names (to_module_name places them in the model): what cpu_bind.cpp's Decoder takes.
VECTORS = ("attn_norm.weight", "ffn_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
           "attn_q.bias", "attn_k.bias", "attn_v.bias", "post_attention_norm.weight", "post_ffw_norm.weight",
           "attn_output.bias", "attn_sinks.weight")
NONE = torch.empty(0)  # an absent norm or bias
# The issue-19 fields the C++ decoder implements (cpu_decode.h, cpu_moe.h); a config that sets any other
# one (Gemma 4's, fields added later) runs the torch forward (CpuEagerRuntime).
CPP_FIELDS = frozenset({
    "embed_scale", "activation", "post_norms", "attn_scale", "attn_softcap", "final_softcap", "attn_out_bias",
    "attn_sinks", "sliding_window", "sliding_layers", "rope_theta_local", "rope_layers", "rotary_dim",
    "rope_attn_factor", "rope_original_context",
}) | MOE_FIELDS | GEMMA4_FIELDS
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # ModelConfig.activation -> lq::Act


def cpp_covers(cfg: ModelConfig | None) -> bool:
    """True when the C++ decoder implements every layer of cfg (None: a Llama-layer model)."""
    if cfg is None:
        return True
    changed = {f.name for f in fields(cfg) if f.name in FAMILY_FIELDS and getattr(cfg, f.name) != f.default}
    return changed <= CPP_FIELDS and (cfg.activation in ACTIVATIONS or cfg.n_experts > 0) and moe_covers(cfg)


def as_matrix(w) -> tuple | None:
    """(data, ggml type id, N, K, tiled) of a weight the C++ products take, else None."""
    if isinstance(w, BlockQWeight):
        return args(w) if runs_in_cpp(w) and w.data.is_contiguous() else None
    if isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.dim() == 2 and w.shape[1] % 32 == 0:
        return w.contiguous().view(torch.uint8), 0, w.shape[0], w.shape[1], False  # ggml type 0: F32
    return None


def fp32_vector(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return NONE
    return t.contiguous() if t.dtype == torch.float32 else None


def submodule(blk, name: str):
    """blk's module `name`, None where the layer has none (an MoE layer's MLP)."""
    try:
        return blk.get_submodule(name)
    except AttributeError:
        return None


def model_tensors(model: Transformer) -> tuple[list, list] | None:
    """Matrices (per layer LINEARS, then embedding and output) and vectors (per layer VECTORS, then
    output_norm) in the order the C++ Decoder takes, or None when one of them does not fit or the
    model has a parameter the decoder would not read."""
    params = dict(model.named_parameters())
    mats, vecs, read = [], [], {"token_embd.weight", "output.weight", "output_norm.weight"}
    for i, blk in enumerate(model.blk):
        for n in LINEARS:
            linear = submodule(blk, n)
            if linear is None and n.startswith("ffn_") and getattr(blk, "moe", None) is not None:
                mats.append(NO_MATRIX)  # the experts' (cpu_moe.py)
                continue
            absent_kv = linear is None and n in ("attn.attn_k", "attn.attn_v")  # Gemma 4: shared, or v = k
            mats.append(EMPTY_MAT if absent_kv else as_matrix(linear.w) if linear is not None else None)
            read.add(f"blk.{i}.{n}.weight")
        names = [to_module_name(f"blk.{i}.{n}") for n in VECTORS]
        vecs += [fp32_vector(params.get(n)) for n in names]
        read.update(names)
    mats += [as_matrix(model.token_embd.weight), as_matrix(model.output_weight())]
    vecs.append(fp32_vector(model.output_norm.weight))
    read |= parameter_names(model) | param_names(model.cfg)
    if any(m is None for m in mats) or any(v is None for v in vecs) or set(params) - read:
        return None
    return mats, vecs


def rope_sets(model: Transformer, positions: torch.Tensor, capacity: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Per layer the index of its rope set (-1: none), and cos, sin (T, sets, R/2) of the sets the
    layers share (rope.layer_ropes with the divisors of a cache of this capacity: the forward's tables)."""
    per_layer = layer_ropes(model.cfg, positions, model.rope_divisors(capacity))
    sets: list = []
    for r in per_layer:
        if r is not None and not any(r is s for s in sets):
            sets.append(r)
    index = [-1 if r is None else next(j for j, s in enumerate(sets) if s is r) for r in per_layer]
    if not sets:
        empty = torch.zeros(positions.shape[0], 1, rotary_dims(model.cfg) // 2)
        return index, empty, empty
    # rows of the widest set's length: a narrower set (Gemma 4's local one) fills the first of its row
    half = max(s[0].shape[-1] for s in sets)
    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, half - t.shape[-1]))
    return index, *(torch.stack([pad(s[k]) for s in sets], 1).contiguous() for k in (0, 1))


def layer_ints(model: Transformer, rope_index: list[int]) -> list[int]:
    """Per layer: rope set, window (0: every key), activation, as cpu_bind.cpp's Decoder takes them."""
    cfg, out = model.cfg, []
    for i in range(cfg.n_layers):
        act = ACTIVATIONS.get(cfg.activation, 0)  # (an MoE layer's experts take theirs: cpu_moe.py)
        out += [rope_index[i], (cfg.sliding_window or 0) if cfg.sliding(i) else 0, act]
    return out


class CpuDecoder:
    def __init__(self, model: Transformer, ext, gemma4: tuple | None = None):
        """gemma4: the arguments of the native Decoder.gemma4 (cpu_gemma4.gemma4_args), None for others."""
        self.model, self.ext = model, ext
        cfg = model.cfg
        mats, vecs = model_tensors(model)
        index, *self.rope = rope_sets(model, torch.arange(0), 0)
        dims = [cfg.dim, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 2 * self.rope[0].shape[-1]]
        scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        scalars = [cfg.norm_eps, cfg.embed_scale, scale, cfg.attn_softcap or 0.0, cfg.final_softcap or 0.0]
        self.rope_capacity = 0
        self.native = ext.Decoder(dims, scalars, *([m[i] for m in mats] for i in range(5)), vecs,
                                  layer_ints(model, index))
        add_moe_layers(self.native, moe_layers(model, as_matrix, fp32_vector))
        if gemma4 is not None:
            self.native.gemma4(*gemma4)

    def rope_rows(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (positions, sets, R/2) for positions [0, capacity), computed once per cache size
        (LongRoPE's divisors depend on it)."""
        if self.rope_capacity != capacity:
            self.rope = rope_sets(self.model, torch.arange(capacity), capacity)[1:]
            self.rope_capacity = capacity
        return self.rope

    def step(self, token: int, pos: int, cache: KVCache) -> torch.Tensor:
        """token at position pos -> logits (V,) fp32; writes cache row pos of every layer."""
        cos, sin = self.rope_rows(cache.capacity)
        if isinstance(cache.k, list):  # per-layer buffers (Gemma 4)
            return self.native.step_layers(token, pos, cache.k, cache.v, cos[pos], sin[pos], torch.get_num_threads())
        return self.native.step(token, pos, cache.k, cache.v, cos[pos], sin[pos], torch.get_num_threads())

    def step_rows(self, tokens: torch.Tensor, positions: list[int], which: list[int], cache: KVCache) -> torch.Tensor:
        """tokens (B,) of slots `which` of a cache of n slots, at their positions -> logits (B, V) fp32;
        writes each slot's row at its position (one call for all rows: kernels/cpu_decode.h decode_rows)."""
        cos, sin = self.rope_rows(cache.capacity)
        pos = torch.tensor(positions, dtype=torch.long)
        rows = (cos[pos].contiguous(), sin[pos].contiguous())  # (B, sets, R/2)
        ids, slots = tokens.view(-1).to(torch.long).contiguous(), torch.tensor(which, dtype=torch.long)
        step = self.native.step_rows_layers if isinstance(cache.k, list) else self.native.step_rows
        return step(ids, pos, slots, cache.k, cache.v, *rows, torch.get_num_threads())


def cache_fits(cache: KVCache, batch1: bool = True) -> bool:
    """An fp32 CPU cache: one (L, n, Hkv, S, D) buffer, or per-layer (n, Hkv, S, D) ones; n = 1 if batch1."""
    layered = isinstance(cache.k, list)
    tensors = [*cache.k, *cache.v] if layered else [cache.k, cache.v]
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors) and (
        not batch1 or tensors[0].shape[0 if layered else 1] == 1
    )


def build_decoder(model: Transformer) -> CpuDecoder | None:
    """The model's C++ decoder, or None where it does not fit: only models whose embedding is kept as
    rows (QEmbedding: quantized or dense_blocks); others (a dense load) stay on the torch forward."""
    cfg = model.cfg
    if not cpp_covers(cfg) or not shapes_fit(cfg):
        return None
    if not isinstance(model.token_embd, QEmbedding) or model_tensors(model) is None:
        return None
    if moe_layers(model, as_matrix, fp32_vector) is None:
        return None
    gemma4 = None
    if any(getattr(cfg, f) != getattr(ModelConfig, f) for f in GEMMA4_FIELDS):  # (their defaults)
        gemma4 = gemma4_args(model, as_matrix, fp32_vector)
        if gemma4 is None:
            return None
    ext = load_extension(DEFAULT_CPU.cache_dir)
    return CpuDecoder(model, ext, gemma4) if ext is not None else None


class CpuRuntime(Runtime):
    blocks_dtype = torch.float32  # the C++ kernels compute in fp32: norms, biases and the KV cache too
    dense_blocks = True  # F32/F16/BF16 weights multiplied as stored (cpu_quant.cpp dense_rows_of)
    prompts_compute_bound = True

    def __init__(self, model: Transformer):
        super().__init__(model)
        self.decoder: CpuDecoder | None = None  # built on the first one-token step
        self.decoder_built = False

    @staticmethod
    def block_weight(blocks: torch.Tensor, qtype, dtype: torch.dtype) -> BlockQWeight:
        """The file's blocks repacked for the C++ products (kernels/cpu.py; as they are without the
        extension: its torch fallback)."""
        return pack_for_cpu(BlockQWeight.from_blocks(blocks, qtype, dtype), load_extension(DEFAULT_CPU.cache_dir))

    def cpp_decoder(self, cache: KVCache, batch1: bool = True) -> CpuDecoder | None:
        # a tensor-parallel shard (model.tp): whole C++ layers leave no place for the all-reduces
        if not cache_fits(cache, batch1) or self.model.tp is not None:
            return None
        if not self.decoder_built:
            self.decoder, self.decoder_built = build_decoder(self.model), True
        return self.decoder

    def decode(self, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
        decoder = self.cpp_decoder(cache)
        if decoder is None:
            return super().decode(cache, tokens)
        start = cache.length
        logits = decoder.step(int(tokens.view(-1)[0]), start, cache)
        cache.length = start + 1
        return logits.view(1, -1)

    def decode_slots(self, slots: Slots, which: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """The C++ decoder's rows step (each row the bits of its one-token step alone); the portable
        step where the decoder does not cover the model."""
        decoder = self.cpp_decoder(slots.cache, batch1=False)
        if decoder is None:
            return super().decode_slots(slots, which, tokens)
        check_rows(slots, which, tokens)
        logits = decoder.step_rows(tokens, [slots.lengths[s] for s in which], which, slots.cache)
        for s in which:
            slots.lengths[s] += 1
        return logits


class CpuEagerRuntime(Runtime):
    """Configs beyond the Llama layer: the torch forward on the file's blocks, repacked for the C++
    products (CpuRuntime's weights without its one-call decoder)."""

    blocks_dtype = torch.float32
    dense_blocks = True
    prompts_compute_bound = True
    block_weight = staticmethod(CpuRuntime.block_weight)
