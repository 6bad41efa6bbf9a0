"""The sharded forward's three collective steps (issue 23), for model.Transformer built with a
TensorParallel (localllm/parallel.py; the layout: localllm/tp_shard.py).

  reduce_sum     after attn_output and after ffn_down: each rank's product is a partial sum over its
                 heads / hidden columns; summed in fp32 (the residual stream's dtype) before the add
  embed_rows     the vocab-split embedding: each rank looks up the ids in its rows, zeros elsewhere;
                 the sum over ranks is each id's one row
  gather_logits  the vocab-split head: each rank's logits (.., k) padded to the common width k, gathered
                 in rank order and trimmed to the full vocabulary (.., V)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .parallel import TensorParallel
from .tp_shard import vocab_part


def reduce_sum(tp: TensorParallel, h: torch.Tensor) -> torch.Tensor:
    """h (B, T, C), this rank's partial sum -> the sum over ranks, fp32 (a new tensor: h may be a
    backend's buffer)."""
    return tp.all_reduce(h.float().clone() if h.dtype == torch.float32 else h.float())


def embed_rows(embedding, tokens: torch.Tensor, tp: TensorParallel, vocab: int) -> torch.Tensor:
    """tokens (B, T) of the full vocabulary -> (B, T, C) in the table's dtype: the rows of the ids this
    rank holds (its rows [start, stop): embedding is an nn.Embedding or model.QEmbedding of stop - start
    rows), zeros for the others. The caller scales, casts to fp32 and all_reduces (exact: one rank's
    row plus zeros)."""
    start, stop, _ = vocab_part(vocab, tp)
    mine = (tokens >= start) & (tokens < stop)
    x = embedding(torch.where(mine, tokens - start, torch.zeros_like(tokens)))
    return x * mine.unsqueeze(-1).to(x.dtype)


def gather_logits(logits: torch.Tensor, tp: TensorParallel, vocab: int, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """logits (..., stop - start) of this rank's rows -> (..., V) in vocabulary order, on every rank.
    out: TensorParallel.gather_last's scratch, (N, .., k) (the CUDA graph decoder's fixed buffer)."""
    _, _, k = vocab_part(vocab, tp)
    if logits.shape[-1] < k:
        logits = F.pad(logits, (0, k - logits.shape[-1]))
    return tp.gather_last(logits, out)[..., :vocab]
