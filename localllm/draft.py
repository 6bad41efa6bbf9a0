"""Drafters for speculative decoding (speculative.py's Drafter): a draft model, which is another model
file sharing the target's vocabulary or the target itself quantized in memory ("self:TYPE"), and
prompt lookup, which proposes what followed the latest earlier occurrence of the last n ids.
"""

from __future__ import annotations

from dataclasses import replace

import gguf
import torch

from kernels.qweight import QWeight
from quantize import BLOCK_SIZES, SUPPORTED_TYPES, quantize_tensor

from .cache import KVCache, make_cache
from .device import pick_dtype
from .errors import LocalLLMError
from .generate import decode_one
from .load import build_model, load_model, load_tokenizer
from .model import Linear, Transformer
from .sampling import Sampler, draw
from .settings import DraftSettings, SamplingSettings
from .speculative import Drafter, feed
from .synthetic import FALLBACK, tensor_type
from .tokenizer import Tokenizer
from .weights import QuantizedTensor

Q = gguf.GGMLQuantizationType
SELF = "self:"
SELF_TYPES = sorted({t.name for t in SUPPORTED_TYPES} | {"Q4_K_M"})
VOCAB_CHECKED = 1000  # leading token texts compared (the whole table of a 150k vocabulary is slow to walk)


# ---- options


def self_type(spec: str | None) -> str | None:
    """"self:Q4_0" -> "Q4_0"; None for a model path or name."""
    return spec[len(SELF):] if spec is not None and spec.startswith(SELF) else None


def check_draft(ds: DraftSettings) -> None:
    """Bad combinations and values, before any model loads."""
    if ds.draft is not None and ds.lookup:
        raise LocalLLMError("--draft and --lookup exclude each other: choose one drafter")
    if ds.lookup < 0:
        raise LocalLLMError(f"--lookup must be at least 1 (the longest n-gram matched), got {ds.lookup}")
    if ds.max_draft is not None and ds.max_draft < 1:
        raise LocalLLMError(f"--draft-max must be at least 1, got {ds.max_draft}")
    if not 0.0 <= ds.min_p <= 1.0:
        raise LocalLLMError(f"--draft-min-p must be between 0 and 1, got {ds.min_p}")
    if ds.draft is None and not ds.lookup and (ds.max_draft is not None or ds.min_p > 0):
        raise LocalLLMError("--draft-max and --draft-min-p need a drafter: --draft MODEL, --draft self:TYPE or --lookup N")
    name = self_type(ds.draft)
    if name is not None and name.upper() not in SELF_TYPES:
        raise LocalLLMError(f"unknown type in --draft {ds.draft!r} (self:TYPE with TYPE one of {', '.join(SELF_TYPES)})")


def vocab_difference(target: Tokenizer, draft: Tokenizer) -> str | None:
    """Why draft's ids do not mean target's (None: same size, special ids and leading token texts)."""
    if target.vocab_size != draft.vocab_size:
        return f"it has {draft.vocab_size} tokens, the target {target.vocab_size}"
    for what in ("bos_id", "eos_id", "stop_ids"):
        if getattr(target, what) != getattr(draft, what):
            return f"its {what} is {getattr(draft, what)}, the target's {getattr(target, what)}"
    for i in range(min(VOCAB_CHECKED, target.vocab_size)):
        if target.token_text(i) != draft.token_text(i):
            return f"token {i} is {draft.token_text(i)!r} in it, {target.token_text(i)!r} in the target"
    return None


def check_same_vocab(target: Tokenizer, draft: Tokenizer, name: str) -> None:
    why = vocab_difference(target, draft)
    if why is not None:
        raise LocalLLMError(f"the draft model {name} does not share the target's vocabulary: {why}")


# ---- draft models


def self_draft(model: Transformer, type_name: str, dtype: torch.dtype) -> Transformer:
    """The target with every linear weight quantized in memory to type_name (the encoders of quantize/;
    K-quants fall back as llama.cpp does for rows not a multiple of 256; Q4_K_M is llama.cpp's mix),
    then placed by load.build_model like a GGUF file's: quantized on CUDA, decoded to dense elsewhere.
    The embedding and norms are the target's, in dtype (shared when it is the target's dtype)."""
    cfg, device = model.cfg, model.token_embd.weight.device
    state = dict(model.state_dict())  # dense tensors; a Linear holding a QWeight has no "weight" entry
    if "token_embd.weight" not in state:  # an embedding kept quantized (a QWeight): dense for the draft
        state["token_embd.weight"] = model.token_embd.weight.dequantize(torch.float32)
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        key, w = f"{name}.weight", module.w
        dense = w.dequantize(torch.float32) if isinstance(w, QWeight) else w.detach().float()
        qtype = tensor_type(key.replace(".attn.", "."), type_name, cfg)
        if qtype in FALLBACK and dense.shape[1] % 256:
            qtype = FALLBACK[qtype]
        if qtype is None or dense.shape[1] % BLOCK_SIZES[qtype][0]:
            state[key] = dense
        else:
            state[key] = QuantizedTensor(qtype, torch.from_numpy(quantize_tensor(dense, qtype)).to(device))
    return build_model(cfg, state, str(device), dtype)


class ModelDrafter:
    """Drafts with a model of the target's vocabulary, sampling with the target's sampler settings."""

    def __init__(self, model: Transformer, sampler: Sampler, min_p: float, cost: float):
        self.model, self.sampler, self.min_p, self.cost = model, sampler, min_p, cost
        self.cache: KVCache | None = None

    def start(self, capacity: int, valid: int) -> None:
        if self.cache is None or self.cache.capacity < capacity:
            w = self.model.token_embd.weight
            self.cache = make_cache(self.model.cfg, capacity, dtype=w.dtype, device=w.device)
        self.rollback(valid)

    def rollback(self, valid: int) -> None:
        self.cache.length = min(self.cache.length, valid)

    @torch.inference_mode()
    def propose(self, seq: list[int], history: torch.Tensor, k: int) -> tuple[list[int], torch.Tensor | None]:
        if k < 1:
            return [], None
        self.rollback(len(seq) - 1)  # at least the last id is fed: its logits are the first draft's
        logits = feed(self.model, self.cache, seq[self.cache.length:])
        ids, qs = [], []
        for j in range(k):
            q = self.sampler.probs(logits, history)
            token = draw(q, self.sampler.generator)
            tid = int(token)
            # "unsure": the draft's own softmax (no sampler chain: greedy q is one-hot) gives tid < min_p
            if self.min_p and float(logits.softmax(-1)[tid]) < self.min_p:
                break
            ids.append(tid)
            qs.append(q)
            if j + 1 < k:  # the last draft is fed next round, with the target's own id after it
                history = torch.cat((history, token.view(1)))
                logits = decode_one(self.model, self.cache, token)
        return ids, torch.stack(qs) if qs else None


# ---- prompt lookup


def lookup_ids(history: torch.Tensor, ngram: int, k: int) -> list[int]:
    """Up to k ids that followed the latest earlier occurrence of the last n ids of history (N,),
    trying n = ngram down to 1; [] when none occurs."""
    N = history.numel()
    for n in range(min(ngram, N - 1), 0, -1):
        # windows (N - n, n): history[i : i + n] for every i whose window has a following id
        windows = history[:-1].unfold(0, n, 1)
        hits = (windows == history[-n:]).all(1).nonzero()
        if hits.numel():
            i = int(hits[-1]) + n
            return history[i : i + k].tolist()
    return []


class LookupDrafter:
    """Prompt lookup: no draft model; its proposals are one-hot distributions."""

    def __init__(self, ngram: int, cost: float):
        self.ngram, self.cost = ngram, cost

    def start(self, capacity: int, valid: int) -> None:
        pass

    def rollback(self, valid: int) -> None:
        pass

    def propose(self, seq: list[int], history: torch.Tensor, k: int) -> tuple[list[int], torch.Tensor | None]:
        return (lookup_ids(history, self.ngram, k) if k > 0 else []), None


def open_drafter(
    model: Transformer, tokenizer: Tokenizer | None, ds: DraftSettings, sampling: SamplingSettings
) -> Drafter | None:
    """The drafter ds asks for (None: plain decoding). tokenizer: the target's, to check a draft model's
    vocabulary against (None for a synthetic target, which takes self:TYPE or lookup only)."""
    check_draft(ds)
    if ds.lookup:
        return LookupDrafter(ds.lookup, ds.lookup_cost)
    if ds.draft is None:
        return None
    device = model.token_embd.weight.device
    dtype = pick_dtype(device.type, ds.dtype)
    name = self_type(ds.draft)
    if name is not None:
        draft = self_draft(model, name, dtype)
    elif tokenizer is None:
        raise LocalLLMError("a synthetic target takes --draft self:TYPE or --lookup N, not a draft model")
    else:
        check_same_vocab(tokenizer, load_tokenizer(ds.draft), ds.draft)  # before the weights load
        draft = load_model(ds.draft, device.type, dtype).model
        if draft.cfg.vocab_size != model.cfg.vocab_size:
            raise LocalLLMError(f"the draft model {ds.draft} does not share the target's vocabulary: its output has "
                                f"{draft.cfg.vocab_size} logits, the target's {model.cfg.vocab_size}")
    # its own random stream: draws correlated with the target's acceptance tests would bias the output
    seed = None if sampling.seed is None else (sampling.seed + 1) % 2**63
    return ModelDrafter(draft, Sampler(replace(sampling, seed=seed), device), ds.min_p, ds.draft_cost)
