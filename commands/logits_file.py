"""The logits file of `localllm perplexity --save-logits` (read back by --kld-base FILE).

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

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from localllm.quantize.partial import make_partial, remove_stale_partials

from localllm.commands.eval_chunks import Chunks, scored_per_chunk
from localllm.commands.eval_scores import BaseLogProbs
from localllm.errors import LocalLLMError
from localllm.settings import DEFAULT_FILES

LOGITS_FORMAT = "localllm-logits"
LOGITS_VERSION = 1
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
