"""How many bytes and parameters a model holds and reads per step: the figures benchmarks and the
draft-cost estimate divide by. A mixture of experts' stacks (moe.ExpertLinear) count whole in what
the model holds, and k of E experts in what a token reads and multiplies (a decode step reads only
the chosen experts' rows: backends/cuda_moe.py, kernels.linear.linear_rows)."""

from __future__ import annotations

from localllm.kernels.qweight import QWeight

from .model import Linear, Transformer
from .moe import ExpertLinear


def linear_weights(model: Transformer) -> list:
    return [m.w for m in model.modules() if isinstance(m, Linear)]


def expert_weights(model: Transformer) -> list:
    """Every ExpertLinear's stack (a QWeight of E N rows, or dense (E, N, K)) and its bias (or None)."""
    return [(m.qweight if m.qweight is not None else m.weight, m.bias) for m in model.modules()
            if isinstance(m, ExpertLinear)]


def used_share(model: Transformer) -> float:
    """The share of each expert stack a token reads: k of E experts (0 without experts)."""
    cfg = model.cfg
    return cfg.n_experts_used / cfg.n_experts if cfg.n_experts else 0.0


def nbytes(w) -> int:
    return w.nbytes if isinstance(w, QWeight) else w.numel() * w.element_size()


def numel(w) -> int:
    return w.shape[0] * w.shape[1] if isinstance(w, QWeight) else w.numel()


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights one decode step reads: linears, norms, one embedding row (all of it when tied),
    and of each expert stack (with its biases) the k of E experts a token uses."""
    emb = model.token_embd.weight
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
    head = nbytes(emb) if model.cfg.tied_output else emb.shape[1] * emb.element_size()
    experts = sum(nbytes(w) + (nbytes(b) if b is not None else 0) for w, b in expert_weights(model))
    return sum(nbytes(w) for w in linear_weights(model)) + norms + head + round(experts * used_share(model))


def kv_bytes_per_token(cache, context: float) -> float:
    """Bytes of KV cache a decode step reads at `context` positions: k and v of every layer."""
    _, b, hkv, _, d = cache.k.shape
    return 2 * cache.k.shape[0] * b * hkv * d * context * cache.k.element_size()


def model_stats(model: Transformer) -> tuple[int, int]:
    """(bytes of weights held, parameter count): dense parameters plus quantized weights."""
    qws = [w for w in linear_weights(model) + [w for w, _ in expert_weights(model)] if isinstance(w, QWeight)]
    held = sum(nbytes(p) for p in model.parameters()) + sum(w.nbytes for w in qws)
    return held, sum(p.numel() for p in model.parameters()) + sum(numel(w) for w in qws)


def linear_params(model: Transformer) -> tuple[int, int]:
    """(parameters multiplied per prompt token, those of the head: prefill needs the last logits only);
    of each expert stack the k of E experts a token uses."""
    head = numel(model.output_weight())
    body = sum(numel(w) for w in linear_weights(model)) - (0 if model.cfg.tied_output else head)
    experts = sum(w.shape[0] * w.shape[1] if isinstance(w, QWeight) else w.numel() for w, _ in expert_weights(model))
    return body + round(experts * used_share(model)), head
