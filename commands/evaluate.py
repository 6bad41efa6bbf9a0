"""Perplexity of a model over a text, and its KL divergence from a base model, as llama.cpp's
tools/perplexity computes them: the evaluation loop and its statistics. The chunks are
eval_chunks.py's, the forward passes and the KL eval_scores.py's, a base's log-probs saved to a file
and read back logits_file.py's (all re-exported here).

Statistics (llama.cpp's formulas, accumulated in float64):
- PPL = exp(mean NLL); its standard error is PPL * sqrt((mean(NLL^2) - mean(NLL)^2) / (N - 1));
- per position KLD = sum_i P_base(i) * (log P_base(i) - log P(i)); reported as the mean with the same
  standard error formula, the median and the 99th percentile (linear interpolation between order
  statistics, as llama.cpp's `percentile`), and "same top": the share of positions where the base's
  most likely token is also the evaluated model's most likely one (± sqrt(p(1-p)/(N-1))).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from localllm.commands.eval_chunks import (  # noqa: F401 (re-exported)
    DEFAULT_CTX, Chunks, check_chunking, chunk_fingerprint, chunks_for, make_chunks, read_text, scored_per_chunk,
    text_tokens,
)
from localllm.commands.eval_scores import (  # noqa: F401 (re-exported)
    BaseLogProbs, PositionScores, base_log_probs, chunk_logits, kl_divergence, precise_log_softmax, scored_logits,
    token_nll,
)
from localllm.commands.logits_file import (  # noqa: F401 (re-exported)
    LEVELS, LOGITS_FORMAT, LOGITS_VERSION, MAGIC, WINDOW, LogitsWriter, SavedLogits, check_base_shape,
    decode_log_probs, encode_log_probs, is_logits_file, load_logits, record_dtype, save_logits,
)
from localllm.errors import LocalLLMError
from localllm.load import LoadedModel
from localllm.tokenizer import Tokenizer


# ---- statistics ----------------------------------------------------------------------------------


def mean_and_stderr(values: np.ndarray) -> tuple[float, float]:
    """llama.cpp's mean_and_uncertainty: mean and sqrt((mean(x^2) - mean^2) / (N - 1)) (0 when undefined)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = float(values.sum() / n)
    var = float((values * values).sum() / n) - mean * mean
    return mean, math.sqrt(var / (n - 1)) if var > 0 and n > 1 else 0.0


@dataclass
class KLDStats:
    mean: float
    stderr: float
    p99: float
    median: float
    maximum: float
    same_top: float  # share in [0, 1]
    same_top_stderr: float
    base_ppl: float
    base_ppl_stderr: float


@dataclass
class Evaluation:
    """Results so far (after `chunks_done` of `n_chunks` chunks); the last one yielded is final."""

    ctx: int
    n_chunks: int
    chunks_done: int
    count: int  # scored positions
    mean_nll: float
    ppl: float
    ppl_stderr: float
    chunk_ppl: list[float]  # running PPL after each chunk (llama.cpp's "[i]ppl," line)
    kld: KLDStats | None = None
    kld_values: np.ndarray | None = field(default=None, repr=False)  # per position, when a base is given


def _kld_stats(kld: np.ndarray, same: np.ndarray, base_nll: np.ndarray) -> KLDStats:
    mean, stderr = mean_and_stderr(kld)
    n = len(same)
    p = float(same.mean())
    base_mean, base_err = mean_and_stderr(base_nll)
    base_ppl = math.exp(base_mean)
    return KLDStats(
        mean=mean, stderr=stderr,
        p99=float(np.quantile(kld, 0.99)), median=float(np.median(kld)), maximum=float(kld.max()),
        same_top=p, same_top_stderr=math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0,
        base_ppl=base_ppl, base_ppl_stderr=base_ppl * base_err,
    )


# ---- the evaluation loop -------------------------------------------------------------------------


def check_same_vocab(lm: LoadedModel, base: LoadedModel) -> None:
    check_same_tokenizer(lm.tokenizer, base.tokenizer)
    if lm.config.vocab_size != base.config.vocab_size:
        raise LocalLLMError(
            f"the base model has a different vocabulary ({base.config.vocab_size} logits vs {lm.config.vocab_size})"
        )


def check_same_tokenizer(tok: Tokenizer, base_tok: Tokenizer) -> None:
    if tok.vocab_size != base_tok.vocab_size:
        raise LocalLLMError(
            f"the base model has a different vocabulary ({base_tok.vocab_size} tokens vs {tok.vocab_size})"
        )
    for i in range(tok.vocab_size):
        if tok.token_text(i) != base_tok.token_text(i):
            raise LocalLLMError(
                f"the base model has a different vocabulary (token {i} is {base_tok.token_text(i)!r}, "
                f"not {tok.token_text(i)!r})"
            )


def evaluate_steps(
    lm: LoadedModel,
    chunks: Chunks,
    base: LoadedModel | SavedLogits | None = None,
    batch: int = 1,
    save_to: str | Path | None = None,
    writer_cls=None,
) -> Iterator[Evaluation]:
    """Run the chunks `batch` at a time; yield the running results after each forward pass.

    base: a model run on the same chunks, or base log-probs loaded from a file (`load_logits`, or
    llama_logits.load_llama_logits: anything with check(chunks, vocab) and rows(start, stop));
    save_to: write this model's log-probs there, complete once the last chunk ran, with writer_cls
    (LogitsWriter by default; llama_logits.LlamaLogitsWriter writes llama.cpp's format)."""
    check_chunking(chunks.ctx, None, batch)
    if isinstance(base, LoadedModel):
        check_same_vocab(lm, base)
        if chunks.ctx > base.config.context_length:
            raise LocalLLMError(f"--ctx {chunks.ctx} is larger than the base model's context ({base.config.context_length} tokens)")
    elif base is not None:
        base.check(chunks, lm.config.vocab_size)
    per = chunks.per_chunk
    writer = (writer_cls or LogitsWriter)(save_to, chunks, lm.config.vocab_size, lm.path.name) if save_to is not None else None
    nll_parts: list[torch.Tensor] = []
    scores: list[PositionScores] = []
    chunk_ppl: list[float] = []
    nll_sum = 0.0
    try:
        for start in range(0, chunks.n_chunks, batch):
            rows = slice(start, min(start + batch, chunks.n_chunks))
            targets = chunks.targets(rows)
            logits = scored_logits(chunk_logits(lm, chunks.ids[rows]), chunks.first)
            if writer is not None:
                writer.write(base_log_probs(logits, targets))
            if base is None:
                nll = token_nll(logits, targets)
            else:
                if isinstance(base, LoadedModel):
                    records = base_log_probs(scored_logits(chunk_logits(base, chunks.ids[rows]), chunks.first), targets)
                else:
                    records = base.rows(rows.start * per, rows.stop * per)
                s = kl_divergence(records, logits, targets)
                scores.append(s)
                nll = s.nll
            del logits
            nll_parts.append(nll)
            for row in range(nll.shape[0] // per):
                nll_sum += float(nll[row * per : (row + 1) * per].sum())
                chunk_ppl.append(math.exp(nll_sum / ((len(chunk_ppl) + 1) * per)))
            done = rows.stop == chunks.n_chunks
            if done and writer is not None:
                writer.close()
                writer = None
            yield _evaluation(chunks, rows.stop, nll_parts, chunk_ppl, scores if base is not None else None, done)
    finally:
        if writer is not None:  # stopped early: no half-written file is left behind
            writer.abort()


def _evaluation(chunks: Chunks, done: int, nll_parts, chunk_ppl, scores, final: bool) -> Evaluation:
    nll = torch.cat(nll_parts).numpy()
    mean, err = mean_and_stderr(nll)
    ppl = math.exp(mean)
    ev = Evaluation(chunks.ctx, chunks.n_chunks, done, len(nll), mean, ppl, ppl * err, list(chunk_ppl))
    if scores:
        kld = torch.cat([s.kld for s in scores]).numpy()
        same = torch.cat([s.same_top for s in scores]).numpy()
        base_nll = torch.cat([s.base_nll for s in scores]).numpy()
        ev.kld = _kld_stats(kld, same, base_nll)
        if final:
            ev.kld_values = kld
    return ev


def evaluate(lm: LoadedModel, chunks: Chunks, **options) -> Evaluation:
    """The final results of `evaluate_steps(lm, chunks, **options)` (base, batch, save_to, writer_cls)."""
    result = None
    for result in evaluate_steps(lm, chunks, **options):
        pass
    assert result is not None
    return result
