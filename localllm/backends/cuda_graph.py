"""Batch-1 decode on CUDA as one CUDA graph: static buffers, the position as a device tensor, no host sync.

A step (T tokens at positions cache.length.., T = 1 for plain decoding, K + 1 for speculative
decoding's verify pass; for each of the cache's B sequences, rows b T + t, every sequence at the same
position: bench's batches of equal prompts) per layer is:
  h = RMSNorm(x)                       (a norm kernel: bf16 rows for dense weights; for integer-dot
                                        weights the kernel that quantizes h to int8)
  qkv += W_qkv @ h                     (q|k|v fused into one weight)
  a = attention(rope(q), cache[:pos+1]) (kernels/triton_attention.py, split over 64-row chunks, then
                                        combined; the chunk programs rotate q and k and write k, v
                                        into the cache; the combine clears qkv)
  x += W_o @ a
  gu += W_gate|up @ RMSNorm(x)         (gate/up rows interleaved)
  a = silu(g) * u                      (triton_decode.glu_rows, or the int8 quantizer; clears gu)
  x += W_down @ a
then logits = W_out @ RMSNorm(x) in fp32 (with greedy, then each row's argmax as the next step's input
ids: one launch a token). x (the residual stream), qkv and gu are int64 fixed-point
accumulators (triton_epilogue.FIXED_ONE): products split over K for enough warps add their parts
into them with integer atomics, which give the same sum in any order. So the same step gives the
same bits every time, and since every kernel computes each token's row the same way whatever T is,
the verify pass gives plain decoding's bits (speculative decoding's greedy ids are plain decoding's).
Dense weights take tensor-core products (kernels/triton_dense.py); Q8_0/Q4_0/Q4_K/Q6_K/MXFP4/IQ4_NL/
IQ4_XS weights integer dot products (kernels/triton_q8.py: INT_DOT_TYPES). Every kernel matches the module ops of model.py (its
reference) within rounding (the products' sums are added to x unrounded, and Q8_0's rounding of the
activations for integer-dot weights): tests/gpu/test_gpu_logits.py checks it against the CPU fp32
model. q|k|v and gate/up are fused once at load (backends/cuda.py's fuse), not here. Q/k norms (Gemma 3,
Qwen3): one kernel normalises, rotates and stores from the q|k|v accumulator (triton_norm_fused's
norm_rope_store); post norms (Gemma): the product sums into a third accumulator (h_acc) that
add_normed normalises into x.

Tensor parallelism (model.tp set: the model is this rank's shard, localllm/parallel.py's layout): the o
and down products add this rank's partial sums into the reducer's int64 accumulator, which the
reducer sums over the ranks and adds to x before the next norm reads it (the post norms' h_acc is
summed likewise); the embedding writes this rank's vocabulary rows and the reducer sets x to the sum;
the head's logits of this rank's vocabulary rows are gathered into (rows, V) before the argmax. Each is
a collective captured in the graph (backends/cuda_tp.py); integer sums keep every rank's x identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localllm.kernels.linear import cublas_linear, fused_linear
from localllm.kernels.qweight import INT_DOT_TYPES, QWeight
from localllm.kernels.triton_attention import decode_attention, rope_store
from localllm.kernels.triton_decode import embed_fixed, glu_rows, greedy_ids, greedy_state
from localllm.kernels.triton_epilogue import COUNTERS
from localllm.kernels.triton_norm_fused import add_normed, norm_rope_store
from localllm.kernels.triton_prefill import rmsnorm_rows
from localllm.kernels.triton_quant_act import WHOLE_ROW_BLOCKS, quantize_act
from localllm.kernels.triton_rope import rope_store_family

from ..cache import KVCache
from ..model import Transformer
from ..rope import rotary_dims
from .cuda_moe import MoEDecode
from ..tp_model import gather_logits
from .cuda_tp import make_reducer


def captured(run, pool=None, restore=None, device=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """run() once on a side stream (it compiles and loads every kernel first, as torch.cuda.graphs asks),
    restore() (what that run changed which the capture must find as before: positions), then run()
    captured -> (the graph, what the captured run returned: its static output). pool: a graph memory
    pool to share (torch.cuda.graph's); device: the streams' (None: the current one)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    if restore is not None:
        restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


def int_dot(w) -> bool:
    """w is a QWeight taking the integer-dot kernels (kernels/triton_q8.py)."""
    return isinstance(w, QWeight) and w.qtype in INT_DOT_TYPES


class LayerWeights:
    def __init__(self, blk, inv_freq: torch.Tensor | None, window: int | None):
        a = blk.attn
        self.attn, self.blk = a, blk
        self.qkv, self.qkv_bias = a.fused_qkv if a.fused_qkv is not None else (None, None)
        self.gate_up = blk.fused_gate_up
        self.inv_freq = inv_freq  # (R/2,) fp32 of the layer's rope set; None: a NoPE layer
        self.window = window  # a sliding layer's window, else None
        self.sinks = a.attn_sinks.weight.float().contiguous() if a.attn_sinks is not None else None


def layer_products(model: Transformer) -> list:
    """The layers' dense-layer product weights as the decode step and the prompt forward take them
    (fused once at load: backends/cuda.py's fuse): q|k|v (or q, k, v), o, gate/up (or gate, up) and
    down; a mixture of experts' layer only its attention's (its experts: cuda_moe)."""
    ws = []
    for blk in model.blk:
        a = blk.attn
        ws += [a.fused_qkv[0]] if a.fused_qkv is not None else [a.attn_q.w, a.attn_k.w, a.attn_v.w]
        ws.append(a.attn_output.w)
        if blk.moe is None:
            ws += [blk.fused_gate_up] if blk.fused_gate_up is not None else [blk.ffn_gate.w, blk.ffn_up.w]
            ws.append(blk.ffn_down.w)
    return ws


def dense_values(w, dtype: torch.dtype) -> torch.Tensor | None:
    """A product weight's dense values (N, K) in dtype for cuBLAS (a dense step's products): a dense
    weight itself, or a QWeight's kept decoded copy (backends/cuda.py's keep_dense_prompt_weights);
    None where it has none in that dtype."""
    d = w if isinstance(w, torch.Tensor) else getattr(w, "dense", None)
    return d if isinstance(d, torch.Tensor) and d.dtype == dtype else None


def inv_freqs(model: Transformer, device, capacity: int) -> list[torch.Tensor | None]:
    """Per layer the inverse frequencies (R/2,) fp32 of its rope set (rope.layer_ropes' sets: global
    with the divisors of a cache of this capacity (Transformer.rope_divisors: LongRoPE's set), local
    base for sliding layers where set), None for NoPE layers."""
    cfg, r = model.cfg, rotary_dims(model.cfg)
    exponent = torch.arange(0, r, 2, dtype=torch.int64, device=device).float() / r
    glob = (1.0 / (cfg.rope_theta**exponent) / model.rope_divisors(capacity).float()).contiguous()
    local = glob if cfg.rope_theta_local is None else (1.0 / (cfg.rope_theta_local**exponent)).contiguous()
    return [None if not cfg.has_rope(i) else local if cfg.sliding(i) else glob for i in range(cfg.n_layers)]


class GraphDecoder:
    """Runs `tokens` tokens per sequence per step() into `cache` (batch B: its B sequences at once),
    replaying a captured CUDA graph: one (plain decoding), or speculative decoding's verify pass of the
    last id and its drafts (batch 1). Every
    kernel computes each token's row exactly as a one-token step computes it (the products share
    their weight reads across rows, triton_epilogue.MAX_ROWS at most), so verified ids are plain
    decoding's ids."""

    def __init__(self, model: Transformer, cache: KVCache, use_graph: bool = True, tokens: int = 1,
                 greedy: bool = False, rows: int | None = None, reducer: str = "auto", dense: bool = False):
        cfg = model.cfg
        self.model, self.cache, self.cfg, self.use_graph, self.tokens = model, cache, cfg, use_graph, tokens
        # a dense step: the layers' products whose weights have dense values in the activation dtype (a
        # dense model's, or the quantized weights' decoded copies: backends/cuda.py's
        # keep_dense_prompt_weights) multiply them through cuBLAS (kernels/linear.cublas_linear), fed by
        # the float forms of the kernels around them; the others (the head without a copy) take their
        # kernels. For many rows, where the batch-invariant kernels are bound by per-row work: a row's
        # bits then depend on the step's row count (cuBLAS picks its kernel by shape).
        self.dense = dense
        # sequences x tokens each (rows given: cuda_slots.SlotDecoder's rows, any slots of the cache)
        self.rows = rows = rows or cache.k.shape[1] * tokens
        # greedy: the step ends with each row's argmax written into its own input ids (step_greedy)
        assert not greedy or tokens == 1, "greedy ids are the next step's input: one token a step"
        self.greedy = greedy
        dev = cache.k.device
        # the Llama layer's kernels, or the families' variants (post norms, gelu, windows, soft-caps,
        # sinks, rope per layer: backends/cuda.py's covers)
        self.family = not cfg.llama_layer
        freqs = inv_freqs(model, dev, cache.capacity)
        self.layers = [LayerWeights(b, freqs[i], cfg.sliding_window if cfg.sliding(i) else None)
                       for i, b in enumerate(model.blk)]
        self.inv_freq = freqs[0]
        self.act = model.token_embd.weight.dtype
        self.token = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int32, device=dev)
        # None: row r is sequence r // tokens at pos + r % tokens; else (SlotDecoder) (rows,) int32 with pos
        # (rows,): row r is the cache sequence slot[r] at pos[r] (the kernels' slots argument)
        self.slot: torch.Tensor | None = None
        # int64 fixed-point accumulators (triton_epilogue.FIXED_ONE) that split products add into by
        # integer atomics (the same sum in any order): the residual stream, and the q|k|v and gate/up
        # sums, each of these zeroed by the kernel that reads it (rope_store; glu_rows or quantize_act's
        # GLU form).
        self.x = torch.zeros(rows, cfg.dim, dtype=torch.int64, device=dev)
        self.qkv_acc = torch.zeros(rows, cfg.q_dim + 2 * cfg.kv_dim, dtype=torch.int64, device=dev)
        self.gu_acc = torch.zeros(rows, 2 * cfg.ffn_dim if not cfg.n_experts else 0, dtype=torch.int64, device=dev)
        # mixture-of-experts layers: routing and the chosen experts' products on the device (cuda_moe.py)
        self.moe = MoEDecode(model, rows, self.act) if cfg.n_experts else None
        # post norms (Gemma): the sums of the product they normalise (add_normed reads and clears it)
        self.h_acc = torch.zeros(rows, cfg.dim, dtype=torch.int64, device=dev) if cfg.post_norms else None
        # the next products' int8 input (triton_quant_act.quantize_act's (q, d, s) of RMSNorm(x)) where the post
        # norm's kernel made it (add_normed's quantize), taken by them (_take_xq)
        self.xq_next: tuple | None = None
        # split products' per-program counters (zero between kernels; kernels/triton_epilogue.split_buffers)
        self.counters = torch.zeros(COUNTERS, dtype=torch.int32, device=dev)
        self.best, self.count = greedy_state(rows, dev)  # greedy_ids' state
        self.expected_len = -1
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        # tensor parallelism: the rank's collectives (reducer: cuda_tp.REDUCERS, the runtime's choice)
        self.tp = getattr(model, "tp", None)
        self.reducer = None
        if self.tp is not None:
            assert not cfg.n_experts, "tensor parallelism shards dense layers only"
            self.reducer = make_reducer(self.tp, rows, cfg.dim, dev, reducer)
            # this rank's vocabulary rows: [rank k, rank k + its rows), k = ceil(V / N) (tp_shard.vocab_part:
            # the last rank's part may be shorter; its logits are padded to k for the gather)
            k = -(-cfg.vocab_size // self.tp.world)
            self.vocab_first = min(cfg.vocab_size, self.tp.rank * k)
            self.gathered = torch.empty(self.tp.world, rows, k, dtype=torch.float32, device=dev)

    def _residual(self, a, w, x, **kw) -> torch.Tensor:
        """x (the int64 residual) += W @ a (the o and down products): with tensor parallelism the
        partial sums of this rank's input columns go to the reducer's accumulator, summed over the
        ranks into x."""
        if self.reducer is None:
            return self._lin(a, w, residual=x, split=None, inplace=True, **kw)
        self._lin(a, w, residual=self.reducer.take(), split=None, inplace=True, **kw)
        return self.reducer.reduce(x)

    def _dense(self, w) -> torch.Tensor | None:
        """In a dense step, w's dense values (N, K) for cuBLAS; None: w takes its kernel."""
        return dense_values(w, self.act) if self.dense else None

    def _int_dot(self, w) -> bool:
        """w's product takes an int8 x (made by the kernel before it where that kernel can)."""
        return int_dot(w) and self._dense(w) is None

    def _lin(self, x, w, norm=None, **kw) -> torch.Tensor:
        d = self._dense(w)
        if d is not None:
            assert "xq" not in kw and not kw.get("glu"), "a dense step's products take float x"
            return cublas_linear(x, d, norm=norm, act_dtype=self.act, **kw)
        quantized = isinstance(w, QWeight)
        if quantized and w.has_kernel and norm is not None and w.qtype not in INT_DOT_TYPES and "xq" not in kw:
            # Float-decoding matvecs are bound by instructions: normalise once (a small kernel) instead
            # of in every program's prologue. (Integer-dot ones fuse the norm into quantizing x.)
            x, norm = rmsnorm_rows(x, *norm), None
        return fused_linear(x, w, norm=norm, act_dtype=self.act, counters=self.counters, **kw)

    def _attention(self, x: torch.Tensor, i: int, L: LayerWeights) -> torch.Tensor:
        cfg, a = self.cfg, L.attn
        norm = (L.blk.attn_norm.weight, cfg.norm_eps)
        ms = (a.attn_q, a.attn_k, a.attn_v)
        # Products split over K for enough warps, summed into the accumulator (zero here: rope_store
        # clears it as it reads); separate integer-dot products (Q4_K_M's Q6_K attn_v) share one
        # quantized x.
        qkv = self.qkv_acc
        xq = self._take_xq()
        if L.qkv is not None:
            kw = {"xq": xq} if xq is not None else {"norm": norm}
            self._lin(x, L.qkv, bias=L.qkv_bias, residual=qkv, inplace=True, split=None, **kw)
        else:
            if xq is None and all(self._int_dot(m.w) for m in ms):
                xq = quantize_act(x, *norm)
            start = 0
            for j, m in enumerate(ms):
                n = m.w.shape[0]
                chain = 1 if j == 0 else 2  # triton_q8's CHAIN (first, later): the products overlap
                kw = {"xq": xq, "chain": chain} if xq is not None else {"norm": norm}
                self._lin(x, m.w, bias=m.bias, residual=qkv[:, start:start + n], inplace=True, split=None, **kw)
                start += n
        kc, vc = self.cache.k[i], self.cache.v[i]  # (B, Hkv, S, D)
        q = None
        if cfg.qk_norm:  # q/k norms, rope, the cache writes and clearing qkv: one kernel
            q = norm_rope_store(qkv, kc, vc, self.pos, L.inv_freq, a.attn_q_norm.weight, a.attn_k_norm.weight,
                                cfg.norm_eps, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, rotary_dims(cfg),
                                cfg.rope_attn_factor, slots=self.slot)
        if self.family:
            return self._family_attention(x, q, kc, vc, L)
        rope = None
        if q is None and cfg.head_dim >= 16:
            # the attention rotates q, k and stores k, v itself (and clears the accumulator)
            rope = (qkv, self.inv_freq, cfg.head_dim)
        elif q is None:
            q = rope_store(qkv, kc, vc, self.pos, self.inv_freq, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, clear=True,
                           slots=self.slot)
        kw = {"tokens": self.tokens, "rope": rope, "slots": self.slot}
        d32 = cfg.head_dim // 32
        if self._int_dot(a.attn_output.w) and cfg.head_dim % 32 == 0 and d32 & (d32 - 1) == 0:
            # the output projection's int8 input comes from the attention's combine kernel
            att, xq = decode_attention(q, kc, vc, self.pos, cfg.n_kv_heads, quantize=True, **kw)
            return self._residual(att, a.attn_output.w, x, xq=xq)
        att = decode_attention(q, kc, vc, self.pos, cfg.n_kv_heads, **kw)
        return self._residual(att, a.attn_output.w, x)

    def _family_attention(self, x, q, kc, vc, L: LayerWeights) -> torch.Tensor:
        """The attention of a layer beyond the Llama layer: rope of its own set (kernels/triton_rope.py;
        q given: the q/k-norm kernel did it), attention.attend's variants, attn_output's bias, and the
        post-attention norm."""
        cfg, a = self.cfg, L.attn
        if q is None:
            q = rope_store_family(self.qkv_acc, kc, vc, self.pos, L.inv_freq, cfg.n_heads, cfg.n_kv_heads,
                                  cfg.head_dim, rotary_dims(cfg), cfg.rope_attn_factor, clear=True, slots=self.slot)
        kw = dict(tokens=self.tokens, scale=cfg.attn_scale, softcap=cfg.attn_softcap, window=L.window, sinks=L.sinks,
                  slots=self.slot)
        d32 = cfg.head_dim // 32
        bias = a.attn_output.bias
        if self._int_dot(a.attn_output.w) and cfg.head_dim % 32 == 0 and d32 & (d32 - 1) == 0:
            att, xq = decode_attention(q, kc, vc, self.pos, cfg.n_kv_heads, quantize=True, **kw)
            kw = {"xq": xq}
        else:
            att, kw = decode_attention(q, kc, vc, self.pos, cfg.n_kv_heads, **kw), {}
        if L.blk.post_attention_norm is None:
            return self._residual(att, a.attn_output.w, x, bias=bias, **kw)
        self._lin(att, a.attn_output.w, bias=bias, residual=self.h_acc, split=None, inplace=True, **kw)
        if self.reducer is not None:
            self.reducer.all_reduce(self.h_acc)
        ffn = [L.gate_up] if L.gate_up is not None else []
        return self._add_normed(x, L.blk.post_attention_norm.weight, (L.blk.ffn_norm.weight, ffn))

    def _add_normed(self, x: torch.Tensor, weight: torch.Tensor, nxt: tuple) -> torch.Tensor:
        """x (the int64 fixed-point residual) += RMSNorm(h) (Gemma's post norms, in the weight's dtype
        as model.rmsnorm rounds it) of h, the product summed into h_acc (split K like the residual's
        products), rounded to the activation dtype as a product's output is; one kernel, h_acc cleared.
        nxt = (norm weight, weights) of the products that take x next: integer-dot ones take their
        int8 input from this kernel too (xq_next)."""
        nw, ws = nxt
        c = self.cfg.dim
        if ws and all(self._int_dot(w) for w in ws) and c % 32 == 0 and c // 32 <= WHOLE_ROW_BLOCKS:
            x, self.xq_next = add_normed(x, self.h_acc, weight, self.cfg.norm_eps, self.act,
                                         quantize=(nw, self.cfg.norm_eps))
            return x
        return add_normed(x, self.h_acc, weight, self.cfg.norm_eps, self.act)

    def _take_xq(self) -> tuple | None:
        """The int8 input the kernel before made for the products about to run (once)."""
        xq, self.xq_next = self.xq_next, None
        return xq

    def _next_products(self, i: int) -> tuple:
        """(norm weight, weights) of the products taking x after layer i - 1: layer i's q|k|v, or the head."""
        if i == len(self.layers):
            m = self.model
            return m.output_norm.weight, [m.output_weight()]
        L = self.layers[i]
        a = L.attn
        return L.blk.attn_norm.weight, [L.qkv] if L.qkv is not None else [a.attn_q.w, a.attn_k.w, a.attn_v.w]

    def _ffn(self, x: torch.Tensor, L: LayerWeights, i: int) -> torch.Tensor:
        b, norm = L.blk, (L.blk.ffn_norm.weight, self.cfg.norm_eps)
        gelu = self.cfg.activation == "gelu_tanh"
        kw = {}
        xq = self._take_xq()
        if b.moe is not None:  # (no post norms in these families: xq is None)
            return self.moe.ffn(x, b)
        if L.gate_up is not None:
            # gate/up sums split over K into the accumulator; silu(gate) * up is formed (and the
            # accumulator cleared) by glu_rows, or by the kernel that quantizes an integer-dot down
            # projection's input.
            nkw = {"xq": xq} if xq is not None else {"norm": norm}
            self._lin(x, L.gate_up, residual=self.gu_acc, inplace=True, split=None, **nkw)
            if self._int_dot(b.ffn_down.w):
                a, kw = x, {"xq": quantize_act(self.gu_acc, glu_dtype=self.act, gelu=gelu)}
            else:
                a = glu_rows(self.gu_acc, self.act, gelu=gelu)
        else:
            gate, up = (self._lin(x, m.w, norm=norm) for m in (b.ffn_gate, b.ffn_up))
            a = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
        if b.post_ffw_norm is None:
            return self._residual(a, b.ffn_down.w, x, **kw)
        self._lin(a, b.ffn_down.w, residual=self.h_acc, split=None, inplace=True, **kw)
        if self.reducer is not None:
            self.reducer.all_reduce(self.h_acc)
        return self._add_normed(x, b.post_ffw_norm.weight, self._next_products(i + 1))

    def _step(self) -> torch.Tensor:
        """tokens (T,) at positions pos.. -> logits (T, V) fp32; advances pos. Static inputs only."""
        m = self.model
        x = self.x  # (T, C) the residual stream, int64 fixed point
        if self.reducer is None:
            embed_fixed(self.token, m.token_embd.weight, x, scale=self.cfg.embed_scale)
        else:  # this rank's vocabulary rows (other ids: zeros), summed over the ranks into x
            embed_fixed(self.token, m.token_embd.weight, self.reducer.take(assign=True), scale=self.cfg.embed_scale,
                        first=self.vocab_first)
            self.reducer.reduce(x, assign=True)
        for i, L in enumerate(self.layers):
            x = self._attention(x, i, L)
            x = self._ffn(x, L, i)
        xq = self._take_xq()
        kw = {"xq": xq} if xq is not None else {"norm": (m.output_norm.weight, self.cfg.norm_eps)}
        logits = self._lin(x, m.output_weight(), out_dtype=torch.float32, **kw)
        if self.tp is not None:  # (rows, V / N) of this rank's vocabulary rows -> (rows, V)
            logits = gather_logits(logits, self.tp, self.cfg.vocab_size, self.gathered)
        if self.cfg.final_softcap is not None:  # Transformer.head's soft-cap
            c = self.cfg.final_softcap
            logits = torch.tanh(logits / c) * c
        if self.greedy:  # the ids into self.token, and pos advanced by the same kernel
            greedy_ids(logits, self.token, self.best, self.count, self.pos, self.tokens)
        else:
            self.pos += self.tokens
        return logits

    def _capture(self) -> None:
        start = self.cache.length  # the warm-up step (same writes as the real step) advances pos
        self.graph, self.logits = captured(self._step, restore=lambda: self.pos.fill_(start))
        self.pos.fill_(start)

    @torch.inference_mode()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """token: B T ids (any shape; sequence b's T ids at b T..) at positions cache.length.. -> logits
        (V,) fp32 for one row, (B T, V) for several. The returned tensor is overwritten by the next step."""
        if self.cache.length + self.tokens > self.cache.capacity:
            raise ValueError("the KV cache is full")
        if self.cache.length != self.expected_len:
            self.pos.fill_(self.cache.length)
        if self.use_graph and self.graph is None:
            self._capture()  # its warm-up step's cache rows are written again by the replay below
        if token.data_ptr() != self.token.data_ptr():  # (step_greedy's ids, or a view, come back as they are)
            self.token.copy_(token.view(self.rows))
        if not self.use_graph:
            self.logits = self._step()
        else:
            self.graph.replay()
        self.cache.length += self.tokens
        self.expected_len = self.cache.length
        return self.logits[0] if self.rows == 1 else self.logits

    def step_greedy(self, token: torch.Tensor) -> torch.Tensor:
        """step(token), -> the rows' greedy ids (B,) int64 computed inside the step (greedy=True): the
        next step's input buffer itself, overwritten by it; pass it back as is (no copy)."""
        assert self.greedy
        self.step(token)
        return self.token
