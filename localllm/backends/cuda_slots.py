"""decode_slots on CUDA (issue 22's continuous batching): one replayed graph a step over the rows of
B slots of one slot cache, each at its own position.

A step of N slots runs the decoder of bucket B = bucket(N) (1, 2, 4, .., 64, then multiples of 64):
GraphDecoder's kernels (backends/cuda_graph.py) over B rows, where row r is slot slot[r]'s token at
pos[r] (positions and slot indices are device tensors the graph reads: the kernels' `slots` argument,
kernels/triton_rope.row_seq_pos), so one graph captured per bucket replays for any slots and
positions. Row r's rope angles are pos[r]'s, its k, v go to cache row (slot[r], pos[r]) and it
attends to that slot's rows [0, pos[r]].

Padding: rows N..B-1 repeat row 0 (its token, slot and position). They compute row 0's bits and write
row 0's cache rows with the same bytes (every kernel computes each row alone: the products' per-row
sums, the int64 fixed-point accumulators), so no kernel needs a mask and no other slot is touched.

Batch invariance: a row's logits are the same bits whatever B and the other rows are: the attention
and rope kernels work per row; the integer-dot and float-decoding products compute each row's sum the
same whatever rows share a program (triton_epilogue.rows_per_program: up to 8 rows share a weight tile,
larger buckets in groups of 8; buckets of triton_mma.MMA_ROWS (16) rows or more take Q8_0 / Q4_0 / Q4_K /
Q6_K products on tensor cores, kernels/triton_mma.py, whose sums are the dp4a kernels' bits), with
their K split chosen from the weight's shape only. Dense (bf16)
weights take the tensor-core kernel up to triton_gemv.DENSE_ROWS (16) rows and another kernel past
that, so a model with dense products runs a step of more slots as several passes of at most 16.

Dense steps: a bucket of at least dense_rows rows (the runtime's GpuSettings.dense_decode_rows, 32) of a
model whose layer weights all have dense values (dense_ready: a dense model's own, or the quantized
weights' decoded copies that the runtime keeps for prompts) runs GraphDecoder's dense form, in one pass:
cuBLAS products on float x (kernels/linear.cublas_linear). At 64 rows of the 8B Q4_K_M shape that step
is 2.6x faster than the integer tensor-core kernels (docs/PERFORMANCE.md, fourteenth session); its
rows' bits depend on the bucket (cuBLAS picks kernels by shape), so batch invariance holds below it.

The decoders (and their graphs) live in slots.tables, dropped with the Slots. Each graph keeps its
own memory pool (intermediates only: the state between steps is the decoder's buffers).
"""

from __future__ import annotations

import torch

from localllm.kernels.triton_gemv import DENSE_ROWS

from ..model import Transformer
from ..slots import Slots
from .cuda_graph import GraphDecoder, captured, dense_values, layer_products

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(n: int) -> int:
    """The rows of the graph that runs a step of n slots: the smallest bucket >= n, past the last a
    multiple of it."""
    for b in BUCKETS:
        if n <= b:
            return b
    return -(-n // BUCKETS[-1]) * BUCKETS[-1]


class SlotDecoder(GraphDecoder):
    """GraphDecoder over `rows` rows, each one token of any slot of `cache` (the slots' (L, n, Hkv, S, D)
    cache) at its own position."""

    def __init__(self, model: Transformer, cache, rows: int, use_graph: bool = True, reducer: str = "auto",
                 dense: bool = False):
        super().__init__(model, cache, use_graph=use_graph, rows=rows, reducer=reducer, dense=dense)
        # positions (row 0) and slot indices (row 1) of the rows, int32: the graph's inputs with token
        self.meta = torch.zeros(2, rows, dtype=torch.int32, device=cache.k.device)
        self.pos, self.slot = self.meta[0], self.meta[1]
        # their host copy: pinned on CUDA, so its upload queues behind the previous replay without a
        # host sync; `uploaded` marks when the last upload has read it (then it may be rewritten)
        cuda = cache.k.device.type == "cuda"
        self.staged = torch.zeros(2, rows, dtype=torch.int32, pin_memory=cuda)
        self.uploaded = torch.cuda.Event() if cuda else None
        self.captures = 0  # graphs captured (one per decoder: tests check it)

    def _capture(self) -> None:
        meta = self.meta.clone()  # the warm-up step advances pos; it writes this step's cache rows,
        # which the replay writes again with the same bytes
        self.graph, self.logits = captured(self._step, restore=lambda: self.meta.copy_(meta))
        self.meta.copy_(meta)
        self.captures += 1

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, positions: list[int], slots: list[int]) -> torch.Tensor:
        """tokens (rows,) long on the device, each row's position and slot -> logits (rows, V) fp32, the
        decoder's buffer (overwritten by its next step)."""
        if self.uploaded is not None:
            self.uploaded.synchronize()  # the previous step's upload has read the staged rows
        self.staged.copy_(torch.tensor([positions, slots], dtype=torch.int32))
        self.meta.copy_(self.staged, non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()
        self.token.copy_(tokens)
        if not self.use_graph:
            return self._step()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits


def most_rows(model: Transformer) -> int | None:
    """The most rows one pass takes: DENSE_ROWS where a product's weight is dense (its batch-invariant
    kernel's limit), else no limit."""
    names = ("attn_q", "attn_k", "attn_v", "attn_output")
    ws = [model.output_weight()]
    for blk in model.blk:
        ws += [getattr(blk.attn, n).w for n in names]
        if blk.moe is None:
            ws += [blk.ffn_gate.w, blk.ffn_up.w, blk.ffn_down.w]
    return DENSE_ROWS if any(isinstance(w, torch.Tensor) for w in ws) else None


def takes_dense_steps(model: Transformer) -> bool:
    """The model's kind runs dense steps: not a mixture of experts or a tensor-parallel shard (their
    steps keep the kernels)."""
    return not model.cfg.n_experts and getattr(model, "tp", None) is None


def dense_ready(model: Transformer) -> bool:
    """takes_dense_steps, and every layer product the decode step runs (cuda_graph.layer_products) has
    dense values in the activation dtype: a dense model's weights, or the quantized weights' decoded
    copies (backends/cuda.py's keep_dense_prompt_weights)."""
    if not takes_dense_steps(model):
        return False
    act = model.token_embd.weight.dtype
    return all(dense_values(w, act) is not None for w in layer_products(model))


def decoders(slots: Slots, use_graph: bool = True) -> dict[int, SlotDecoder]:
    """The slots' decoders by bucket (kept in slots.tables)."""
    return slots.tables.setdefault(("cuda", use_graph), {})


@torch.inference_mode()
def decode_slots(model: Transformer, slots: Slots, which: list[int], tokens: torch.Tensor,
                 use_graph: bool = True, reducer: str = "auto", dense_rows: int = 0) -> torch.Tensor:
    """slots.decode_slots' step (checked by the caller) -> logits (N, V) fp32 (a view of the bucket's
    buffer, overwritten by the next step of that bucket); lengths advanced. reducer: a tensor-parallel
    model's all-reduce (cuda_tp.REDUCERS). dense_rows: buckets of at least this many rows are dense
    steps (GraphDecoder's `dense`: cuBLAS on dense values, in one pass) where dense_ready (0: never)."""
    if "cuda passes" not in slots.tables:
        slots.tables["cuda passes"] = most_rows(model), dense_ready(model)  # (most rows a pass, dense steps)
    most, ready = slots.tables["cuda passes"]
    n = len(which)
    rows = bucket(n)
    dense = ready and 0 < dense_rows <= rows
    if not dense and most is not None and n > most:  # passes of at most `most` rows, each its own copy
        ids = tokens.view(-1)
        return torch.cat([decode_slots(model, slots, which[i:i + most], ids[i:i + most], use_graph, reducer,
                                       dense_rows).clone() for i in range(0, n, most)])
    if n == 0:
        return torch.empty(0, model.cfg.vocab_size, dtype=torch.float32, device=model.token_embd.weight.device)
    found = decoders(slots, use_graph)
    dec = found.get(rows)
    if dec is None:
        dec = found[rows] = SlotDecoder(model, slots.cache, rows, use_graph, reducer, dense)
    pad = rows - n  # padding rows repeat row 0
    ids = tokens.view(-1).to(device=dec.token.device, dtype=torch.long)
    if pad:
        ids = torch.cat([ids, ids[:1].expand(pad)])
    pos = [slots.lengths[s] for s in which]
    logits = dec.run(ids, pos + pos[:1] * pad, list(which) + list(which[:1]) * pad)[:n]
    for s in which:
        slots.lengths[s] += 1
    return logits


@torch.inference_mode()
def warm_up(model: Transformer, slots: Slots, use_graph: bool = True, reducer: str = "auto",
            dense_rows: int = 0) -> int:
    """Run one step of 1, 2, 4, .. slots, every bucket (and pass size) a step of up to all the slots can
    take, so each decoder's graph is captured now -> graphs captured. Slots' lengths are restored; the
    rows written (at each slot's current position) are overwritten by its next step or prompt."""
    n = len(slots.lengths)
    before = list(slots.lengths)
    if any(length >= slots.capacity for length in before):
        return 0
    captured = 0
    dev = model.token_embd.weight.device
    for b in sorted({bucket(k) for k in range(1, n + 1)}):
        k = min(b, n)  # a step of k slots runs bucket b (dense weights: passes of most_rows' size)
        known = {id(d) for d in decoders(slots, use_graph).values()}
        decode_slots(model, slots, list(range(k)), torch.ones(k, dtype=torch.long, device=dev), use_graph, reducer,
                     dense_rows)
        slots.lengths[:] = before
        captured += sum(d.captures for d in decoders(slots, use_graph).values() if id(d) not in known)
    return captured
