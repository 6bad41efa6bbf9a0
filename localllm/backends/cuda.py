"""The CUDA backend: Triton kernels, and CUDA graphs so a step is one launch.

- Load: quantized weights stay QWeights on the GPU (integer-dot or float-decoding Triton kernels,
  kernels/linear.py), and `fuse` stacks q|k|v and interleaves gate/up into one weight each, once.
- Prompts: the model's forward with CUDA_OPS (Triton norm, rope + cache write, silu * up); a prompt
  shape seen before replays a captured graph (PrefillGraph).
- Decode, greedy steps and speculative verify passes: backends/cuda_graph.py's GraphDecoder, one
  captured graph a step; a greedy step's argmax is its last kernel. Mixture-of-experts layers route
  and run their chosen experts on the device inside it (backends/cuda_moe.py), and so do their
  prompts (CUDA_OPS.moe: backends/cuda_moe_prefill.py's grouped products, no host sync: PrefillGraph
  captures them too).
- Continuous batching (decode_slots: many slots of one cache, each at its own position):
  backends/cuda_slots.py, GraphDecoder's kernels over the step's slots, a graph per bucket of slot
  counts (1, 2, 4, .., 64), each row the bits of that slot decoded alone; buckets of dense_decode_rows
  or more multiply the kept dense copies through cuBLAS instead (dense steps).
Each op computes what model.py's reference op computes, within rounding (tests/gpu).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from localllm.kernels.cpu import BlockQWeight
from localllm.kernels.linear import dequantize_qweight, linear
from localllm.kernels.qweight import QWeight
from localllm.kernels.triton_epilogue import MAX_ROWS
from localllm.kernels.triton_prefill import rmsnorm_rows, rope_cache, silu_mul

from ..cache import KVCache
from ..config import ModelConfig
from ..model import Linear, Ops, Transformer, glu, glu_input, project_qkv
from ..runtime import Runtime
from ..settings import DEFAULT_GPU, DEFAULT_SERVE
from ..slots import Slots, check_prefill, check_prefills, check_rows
from .cuda_graph import GraphDecoder, captured, layer_products
from .cuda_moe import fuse_experts
from .cuda_moe_prefill import moe_prefill
from .cuda_prompt import prompt_graphs
from .cuda_warmup import warm_up_prompts
from . import cuda_slots


# ---- load: q|k|v and gate/up as one product each


def fuse_rows(linears: list[Linear], interleave: bool = False) -> torch.Tensor | QWeight | None:
    """Stack the weights of Linears fed by the same input into one (sum N, K) weight (rows interleaved
    with `interleave`: gate/up for the GLU epilogue) and make each Linear hold a row view of it (no
    second copy). None when their kinds, types or shapes differ."""
    ws = [m.w for m in linears]
    if interleave and len({tuple(w.shape) for w in ws}) != 1:
        return None
    if all(isinstance(w, QWeight) for w in ws) and len({w.qtype for w in ws}) == 1 and ws[0].has_kernel:
        fused = QWeight.cat(ws, interleave)
    elif all(isinstance(w, torch.Tensor) for w in ws) and len({w.dtype for w in ws}) == 1:
        ts = [w.detach() for w in ws]
        fused = torch.stack(ts, 1).flatten(0, 1) if interleave else torch.cat(ts)
    else:
        return None
    start = 0
    for i, (m, w) in enumerate(zip(linears, ws)):
        n = w.shape[0]
        rows = slice(i, None, len(ws)) if interleave else slice(start, start + n)
        if isinstance(fused, QWeight):
            m.qweight = fused.rows(rows.start, rows.stop if rows.stop is not None else fused.shape[0], rows.step or 1)
        else:
            m.weight = torch.nn.Parameter(fused[rows], requires_grad=False)
        start += n
    return fused


def fuse(model: Transformer) -> None:
    """q|k|v stacked and gate/up interleaved into one weight each (Attention.fused_qkv,
    Block.fused_gate_up), for the decode step's kernels and prefill's products alike. Once, at load."""
    for blk in model.blk:
        a = blk.attn
        qkv = fuse_rows([a.attn_q, a.attn_k, a.attn_v])
        bias = torch.cat([a.attn_q.bias, a.attn_k.bias, a.attn_v.bias]) if a.attn_q.bias is not None else None
        a.fused_qkv = (qkv, bias) if qkv is not None else None
        if blk.moe is None:
            blk.fused_gate_up = fuse_rows([blk.ffn_gate, blk.ffn_up], interleave=True)
        else:  # a mixture of experts' gate and up stacks (backends/cuda_moe.py)
            fuse_experts(blk.moe)


# ---- the model's ops for prompts


def cuda_qkv(attn, x, layer: int, cache: KVCache, start: int, cos, sin):
    """project_qkv with rope and the cache writes in one Triton kernel (kernels/triton_prefill.py), the
    three products as one where fused. A cache of another dtype than x takes the reference op. (cache.k:
    one (L, ...) buffer or a list of per-layer ones, make_cache / layered_cache: indexed by layer alike.)"""
    if cache.k[layer].dtype != x.dtype or not attn.cfg.llama_layer:  # the families' rope sets: the reference op
        return project_qkv(attn, x, layer, cache, start, cos, sin)
    cfg, (B, T, _) = attn.cfg, x.shape
    if attn.fused_qkv is not None:
        qkv = linear(x, *attn.fused_qkv)
        q, k, v = qkv.split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim], -1)
    else:
        q, k, v = attn.attn_q(x), attn.attn_k(x), attn.attn_v(x)
    if cfg.qk_norm:
        q = attn.attn_q_norm(q.view(B, T, cfg.n_heads, cfg.head_dim))
        k = attn.attn_k_norm(k.view(B, T, cfg.n_kv_heads, cfg.head_dim))
    return rope_cache(q.reshape(B, T, -1), k.reshape(B, T, -1), v, cache.k[layer], cache.v[layer], start, cos,
                      sin, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)


def cuda_mlp_in(blk, h: torch.Tensor) -> torch.Tensor:
    """silu(gate(h)) * up(h) by one Triton kernel, over the fused gate/up product's interleaved pairs
    (other activations: model.glu on the same pairs)."""
    if blk.cfg.activation != "silu":
        if blk.fused_gate_up is None:
            return glu_input(blk, h)
        y = linear(h, blk.fused_gate_up)
        return glu(blk.cfg, y[..., 0::2], y[..., 1::2])
    if blk.fused_gate_up is not None:
        return silu_mul(linear(h, blk.fused_gate_up))
    return silu_mul(blk.ffn_gate(h), blk.ffn_up(h))


CUDA_OPS = Ops(rmsnorm=rmsnorm_rows, qkv=cuda_qkv, mlp_in=cuda_mlp_in, moe=moe_prefill)


# ---- prompts: decoded weights kept where memory allows


def prompt_qweights(model: Transformer) -> list[QWeight]:
    """The quantized weights of the prompt forward's products (cuda_qkv's q|k|v, o, mlp_in's gate/up,
    down: cuda_graph.layer_products; experts and the output head, whose prompt product is one row, are
    not among them)."""
    return [w for w in layer_products(model) if isinstance(w, QWeight) and not isinstance(w, BlockQWeight)]


def keep_dense_prompt_weights(model: Transformer, dtype: torch.dtype, budget: int, head: bool = False) -> int:
    """Each prompt product's weight decoded to dtype once and kept as its QWeight.dense (what
    kernels/linear.dequant_product would decode on every prompt: the same values, so the same products)
    when all of them fit in `budget` bytes -> bytes kept (0: none, nothing changed). head: the output
    head's too (a quantized one) where it fits beside them, for the dense decode steps of many slots
    (cuda_slots.dense_ready)."""
    ws, out = prompt_qweights(model), model.output_weight()
    sets = [ws]
    if head and type(out) is QWeight and cuda_slots.takes_dense_steps(model):
        sets.insert(0, ws + [out])
    for ws in sets:
        need = sum(w.shape[0] * w.shape[1] for w in ws) * dtype.itemsize
        if ws and need <= budget:
            for w in ws:
                w.dense = dequantize_qweight(w, dtype)
            return need
    return 0


# ---- prompts: a shape seen before replays a graph
#
# A prefill of T tokens launches ~11 kernels a layer and is bound by the host's launch time for large
# models (docs/PERFORMANCE.md). When the same (T, start) comes again (a benchmark's repetitions, a
# fixed-length batch job) the forward is captured once and replayed: one launch. A new shape runs
# eagerly; the second time it is captured (eager warm-up, then capture), after that replayed. One
# graph is kept per cache (the last shape captured). Reference: the eager forward itself (the graph
# replays exactly its kernels, writing the same cache rows).


class PrefillGraph:
    def __init__(self, model: Transformer, cache: KVCache):
        self.model, self.cache = model, cache
        self.seen: tuple | None = None  # the last shape run eagerly
        self.key: tuple | None = None  # the captured shape
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tokens: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None

    def _capture(self, tokens: torch.Tensor, start: int) -> None:
        self.graph = None  # free the previous graph's pool first
        self.tokens = tokens.clone()
        self.graph, self.logits = captured(lambda: self.model(self.tokens, self.cache, start, last_only=True))

    def run(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens (B, T) at positions [start, start + T) -> logits (B, 1, V) of the last position."""
        key = (tuple(tokens.shape), start)
        if key != self.key and key == self.seen:
            self._capture(tokens, start)
            self.key = key
        if key == self.key:
            self.tokens.copy_(tokens)
            self.graph.replay()
            self.cache.length = start + tokens.shape[1]
            return self.logits.clone()
        self.seen = key
        return self.model(tokens, self.cache, start, last_only=True)


# ---- the runtime

# The fields of the families beyond the Llama layer that the decode step's kernels implement
# (cuda_graph.GraphDecoder's family path, cuda_moe.py's experts); a config setting any other (Gemma 4's)
# runs CudaEagerRuntime.
GRAPH_FIELDS = {"n_experts": 0, "n_experts_used": 0, "expert_ffn_dim": 0, "moe_norm_topk": True,
                "moe_bias": False, "moe_gating": "softmax", "swiglu_limit": None,
                "embed_scale": 1.0, "post_norms": False, "attn_scale": None, "attn_softcap": None,
                "final_softcap": None, "attn_out_bias": False, "attn_sinks": False, "sliding_window": None,
                "sliding_layers": (), "rope_theta_local": None, "rope_layers": (), "rotary_dim": None,
                "rope_attn_factor": 1.0, "rope_original_context": None, "activation": "silu"}


def covers(cfg: ModelConfig) -> bool:
    """CudaRuntime runs cfg: the Llama layer, or only GRAPH_FIELDS' variants of it, with power-of-two
    heads of >= 16 dims (the attention kernels' tiles); mixtures of experts (Mixtral, Qwen3-MoE,
    gpt-oss) of silu or gpt-oss's swiglu experts whose widths are whole 32-value blocks."""
    d = cfg.head_dim
    acts = ("silu", "swiglu_oai") if cfg.n_experts else ("silu", "gelu_tanh")
    experts = not cfg.n_experts or (cfg.expert_ffn_dim % 32 == 0 and cfg.dim % 32 == 0)
    return (replace(cfg, **GRAPH_FIELDS).llama_layer and cfg.activation in acts and experts
            and (cfg.llama_layer or (d >= 16 and d & (d - 1) == 0)))


class CudaRuntime(Runtime):
    ops = CUDA_OPS
    quantized = "qweight"
    prepare = staticmethod(fuse)
    warms_up = True
    first_tokens_compile = True
    steps_async = True

    def __init__(self, model: Transformer):
        super().__init__(model)
        # one decoder per (tokens a step, greedy) and one prefill graph, for the cache last used: a
        # new cache replaces them (and frees their graphs)
        self.decoders: dict[tuple[int, bool], GraphDecoder] = {}
        self.prefill_graph: PrefillGraph | None = None
        # tensor parallelism (model.tp): the decode step's all-reduce (backends/cuda_tp.REDUCERS), picked
        # by the first decoder ("auto": the push kernel where it sets up and checks out, else NCCL)
        # and kept for the others; set it before the first step to force one (bench/tp_speed.py)
        self.all_reduce = "auto"
        # the share of free GPU memory the prompt products' decoded weights may take, decided at the
        # first prompt (keep_dense_prompt_weights; settings.GpuSettings); then the bytes kept
        self.dense_prompt_share = DEFAULT_GPU.dense_prompt_share
        self.dense_prompt_bytes: int | None = None
        # decode_slots' buckets of at least this many rows multiply those dense values (cuda_slots)
        self.dense_decode_rows = DEFAULT_GPU.dense_decode_rows

    def keep_dense_prompts(self, slots: Slots | None = None) -> None:
        """Once, before the first prompt pass (the KV cache or the slots already allocated, so their
        memory is not what the copies take): keep_dense_prompt_weights within dense_prompt_share of the
        memory then free. Every later prompt graph and pass multiplies the kept copies. slots: the first
        pass is that slot cache's (serve's); where its steps can reach dense_decode_rows slots (dense
        steps: cuda_slots) the head's copy is kept too."""
        if self.dense_prompt_bytes is None:
            free = torch.cuda.mem_get_info(self.device)[0]
            budget = int(free * self.dense_prompt_share)
            most = cuda_slots.bucket(len(slots.lengths)) if slots is not None else 0
            head = 0 < self.dense_decode_rows <= most
            self.dense_prompt_bytes = keep_dense_prompt_weights(self.model, self.dtype, budget, head)

    def release(self, slots: Sequence[Slots] = ()) -> None:
        """The decode steps' and the prompt's graphs, and the slots' (the tensor-parallel ones hold NCCL
        collectives), once the device has finished with them."""
        self.sync()
        self.decoders.clear()
        self.prefill_graph = None
        super().release(slots)

    def _reducer_picked(self, dec: GraphDecoder) -> GraphDecoder:
        if dec.reducer is not None:
            self.all_reduce = dec.reducer.name
        return dec

    def decoder(self, cache: KVCache, tokens: int = 1, greedy: bool = False) -> GraphDecoder:
        dec = self.decoders.get((tokens, greedy))
        if dec is None or dec.cache is not cache:
            dec = GraphDecoder(self.model, cache, tokens=tokens, greedy=greedy, reducer=self.all_reduce)
            self.decoders[(tokens, greedy)] = self._reducer_picked(dec)
        return dec

    def prefill(self, cache: KVCache, rows: list[list[int]], start: int = 0) -> torch.Tensor:
        self.keep_dense_prompts()
        if self.prefill_graph is None or self.prefill_graph.cache is not cache:
            self.prefill_graph = PrefillGraph(self.model, cache)
        tokens = torch.tensor(rows, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            return self.prefill_graph.run(tokens, start)[:, -1]

    def decode(self, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
        """Every sequence of the cache in one replayed graph of batch 1's kernels (the products read
        each weight once for all B rows); the logits buffer is overwritten by the next step."""
        return self.decoder(cache).step(tokens).view(cache.k.shape[1], -1)

    def greedy_step(self, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
        """The argmax is the graph's last kernel and the ids stay the decoder's input buffer
        (overwritten by the next step; passed back, they are not copied): one launch a token."""
        return self.decoder(cache, greedy=True).step_greedy(tokens)

    def graphs(self, cache: KVCache) -> bool:
        """Verify passes replay the decode step's graph for several tokens: batch 1."""
        return cache.k.shape[1] == 1

    def verify(self, cache: KVCache, ids: list[int]) -> torch.Tensor:
        """The decode step's graph for T tokens: each row as a plain step computes it (so greedy
        speculative ids are plain decoding's)."""
        if not self.graphs(cache):
            return super().verify(cache, ids)
        return self.decoder(cache, len(ids)).step(torch.tensor(ids, device=self.device))

    def most_drafts(self, cache: KVCache) -> int | None:
        return MAX_ROWS - 1 if self.graphs(cache) else None

    @torch.inference_mode()
    def warm_verify(self, cache: KVCache) -> None:
        """Capture now the verify graph of every pass size this cache can take (each is otherwise
        captured on first use, costing far more than a step: benchmarks keep it out of their timings).
        Rows past cache.length are written, which later steps overwrite."""
        most = self.most_drafts(cache)
        if most is None:
            return
        start = cache.length
        for t in range(2, most + 2):
            if start + t <= cache.capacity:
                self.decoder(cache, t).step(torch.zeros(t, dtype=torch.long, device=self.device))
                cache.length = start

    def prefill_slot(self, slots: Slots, slot: int, ids: list[int], start: int) -> torch.Tensor:
        """A prompt whose padded length fits the slot replays its bucket's graph (backends/cuda_prompt.py:
        serve's prompts are host-bound eagerly); others (and a bucket whose graph found no memory) run
        the eager forward."""
        self.keep_dense_prompts(slots)
        graphs = prompt_graphs(self.model, slots)
        if graphs is None or not graphs.takes(len(ids), start):
            return super().prefill_slot(slots, slot, ids, start)
        check_prefill(slots, slot, ids, start)
        logits = graphs.run(slots, slot, ids, start)
        if logits is None:  # no memory for the bucket's graph
            return super().prefill_slot(slots, slot, ids, start)
        slots.lengths[slot] = start + len(ids)
        return logits

    def prefill_slots(self, slots: Slots, which: list[int], prompts: list[list[int]],
                      starts: list[int]) -> torch.Tensor:
        """Several prompts replay a graph of several (backends/cuda_prompt.py) where one takes them;
        others (and a bucket whose graph found no memory) run the eager forward."""
        self.keep_dense_prompts(slots)
        graphs = prompt_graphs(self.model, slots)
        key = None if graphs is None else graphs.many_bucket(prompts, starts, DEFAULT_SERVE.prefill_tokens)
        if key is not None:  # (the eager pass checks its own input, as prefill_slot's does)
            check_prefills(slots, which, prompts, starts)
            logits = graphs.run_many(slots, key, which, prompts, starts)
            if logits is not None:
                for s, ids, st in zip(which, prompts, starts):
                    slots.lengths[s] = st + len(ids)
                return logits
        return super().prefill_slots(slots, which, prompts, starts)

    def decode_slots(self, slots: Slots, which: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """One replayed graph over the step's slots, each at its own position (backends/cuda_slots.py:
        a graph per bucket of slot counts); the logits are the bucket's buffer, overwritten by its
        next step."""
        check_rows(slots, which, tokens)
        self.keep_dense_prompts(slots)  # (before the first decoder: its dense steps multiply the copies)
        return cuda_slots.decode_slots(self.model, slots, which, tokens, reducer=self.all_reduce,
                                       dense_rows=self.dense_decode_rows)

    @torch.inference_mode()
    def warm_up_slots(self, slots: Slots, prefill_tokens: int = DEFAULT_SERVE.prefill_tokens) -> int:
        """Every prompt kernel variant a request can reach (backends/cuda_warmup.py: one prompt and
        several, each product row count, rope's position classes, the largest pass of prefill_tokens
        rows), then the decode graph of every bucket of slot counts up to the slots' number
        (cuda_slots.warm_up) -> graphs captured. A fresh server's first requests otherwise wait for
        kernel compilations and captures. Every slot is left empty (length 0; the rows written are
        overwritten by the first prompts)."""
        n = len(slots.lengths)
        self.keep_dense_prompts(slots)
        if slots.capacity < 8:
            return 0
        warm_up_prompts(self, slots, prefill_tokens, one=super().prefill_slot)  # the eager pass (prompts no
        # bucket takes); then every bucket's graph
        graphs = prompt_graphs(self.model, slots)
        captured = graphs.capture_all(slots, prefill_tokens) if graphs is not None else 0
        captured += cuda_slots.warm_up(self.model, slots, reducer=self.all_reduce, dense_rows=self.dense_decode_rows)
        slots.lengths[:] = [0] * n
        self.sync()
        return captured

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


class CudaEagerRuntime(Runtime):
    """Configs beyond the Llama layer: the torch forward with QWeights for the Triton products, no
    fusion and no graphs (CudaRuntime's ops and decoders implement the Llama layer only)."""

    quantized = "qweight"
    first_tokens_compile = True  # the Triton products' compilations

    def verify(self, cache: KVCache, ids: list[int]) -> torch.Tensor:
        """One decode step per id -> logits (T, V), each row plain decoding's bits. A T-row eager forward
        rounds differently from T one-row steps (cuBLAS and the attention pick kernels by shape), which
        flipped greedy choices of speculative decoding on bf16 Gemma 4 (tests/gpu/test_gpu_gemma4.py);
        CudaRuntime's verify pass is batch-invariant instead, and one pass."""
        return torch.stack([self.decode(cache, torch.tensor([t], device=self.device))[0].clone() for t in ids])
