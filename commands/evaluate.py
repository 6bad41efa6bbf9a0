"""Perplexity of a model over a text, and its KL divergence from a base model, as llama.cpp's
tools/perplexity computes them.

Chunking (llama.cpp `perplexity()`):
- the whole text is tokenized once, BOS first when the vocabulary's add_bos says so, special tokens
  not parsed;
- it is cut into non-overlapping chunks of `ctx` tokens (a partial last chunk is dropped); the first
  token of every chunk is *replaced* by BOS when add_bos (llama.cpp overwrites, it does not insert);
- each chunk runs in one forward pass on a fresh KV cache (positions 0 .. ctx-1);
- only the second half is scored: logits at positions first = ctx//2 .. ctx-2 predict the tokens at
  first+1 .. ctx-1, i.e. ctx - 1 - ctx//2 predictions per chunk, each with at least ctx/2 tokens of
  context.

Statistics (llama.cpp's formulas, accumulated in float64):
- PPL = exp(mean NLL); its standard error is PPL * sqrt((mean(NLL^2) - mean(NLL)^2) / (N - 1));
- per position KLD = sum_i P_base(i) * (log P_base(i) - log P(i)); reported as the mean with the same
  standard error formula, the median and the 99th percentile (linear interpolation between order
  statistics, as llama.cpp's `percentile`), and "same top": the share of positions where the base's
  most likely token is also the evaluated model's most likely one (± sqrt(p(1-p)/(N-1))).

The base's distributions, in the same run or from a file
--------------------------------------------------------
The KL is always computed by one function, `kl_divergence(BaseLogProbs, logits)`, over the whole
vocabulary. In the same run the base's log-probs are exact (float64 log_softmax of its logits), so a
model against itself gives exactly 0 and 100 % same top. A file (`--save-logits`, `LogitsWriter`)
stores per scored position, as llama.cpp's does:

- the base's top token id and its log-prob of the actual next token, exact (int32, float32);
- every log-prob within WINDOW = 20 nats of the top one as a uint16 code on a linear scale from
  lo = max(smallest log-prob, top - 20) to the top (step = range / 65534 <= 3.1e-4 nats), with lo
  and step as float32; tokens below the window (p < e^-20 p_top ~ 2e-9 p_top) get code 0, and the
  log of their total mass is stored (float32).

Reading decodes the codes and renormalises the kept tokens to their stored total mass (1 - tail,
below). Error this introduces: each kept log-prob is off by d_i, |d_i| <= step/2 <= 1.5e-4 nats.
The renormalisation removes the p-weighted mean of the d_i, so the first-order effect on a
position's KLD is sum_i p_i (d_i - mean d)(r_i - c) for r_i = log p_i - log q_i and any constant c:
at most step * E_p|r - E_p r| <= 3.1e-4 times the spread of the log-ratio under the base, plus a
second-order term of order step^2 (~4e-9 for a model against itself). Measured, default model
(vocab 49152) against a copy with bfloat16-rounded weights (mean KLD ~6e-5): per position within
7.5e-7 of the same-run KLD, mean within 0.02 % (tests/test_evaluate.py checks 2e-6 and 0.1 %).
Tokens below the window are not lost: the record keeps their total mass (float32 log), and the KL
counts them as one outcome, tail (log tail - log q_tail) with q_tail the model's mass on the same
tokens; that coarse-graining under-counts by tail * KL(within the tail), tail < vocab e^-20 p_top.
"Same top" and the base PPL are exact. The file costs 2 bytes per vocabulary entry per scored
position (like llama.cpp's: ~3 MiB per 64-token chunk for a 49152-token vocabulary); it is written
and read a chunk at a time, never held whole in memory. Why not only the top-k log-probs plus the
remaining mass (8 k bytes a position): that coarse-grained KL under-counts by the divergence inside
the tail, which for small perturbations is spread over the whole vocabulary: the bfloat16 copy
above came out 14 % low with k = 256 and 10 % low with k = 512.

The file starts with a magic, then a JSON header (format, version, ctx, vocab size, record count,
window, the model it came from and the SHA-256 fingerprint of each chunk's token ids after BOS
replacement), then the fixed-size records. Loading checks the format, ctx, vocabulary size and the
fingerprints against the run (a different text, ctx or tokenizer is an error); a run may evaluate
fewer chunks than the file holds (`--chunks`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from localllm.quantize.partial import make_partial, remove_stale_partials

from localllm.device import widest_float
from localllm.errors import LocalLLMError
from localllm.load import LoadedModel
from localllm.settings import DEFAULT_FILES
from localllm.tokenizer import Tokenizer
from localllm.user_text import read_utf8_file

DEFAULT_CTX = 512  # llama.cpp's perplexity default
LOGITS_FORMAT = "localllm-logits"
LOGITS_VERSION = 1


# ---- text and chunks -----------------------------------------------------------------------------


def read_text(path: str | Path) -> str:
    """The UTF-8 text of a file; one error line naming the file (and the byte offset where the text is
    not UTF-8) otherwise (user_text's policy for files)."""
    return read_utf8_file(path, "text file")


def text_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """The whole text's ids as llama.cpp's perplexity tokenizes it: BOS per add_bos, no special parsing."""
    return tokenizer.encode(text, add_bos=tokenizer.add_bos, parse_special=False)


def scored_per_chunk(ctx: int) -> int:
    return ctx - 1 - ctx // 2


@dataclass(frozen=True)
class Chunks:
    ids: torch.Tensor  # (n_chunks, ctx) int64, first token of each chunk replaced by BOS when add_bos
    text_tokens: int  # tokens in the whole text

    @property
    def ctx(self) -> int:
        return self.ids.shape[1]

    @property
    def n_chunks(self) -> int:
        return self.ids.shape[0]

    @property
    def first(self) -> int:
        """First scored logit position (it predicts the token at first + 1)."""
        return self.ctx // 2

    @property
    def per_chunk(self) -> int:
        return scored_per_chunk(self.ctx)

    def targets(self, rows: slice = slice(None)) -> torch.Tensor:
        """The predicted ids of the scored positions of chunks `rows`, flattened chunk after chunk."""
        return self.ids[rows, self.first + 1 :].reshape(-1)

    def fingerprints(self) -> list[str]:
        return [chunk_fingerprint(row) for row in self.ids]


def chunk_fingerprint(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int32).numpy().astype("<i4").tobytes()).hexdigest()


def check_chunking(ctx: int, max_chunks: int | None = None, batch: int = 1) -> None:
    """perplexity's --ctx, --chunks and --batch, before any model loads."""
    if ctx < 3:
        raise LocalLLMError(f"--ctx must be at least 3 (the second half of each chunk is scored), got {ctx}")
    if max_chunks is not None and max_chunks < 1:
        raise LocalLLMError(f"--chunks must be at least 1, got {max_chunks}")
    if batch < 1:
        raise LocalLLMError(f"--batch must be at least 1, got {batch}")


def make_chunks(tokens: list[int], ctx: int, bos_id: int | None = None, max_chunks: int | None = None) -> Chunks:
    """Non-overlapping chunks of ctx tokens; bos_id (when the vocabulary adds BOS) replaces each first token."""
    check_chunking(ctx, max_chunks)
    n = len(tokens) // ctx
    if n == 0:
        raise LocalLLMError(
            f"the text is too short: it has {len(tokens)} tokens, one chunk of --ctx {ctx} needs {ctx}"
        )
    if max_chunks is not None:
        n = min(n, max_chunks)
    ids = torch.tensor(tokens[: n * ctx], dtype=torch.long).view(n, ctx)
    if bos_id is not None:
        ids[:, 0] = bos_id
    return Chunks(ids, len(tokens))


def chunks_for(lm: LoadedModel, text: str, ctx: int = DEFAULT_CTX, max_chunks: int | None = None) -> Chunks:
    if ctx > lm.config.context_length:
        raise LocalLLMError(f"--ctx {ctx} is larger than the model's context ({lm.config.context_length} tokens)")
    tok = lm.tokenizer
    return make_chunks(text_tokens(tok, text), ctx, tok.bos_id if tok.add_bos else None, max_chunks)


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


def evaluate(
    lm: LoadedModel,
    chunks: Chunks,
    base: LoadedModel | SavedLogits | None = None,
    batch: int = 1,
    save_to: str | Path | None = None,
    writer_cls=None,
) -> Evaluation:
    """The final results of `evaluate_steps`."""
    result = None
    for result in evaluate_steps(lm, chunks, base, batch, save_to, writer_cls):
        pass
    assert result is not None
    return result


# ---- the logits file -----------------------------------------------------------------------------

MAGIC = b"LLMLOGP\x01"
WINDOW = 20.0  # nats below a position's top log-prob that a file keeps; lower tokens are dropped
LEVELS = 65535  # uint16 codes 1 .. LEVELS span the window linearly; code 0 marks a dropped token


def record_dtype(vocab: int) -> np.dtype:
    return np.dtype([("top", "<i4"), ("target_logp", "<f4"), ("tail_logp", "<f4"), ("lo", "<f4"), ("step", "<f4"),
                     ("codes", "<u2", (vocab,))])


def encode_log_probs(base: BaseLogProbs) -> np.ndarray:
    """Exact log-probs -> file records (module docstring): per position the top id, target log-prob and
    the log of the mass below the window (exact, float32), and every log-prob in [lo, top] as a
    uint16 code, lo = max(smallest, top - WINDOW), error <= step / 2."""
    logp = base.logp.detach().cpu().double()
    n, vocab = logp.shape
    hi = logp.max(-1).values
    finite_min = torch.where(torch.isfinite(logp), logp, hi[:, None]).min(-1).values
    lo = torch.maximum(finite_min, hi - WINDOW).float().double()  # the stored (float32) values
    step = ((hi - lo) / (LEVELS - 1)).float().double()
    kept = logp >= lo[:, None]
    tail = torch.where(kept, torch.full_like(logp, float("-inf")), logp).logsumexp(-1)
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    codes = ((logp - lo[:, None]) * inv[:, None]).round_().add_(1).clamp_(1, LEVELS)
    codes = torch.where(kept, codes, torch.zeros_like(codes)).to(torch.int32)
    out = np.zeros(n, dtype=record_dtype(vocab))
    out["top"] = base.top.cpu().numpy()
    out["target_logp"] = base.target_logp.detach().cpu().float().numpy()
    out["tail_logp"] = tail.cpu().float().numpy()
    out["lo"] = lo.numpy()
    out["step"] = step.numpy()
    out["codes"] = codes.cpu().numpy()
    return out


def decode_log_probs(records: np.ndarray) -> BaseLogProbs:
    """File records -> log-probs, the kept ones renormalised to their stored total mass (1 - tail):
    this cancels the first-order effect of the rounding on the KLD (module docstring)."""
    codes = torch.from_numpy(records["codes"].astype(np.int64))
    lo = torch.from_numpy(records["lo"].astype(np.float64))
    step = torch.from_numpy(records["step"].astype(np.float64))
    tail = torch.from_numpy(records["tail_logp"].astype(np.float64))
    logp = lo[:, None] + (codes - 1) * step[:, None]
    logp = logp.masked_fill_(codes == 0, float("-inf"))
    kept_mass = torch.log1p(-tail.exp().clamp(max=0.5))  # log(1 - tail); tail < vocab * e^-20 by construction
    logp = logp - (logp.logsumexp(-1) - kept_mass)[:, None]
    return BaseLogProbs(logp, torch.from_numpy(records["top"].astype(np.int64)),
                        torch.from_numpy(records["target_logp"].astype(np.float64)), tail)


class LogitsWriter:
    """Writes a logits file chunk by chunk (to a hidden `.NAME.PID.XXXX.partial` beside it, renamed to
    NAME when complete; quantize/partial.py: partials of NAME left by killed writers are removed first).

    Layout: MAGIC, a little-endian uint32 header length, the header (JSON: format, version, ctx, vocab,
    records, window, model, chunk_sha256), then one `record_dtype(vocab)` record per scored position."""

    def __init__(self, path: str | Path, chunks: Chunks, vocab: int, model: str = ""):
        self.path = Path(path).expanduser()
        self.expected = chunks.n_chunks * chunks.per_chunk
        self.vocab = int(vocab)
        self.written = 0
        head = self.head(chunks, model)
        remove_stale_partials(self.path, DEFAULT_FILES.stale_partial_seconds)
        try:
            self.partial = make_partial(self.path)
        except OSError as e:
            raise LocalLLMError(f"cannot write {path}: {e.strerror or e}") from None
        self.file = open(self.partial, "wb")
        self._put(head)

    def head(self, chunks: Chunks, model: str) -> bytes:
        """The bytes before the records (this format's; a subclass writes another format's)."""
        header = json.dumps({
            "format": LOGITS_FORMAT, "version": LOGITS_VERSION, "ctx": chunks.ctx, "vocab": self.vocab,
            "records": self.expected, "window": WINDOW, "model": model, "chunk_sha256": chunks.fingerprints(),
        }).encode()
        return MAGIC + struct.pack("<I", len(header)) + header

    def encode(self, base: BaseLogProbs) -> bytes:
        """Records of the positions of base, as bytes."""
        return encode_log_probs(base).tobytes()

    def _put(self, data: bytes) -> None:
        try:
            self.file.write(data)
        except OSError as e:
            self.abort()
            raise LocalLLMError(f"cannot write {self.path}: {e.strerror or e}") from None

    def write(self, base: BaseLogProbs) -> None:
        if base.logp.shape[-1] != self.vocab or self.written + len(base) > self.expected:
            raise ValueError("records do not fit this file")
        self._put(self.encode(base))
        self.written += len(base)

    def close(self) -> None:
        self.file.close()
        if self.written != self.expected:
            self.abort()
            raise ValueError(f"{self.written} of {self.expected} records written")
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        self.file.close()
        self.partial.unlink(missing_ok=True)


def save_logits(path: str | Path, chunks: Chunks, base: BaseLogProbs, vocab: int, model: str = "") -> None:
    """Write all records at once (what `evaluate_steps(save_to=...)` does chunk by chunk)."""
    writer = LogitsWriter(path, chunks, vocab, model)
    writer.write(base)
    writer.close()


@dataclass
class SavedLogits:
    """A logits file opened for reading (records memory-mapped, decoded a slice at a time)."""

    path: Path
    ctx: int
    vocab: int
    fingerprints: list[str]
    records: np.ndarray = field(repr=False)
    model: str = ""

    @property
    def n_chunks(self) -> int:
        return len(self.fingerprints)

    def rows(self, start: int, stop: int) -> BaseLogProbs:
        return decode_log_probs(np.asarray(self.records[start:stop]))

    def all(self) -> BaseLogProbs:
        return self.rows(0, len(self.records))

    def check(self, chunks: Chunks, vocab: int) -> None:
        """The run must evaluate the same tokens with the same ctx and vocabulary (a prefix of the chunks)."""
        name = self.path.name
        check_base_shape(name, self.vocab, self.ctx, self.n_chunks, chunks, vocab)
        for i, fp in enumerate(chunks.fingerprints()):
            if fp != self.fingerprints[i]:
                raise LocalLLMError(
                    f"{name} was computed on other tokens (chunk {i + 1} differs): a different text or tokenizer"
                )


def check_base_shape(name: str, base_vocab: int, base_ctx: int, base_chunks: int, chunks: Chunks, vocab: int) -> None:
    """A base file (ours or llama-perplexity's) fits this run: the model's vocabulary, the run's ctx, and
    at least the run's chunks; else one LocalLLMError line naming the file."""
    if base_vocab != vocab:
        raise LocalLLMError(f"{name} holds log-probs over {base_vocab} tokens; this model has {vocab}")
    if base_ctx != chunks.ctx:
        raise LocalLLMError(f"{name} was computed with --ctx {base_ctx}; this run uses --ctx {chunks.ctx}")
    if chunks.n_chunks > base_chunks:
        raise LocalLLMError(
            f"{name} holds {base_chunks} chunks; this run evaluates {chunks.n_chunks} (add --chunks {base_chunks})"
        )


def is_logits_file(path: str | Path) -> bool:
    """Whether path is a file starting like a logits file (and so not a model)."""
    p = Path(path).expanduser()
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def load_logits(path: str | Path) -> SavedLogits:
    p = Path(path).expanduser()
    if not p.is_file():
        raise LocalLLMError(f"logits file not found: {path}")
    not_ours = f"{p.name} is not a logits file written by `localllm perplexity --save-logits`"
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(len(MAGIC) + 4)
        if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
            raise LocalLLMError(not_ours)
        (n,) = struct.unpack("<I", head[len(MAGIC) :])
        try:
            header = json.loads(f.read(n).decode())
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise LocalLLMError(f"{p.name} is a damaged logits file (bad header)") from None
    if not isinstance(header, dict) or header.get("format") != LOGITS_FORMAT:
        raise LocalLLMError(not_ours)
    if header.get("version") != LOGITS_VERSION:
        raise LocalLLMError(f"{p.name} is a version {header.get('version')} logits file; this localllm reads {LOGITS_VERSION}")
    try:
        ctx, vocab, count = int(header["ctx"]), int(header["vocab"]), int(header["records"])
        fingerprints = [str(s) for s in header["chunk_sha256"]]
    except (KeyError, TypeError, ValueError):
        raise LocalLLMError(f"{p.name} is a damaged logits file (bad header)") from None
    dtype = record_dtype(vocab)
    offset = len(MAGIC) + 4 + n
    if count != len(fingerprints) * scored_per_chunk(ctx) or size != offset + count * dtype.itemsize:
        raise LocalLLMError(f"{p.name} is a damaged or truncated logits file")
    records = np.memmap(p, dtype=dtype, mode="r", offset=offset, shape=(count,)) if count else np.zeros(0, dtype)
    return SavedLogits(p, ctx, vocab, fingerprints, records, str(header.get("model", "")))
