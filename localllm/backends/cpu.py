"""The CPU backend: decode in one C++ call per token (kernels/cpu_decode.cpp), the model's weights,
norms and rope tables handed over once, then each step runs every layer without returning to Python.

A GGUF file's quantized tensors stay as its blocks, repacked for the C++ products (kernels/cpu.py),
and the dense tensors beside them are fp32 (the kernels compute in fp32). One-token steps of a
batch-1 fp32 cache go through the C++ decoder when the extension is built and every linear weight is
a BlockQWeight the C++ products read (or a dense fp32 matrix); everything else (prompts, batches,
dense models) runs the portable torch forward. Both give the same results up to the int8 activation
rounding of the products (tests/test_cpu_kernels.py, tests/test_cpu_error.py).
"""

from __future__ import annotations

import torch

from localllm.kernels.cpu import BlockQWeight, args, load_extension, pack_for_cpu, runs_in_cpp

from ..cache import KVCache
from ..model import QEmbedding, Transformer
from ..runtime import Runtime
from ..settings import DEFAULT_CPU

LINEARS = ("attn.attn_q", "attn.attn_k", "attn.attn_v", "attn.attn_output", "ffn_gate", "ffn_up", "ffn_down")
VECTORS = ("attn_norm.weight", "ffn_norm.weight", "attn.attn_q_norm.weight", "attn.attn_k_norm.weight",
           "attn.attn_q.bias", "attn.attn_k.bias", "attn.attn_v.bias")
NONE = torch.empty(0)  # an absent norm or bias


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


def model_tensors(model: Transformer) -> tuple[list, list] | None:
    """Matrices (per layer LINEARS, then embedding and output) and vectors (per layer VECTORS, then
    output_norm) in the order the C++ Decoder takes, or None when one of them does not fit."""
    params = dict(model.named_parameters())
    mats, vecs = [], []
    for i, blk in enumerate(model.blk):
        mats += [as_matrix(blk.get_submodule(n).w) for n in LINEARS]
        vecs += [fp32_vector(params.get(f"blk.{i}.{n}")) for n in VECTORS]
    mats += [as_matrix(model.token_embd.weight), as_matrix(model.output_weight())]
    vecs.append(fp32_vector(model.output_norm.weight))
    if any(m is None for m in mats) or any(v is None for v in vecs):
        return None
    return mats, vecs


class CpuDecoder:
    def __init__(self, model: Transformer, ext):
        self.model, self.ext = model, ext
        cfg = model.cfg
        mats, vecs = model_tensors(model)
        dims = [cfg.dim, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim]
        self.native = ext.Decoder(dims, cfg.norm_eps, *([m[i] for m in mats] for i in range(5)), vecs)
        self.rope = (torch.empty(0, cfg.head_dim // 2),) * 2  # cos, sin: (positions, D/2)

    def rope_rows(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """model.rope_tables for positions [0, capacity), computed once per cache size."""
        if self.rope[0].shape[0] < capacity:
            self.rope = tuple(t.contiguous() for t in self.model.rope_tables(torch.arange(capacity)))
        return self.rope

    def step(self, token: int, pos: int, cache: KVCache) -> torch.Tensor:
        """token at position pos -> logits (V,) fp32; writes cache row pos of every layer."""
        cos, sin = self.rope_rows(cache.capacity)
        return self.native.step(token, pos, cache.k, cache.v, cos[pos], sin[pos], torch.get_num_threads())


def cache_fits(cache: KVCache) -> bool:
    k, v = cache.k, cache.v
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in (k, v)) and (
        k.shape[1] == 1
    )


def build_decoder(model: Transformer) -> CpuDecoder | None:
    """The model's C++ decoder, or None where it does not fit: only models that keep the file's blocks
    (a quantized GGUF on the CPU); dense ones stay on the torch forward."""
    if model.cfg.head_dim % 8 or not isinstance(model.token_embd, QEmbedding) or model_tensors(model) is None:
        return None
    ext = load_extension(DEFAULT_CPU.cache_dir)
    return CpuDecoder(model, ext) if ext is not None else None


class CpuRuntime(Runtime):
    blocks_dtype = torch.float32  # the C++ kernels compute in fp32: norms, biases and the KV cache too

    def __init__(self, model: Transformer):
        super().__init__(model)
        self.decoder: CpuDecoder | None = None  # built on the first one-token step
        self.decoder_built = False

    @staticmethod
    def block_weight(blocks: torch.Tensor, qtype, dtype: torch.dtype) -> BlockQWeight:
        """The file's blocks repacked for the C++ products (kernels/cpu.py; as they are without the
        extension: its torch fallback)."""
        return pack_for_cpu(BlockQWeight.from_blocks(blocks, qtype, dtype), load_extension(DEFAULT_CPU.cache_dir))

    def cpp_decoder(self, cache: KVCache) -> CpuDecoder | None:
        if not cache_fits(cache):
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


class CpuEagerRuntime(Runtime):
    """Configs beyond the Llama layer: the torch forward on the file's blocks, repacked for the C++
    products (CpuRuntime's weights without its one-call decoder)."""

    blocks_dtype = torch.float32
    block_weight = staticmethod(CpuRuntime.block_weight)
