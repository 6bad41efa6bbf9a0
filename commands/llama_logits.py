"""llama.cpp's KL-divergence base file: what `llama-perplexity --kl-divergence-base FILE` writes and
`llama-perplexity --kl-divergence` reads (llama.cpp tools/perplexity/perplexity.cpp: perplexity(),
process_logits, log_softmax, kl_divergence()). Read as a --kld-base, written by `--save-logits FILE
--logits-format llama.cpp`, so each tool can judge the other's quantized files.

Layout (little-endian): "_logits_", uint32 n_ctx, int32 n_vocab, int32 n_chunk, int32 tokens
[n_chunk * n_ctx] (the text's tokens; the evaluator puts BOS over each chunk's first when the
vocabulary adds it), then per chunk, per scored position (first = n_ctx / 2 .. n_ctx - 2, predicting
the next token) one record of nv = 2 * ((n_vocab + 1) / 2) + 4 uint16: float32 scale, float32
min_log_prob, n_vocab uint16 codes (and one pad when n_vocab is odd). A token's log-prob is
scale * code + min_log_prob; llama.cpp codes logit - min_logit (min_logit = max(smallest logit, top - 16))
in 65535 steps, and code 0 stands for every logit at or below min_logit.

The KL llama.cpp computes from a record: sum over tokens whose decoded log-prob is above -16 of
p (log p - log q), unnormalised; the base NLL is -(decoded log-prob of the target); the base's top
token is the first largest decoded log-prob. `rows` decodes to exactly that (BaseLogProbs with the
tokens at or below -16 dropped and no tail), so evaluate.kl_divergence gives llama.cpp's numbers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from localllm.errors import LocalLLMError

from .eval_chunks import Chunks, scored_per_chunk
from .eval_scores import BaseLogProbs
from .logits_file import LogitsWriter, check_base_shape

MAGIC = b"_logits_"
RANGE = 16.0  # llama.cpp codes logits within 16 of the top one
LEVELS = 65535
FLOOR = -16.0  # llama.cpp's KL counts the tokens whose decoded log-prob is above this


def record_words(vocab: int) -> int:
    """uint16 words per scored position: 2 float32 + the codes, padded to an even count."""
    return 2 * ((vocab + 1) // 2) + 4


def is_llama_logits_file(path: str | Path) -> bool:
    p = Path(path).expanduser()
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


@dataclass
class LlamaLogits:
    """A llama.cpp KL-divergence base file opened for reading (records memory-mapped)."""

    path: Path
    ctx: int
    vocab: int
    tokens: np.ndarray = field(repr=False)  # (n_chunk, ctx) int32
    records: np.ndarray = field(repr=False)  # (n_chunk * per_chunk, nv) uint16

    @property
    def n_chunks(self) -> int:
        return self.tokens.shape[0]

    def rows(self, start: int, stop: int) -> BaseLogProbs:
        """Records start .. stop-1 -> the base's log-probs as llama.cpp's kl_divergence reads them."""
        return decode_records(np.asarray(self.records[start:stop]), self.vocab, self.targets(start, stop))

    def all(self) -> BaseLogProbs:
        return self.rows(0, len(self.records))

    def targets(self, start: int, stop: int) -> np.ndarray:
        """The next-token ids of scored positions start .. stop-1."""
        first = self.ctx // 2
        return self.tokens[:, first + 1:].reshape(-1)[start:stop].astype(np.int64)

    def check(self, chunks: Chunks, vocab: int) -> None:
        """The run must evaluate the file's tokens with its ctx and vocabulary (a prefix of its chunks;
        each chunk's first token is the evaluator's BOS or the text's, as llama.cpp overwrites it)."""
        name = self.path.name
        check_base_shape(name, self.vocab, self.ctx, self.n_chunks, chunks, vocab)
        ours = chunks.ids.numpy()
        theirs = self.tokens[: chunks.n_chunks]
        for i in range(chunks.n_chunks):
            if not np.array_equal(ours[i, 1:], theirs[i, 1:]) or (i == 0 and ours[0, 0] != theirs[0, 0]):
                raise LocalLLMError(
                    f"{name} was computed on other tokens (chunk {i + 1} differs): a different text or tokenizer"
                )


def decode_records(records: np.ndarray, vocab: int, targets: np.ndarray) -> BaseLogProbs:
    """records (N, nv) uint16 -> log-probs scale * code + min_log_prob in float32 (as llama.cpp),
    those at or below FLOOR dropped (-inf), the target's log-prob kept whatever its value."""
    head = np.ascontiguousarray(records[:, :4]).view("<f4")  # (N, 2): scale, min_log_prob
    scale = torch.from_numpy(head[:, 0].astype(np.float32))[:, None]
    low = torch.from_numpy(head[:, 1].astype(np.float32))[:, None]
    codes = torch.from_numpy(records[:, 4:4 + vocab].astype(np.float32))
    logp = scale * codes + low  # float32, as llama.cpp's `scale*base_log_prob[i] + min_log_prob`
    t = torch.from_numpy(targets)[:, None]
    target = logp.gather(-1, t)[:, 0].double()
    top = logp.argmax(-1)  # the first largest, as llama.cpp's imax_base
    logp = logp.double().masked_fill_(logp <= FLOOR, float("-inf"))
    return BaseLogProbs(logp, top, target)


def encode_records(base: BaseLogProbs) -> np.ndarray:
    """Exact log-probs (N, V) -> llama.cpp records (N, nv) uint16, as its log_softmax codes logits:
    log-probs are logits shifted by a per-position constant, so the codes are the same."""
    logp = base.logp.detach().cpu().double()
    n, vocab = logp.shape
    hi = logp.max(-1).values
    lo = torch.maximum(torch.where(torch.isfinite(logp), logp, hi[:, None]).min(-1).values, hi - RANGE)
    scale = ((hi - lo) / LEVELS).float()
    inv = torch.where(scale > 0, 1 / scale.double(), torch.zeros_like(hi))
    codes = torch.where(logp > lo[:, None], ((logp - lo[:, None]) * inv[:, None]).round(), torch.zeros_like(logp))
    out = np.zeros((n, record_words(vocab)), np.uint16)
    out[:, :4] = np.stack([scale.numpy(), lo.float().numpy()], 1).astype("<f4").view(np.uint16)
    out[:, 4:4 + vocab] = codes.clamp(0, LEVELS).to(torch.int32).numpy().astype(np.uint16)
    return out


def load_llama_logits(path: str | Path) -> LlamaLogits:
    p = Path(path).expanduser()
    if not p.is_file():
        raise LocalLLMError(f"logits file not found: {path}")
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:8] != MAGIC:
        raise LocalLLMError(f"{p.name} is not a llama.cpp logits file")
    ctx, vocab, n_chunk = struct.unpack("<Iii", head[8:])
    if ctx < 3 or vocab < 1 or n_chunk < 1:
        raise LocalLLMError(f"{p.name} is a damaged llama.cpp logits file (ctx {ctx}, vocab {vocab}, chunks {n_chunk})")
    n_rec, nv = n_chunk * scored_per_chunk(ctx), record_words(vocab)
    offset = 20 + 4 * n_chunk * ctx
    if size != offset + 2 * n_rec * nv:
        raise LocalLLMError(f"{p.name} is a damaged or truncated llama.cpp logits file")
    tokens = np.fromfile(p, "<i4", n_chunk * ctx, offset=20).reshape(n_chunk, ctx)
    records = np.memmap(p, dtype="<u2", mode="r", offset=offset, shape=(n_rec, nv))
    return LlamaLogits(p, ctx, vocab, tokens, records)


class LlamaLogitsWriter(LogitsWriter):
    """Writes a llama.cpp logits file chunk by chunk (a partial beside PATH, renamed when complete):
    LogitsWriter with this format's head (magic, ctx, vocab, chunks, the tokens) and uint16 records."""

    def head(self, chunks: Chunks, model: str) -> bytes:
        tokens = chunks.ids.to(torch.int32).numpy().astype("<i4").tobytes()
        return MAGIC + struct.pack("<Iii", chunks.ctx, self.vocab, chunks.n_chunks) + tokens

    def encode(self, base: BaseLogProbs) -> bytes:
        return encode_records(base).astype("<u2").tobytes()
