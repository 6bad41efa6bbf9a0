"""How many bytes and parameters a model holds and reads per step: the figures benchmarks and the
draft-cost estimate divide by."""

from __future__ import annotations

from localllm.kernels.qweight import QWeight

from .model import Linear, QEmbedding, Transformer
from .moe import ExpertLinear


def linear_weights(model: Transformer) -> list:
    return [m.w for m in model.modules() if isinstance(m, Linear)]


def nbytes(w) -> int:
    return w.nbytes if isinstance(w, QWeight) else w.numel() * w.element_size()


def numel(w) -> int:
    return w.shape[0] * w.shape[1] if isinstance(w, QWeight) else w.numel()


def expert_weights(model: Transformer) -> list:
    """Every expert stack's weight (QWeight (E * out, in) or dense (E, out, in)) of a mixture of experts."""
    return [m.qweight if m.qweight is not None else m.weight for m in model.modules() if isinstance(m, ExpertLinear)]


def expert_share(model: Transformer) -> float:
    """The share of each expert stack one token reads: its n_experts_used of n_experts experts."""
    cfg = model.cfg
    return cfg.n_experts_used / cfg.n_experts if cfg.n_experts else 0.0


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights one decode step reads: linears, the experts a token uses (k of E of each expert
    stack: the MoE roofline counts only those), norms, one embedding row (all of it when tied)."""
    emb = model.token_embd.weight
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
    head = nbytes(emb) if model.cfg.tied_output else nbytes(emb) // emb.shape[0]  # (one row: dense or blocks)
    experts = round(sum(nbytes(w) for w in expert_weights(model)) * expert_share(model))
    return sum(nbytes(w) for w in linear_weights(model)) + experts + norms + head


def kv_bytes_per_token(cache, context: float) -> float:
    """Bytes of KV cache a decode step reads at `context` positions: k and v of every layer."""
    _, b, hkv, _, d = cache.k.shape
    return 2 * cache.k.shape[0] * b * hkv * d * context * cache.k.element_size()


def embedding_weights(model: Transformer) -> list:
    """Embedding tables kept as the file's blocks (QEmbedding: not torch parameters). A tied output
    reads the same table: counted once."""
    return [m.weight for m in model.modules() if isinstance(m, QEmbedding)]


def model_stats(model: Transformer) -> tuple[int, int]:
    """(bytes of weights held, parameter count): dense parameters plus quantized weights (linears,
    experts, and embedding tables kept quantized), as `info` counts the file's tensors."""
    qws = [w for w in linear_weights(model) + expert_weights(model) + embedding_weights(model)
           if isinstance(w, QWeight)]
    held = sum(nbytes(p) for p in model.parameters()) + sum(w.nbytes for w in qws)
    return held, sum(p.numel() for p in model.parameters()) + sum(numel(w) for w in qws)


def linear_params(model: Transformer) -> tuple[int, int]:
    """(parameters multiplied per prompt token, those of the head: prefill needs the last logits only)."""
    head = numel(model.output_weight())
    experts = round(sum(numel(w) for w in expert_weights(model)) * expert_share(model))
    body = sum(numel(w) for w in linear_weights(model)) + experts - (0 if model.cfg.tied_output else head)
    return body, head
