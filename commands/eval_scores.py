"""The forward passes of `localllm perplexity` and the KL divergence of a model from a base's
log-probs at the scored positions (evaluate.py runs them chunk by chunk; logits_file.py stores a base's
log-probs).

Per position KLD = sum_i P_base(i) * (log P_base(i) - log P(i)), over the whole vocabulary, in float64
(llama.cpp's perplexity: --kl-divergence)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localllm.device import widest_float
from localllm.load import LoadedModel


# ---- forward passes ------------------------------------------------------------------------------


@torch.inference_mode()
def chunk_logits(lm: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """ids (B, ctx) -> fp32 logits (B, ctx, V): one forward pass from position 0 on a fresh KV cache."""
    rt = lm.runtime
    cache = rt.new_cache(ids.shape[1], ids.shape[0])
    return rt.forward(ids.to(rt.device), cache, 0).float()


def scored_logits(logits: torch.Tensor, first: int) -> torch.Tensor:
    """(B, ctx, V) -> the logits of the scored positions first .. ctx-2, flattened: (B * per_chunk, V)."""
    return logits[:, first:-1].reshape(-1, logits.shape[-1])


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N, V) logits, (N,) ids -> (N,) float64 negative log-likelihoods, on the CPU."""
    logp = precise_log_softmax(logits)
    return -logp.gather(-1, targets.to(logp.device)[:, None])[:, 0].double().cpu()


# ---- base log-probs and the KL divergence --------------------------------------------------------


def precise_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax in float64 (float32 on MPS, which has no float64): float32's ~1e-6 error per
    log-prob would be a visible share of a small KLD."""
    return torch.log_softmax(logits.to(widest_float(logits.device)), dim=-1)


@dataclass
class BaseLogProbs:
    """A base model's distributions at the scored positions (exact in a run, decoded from a file)."""

    logp: torch.Tensor  # (N, V) log-probs; -inf for tokens a file dropped (below its window)
    top: torch.Tensor  # (N,) int64: the base's most likely token (the first one on a tie), exact
    target_logp: torch.Tensor  # (N,) log-prob of the actual next token, exact
    tail_logp: torch.Tensor | None = None  # (N,) log of the dropped tokens' total mass (-inf: none)

    def __len__(self) -> int:
        return self.logp.shape[0]


def base_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> BaseLogProbs:
    """A base model's logits (N, V) at the scored positions (targets: the next ids) -> its log-probs."""
    logp = precise_log_softmax(logits)
    target = logp.gather(-1, targets.to(logp.device)[:, None])[:, 0]
    return BaseLogProbs(logp, logits.argmax(-1), target)


@dataclass
class PositionScores:
    nll: torch.Tensor  # (N,) float64: the evaluated model's NLL of the next token
    kld: torch.Tensor  # (N,) float64: KL(base || model) per position
    same_top: torch.Tensor  # (N,) bool: the base's top token is (one of) the model's top token(s)
    base_nll: torch.Tensor  # (N,) float64: the base's NLL of the next token


def kl_divergence(base: BaseLogProbs, logits: torch.Tensor, targets: torch.Tensor) -> PositionScores:
    """KL(base || model) = sum_i p_base(i) (log p_base(i) - log p(i)) per position, from the base's
    log-probs and the evaluated model's logits (N, V).

    Tokens a file dropped (logp -inf) count as one outcome: tail_mass * (log tail_mass - log of the
    model's mass on those same tokens)."""
    logq = precise_log_softmax(logits)
    if len(base) != logq.shape[0] or base.logp.shape[-1] != logq.shape[-1]:
        raise ValueError(f"base log-probs {tuple(base.logp.shape)} for logits {tuple(logq.shape)}")
    logp = base.logp.to(logq.device, logq.dtype)
    kept = torch.isfinite(logp)
    kld = torch.where(kept, logp.exp() * (logp - logq), torch.zeros_like(logq)).sum(-1)
    if base.tail_logp is not None:
        tail = base.tail_logp.to(logq.device, logq.dtype)
        has_tail = torch.isfinite(tail)
        if has_tail.any():
            q_tail = torch.where(kept, torch.full_like(logq, float("-inf")), logq).logsumexp(-1)
            kld = kld + torch.where(has_tail, tail.exp() * (tail - q_tail), torch.zeros_like(kld))
    top = base.top.to(logq.device)
    # Ties: a base top token that equals the model's maximum counts as the same top.
    same_top = logits.gather(-1, top[:, None])[:, 0] == logits.max(-1).values
    nll = -logq.gather(-1, targets.to(logq.device)[:, None])[:, 0]
    return PositionScores(nll.double().cpu(), kld.double().cpu(), same_top.cpu(), (-base.target_logp).double().cpu())
