"""Drafters for speculative decoding (speculative.py's Drafter): a draft model, which is another model
file sharing the target's vocabulary or the target itself quantized in memory ("self:TYPE"), and
prompt lookup, which proposes what followed the latest earlier occurrence of the last n ids.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from localllm.quantize import quantize_tensor
from localllm.quantize.presets import FLOAT_TYPES, PRESETS, ModelShape, fallback, find_preset, preset_types

from . import options
from .footprint import expert_share, expert_weights, linear_weights, nbytes
from .cache import KVCache
from .device import check_dtype_name, pick_dtype
from .errors import LocalLLMError
from .generate import decode_one
from .load import build_model, load_model, load_tokenizer
from .model import Transformer
from .nonfinite import dense, matrices
from .runtime import Runtime
from .sampling import Sampler, draw, is_plain_greedy
from .settings import DraftSettings, SamplingSettings
from .speculative import Drafter, feed
from .tokenizer import Tokenizer
from .weights import QuantizedTensor, gguf_name

SELF = "self:"
SELF_TYPES = list(PRESETS)  # those of `localllm quantize --type`
VOCAB_CHECKED = 1000  # leading token texts compared (the whole table of a 150k vocabulary is slow to walk)


# ---- options


def self_type(spec: str | None) -> str | None:
    """"self:Q4_0" -> "Q4_0"; None for a model path or name."""
    return spec[len(SELF):] if spec is not None and spec.startswith(SELF) else None


def check_draft(ds: DraftSettings) -> None:
    """Bad combinations and values, before any model loads."""
    if ds.draft is not None and ds.lookup:
        raise LocalLLMError("--draft and --lookup exclude each other: choose one drafter")
    options.at_least("--lookup", ds.lookup, 0, "(the longest n-gram matched; 0: off)")
    if ds.max_draft is not None:
        options.at_least("--draft-max", ds.max_draft, 1)
    options.between("--draft-min-p", ds.min_p, 0, 1)
    if ds.draft is None and not ds.lookup and (ds.max_draft is not None or ds.min_p > 0):
        raise LocalLLMError("--draft-max and --draft-min-p need a drafter: --draft MODEL, --draft self:TYPE or --lookup N")
    if ds.dtype is not None:
        check_dtype_name("--draft-dtype", ds.dtype)
    name = self_type(ds.draft)
    if name is not None and find_preset(name) is None:
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


def self_draft(target: Runtime, type_name: str, dtype: torch.dtype) -> Runtime:
    """The target quantized in memory as `localllm quantize --type type_name` would write it (llama.cpp's
    per-tensor rules: quantize/presets.py; the encoders of quantize/), then built as load_model builds a
    file's weights on the target's backend (load.build_model: blocks on the CPU and MPS, the embedding
    too; QWeights on CUDA, the embedding decoded, as the loader decodes it there). Norms are the
    target's, in dtype (shared where it is the target's)."""
    model, cfg, device = target.model, target.cfg, target.device
    blocks = type(target).quantized == "blocks"
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(".weight") or v.dim() == 1}
    weights = matrices(model)
    shape = ModelShape(cfg.arch, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.n_experts)
    types = preset_types(find_preset(type_name), [(gguf_name(k), tuple(w.shape)) for k, w in weights.items()], shape)
    for (name, w), qtype in zip(weights.items(), types):
        qtype = None if qtype is None or (name == "token_embd.weight" and not blocks) else fallback(qtype, w.shape[1])
        if qtype is None or qtype in FLOAT_TYPES:
            state[name] = dense(w)  # build_model casts it to dtype
        else:  # one fp32 copy at a time (an 8B model's would not fit beside it)
            state[name] = QuantizedTensor(qtype, torch.from_numpy(quantize_tensor(dense(w).float(), qtype)).to(device))
    return build_model(cfg, state, str(device), dtype)


class ModelDrafter:
    """Drafts with a model of the target's vocabulary, sampling with the target's sampler settings."""

    def __init__(self, rt: Runtime, sampler: Sampler, min_p: float, cost: float):
        self.rt, self.sampler, self.min_p, self.cost = rt, sampler, min_p, cost
        self.cache: KVCache | None = None

    def start(self, capacity: int, valid: int) -> None:
        if self.cache is None or self.cache.capacity < capacity:
            self.cache = self.rt.new_cache(capacity)
        self.rollback(valid)

    def rollback(self, valid: int) -> None:
        self.cache.length = min(self.cache.length, valid)

    @torch.inference_mode()
    def propose(self, seq: list[int], history: torch.Tensor, k: int) -> tuple[list[int], torch.Tensor | None]:
        if k < 1:
            return [], None
        self.rollback(len(seq) - 1)  # at least the last id is fed: its logits are the first draft's
        logits = feed(self.rt, self.cache, seq[self.cache.length:])
        if is_plain_greedy(self.sampler) and not self.min_p:  # one-hot q: ids only, no distributions
            ids = []
            for j in range(k):
                token = logits.argmax()
                ids.append(token)
                if j + 1 < k:
                    logits = decode_one(self.rt, self.cache, token)
            return torch.stack(ids).tolist(), None  # one host sync for the round
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
                logits = decode_one(self.rt, self.cache, token)
        return ids, torch.stack(qs) if qs else None


# ---- prompt lookup


def lookup_ids(history: torch.Tensor, ngram: int, k: int) -> list[int]:
    """Up to k ids that followed an earlier occurrence of the last n ids of history (N,), trying
    n = ngram down to 1; [] when none occurs. The occurrence: the latest with k ids after it (the
    freshest context), else the earliest (the most ids: the latest of a short cycle has only one or two)."""
    N = history.numel()
    for n in range(min(ngram, N - 1), 0, -1):
        # windows (N - n, n): history[i : i + n] for every i whose window has a following id
        windows = history[:-1].unfold(0, n, 1)
        hits = (windows == history[-n:]).all(1).nonzero().flatten()
        if hits.numel():
            whole = hits[hits + n + k <= N]
            i = int(whole[-1] if whole.numel() else hits[0]) + n
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
        # searched on the CPU: on the target's GPU each n-gram try would be several launches and syncs
        return (lookup_ids(torch.tensor(seq), self.ngram, k) if k > 0 else []), None


def open_drafter(
    target: Runtime, tokenizer: Tokenizer | None, ds: DraftSettings, sampling: SamplingSettings
) -> Drafter | None:
    """The drafter ds asks for (None: plain decoding). tokenizer: the target's, to check a draft model's
    vocabulary against (None for a synthetic target, which takes self:TYPE or lookup only)."""
    check_draft(ds)
    if ds.lookup:
        return LookupDrafter(ds.lookup, ds.lookup_cost)
    if ds.draft is None:
        return None
    device = target.device
    dtype = pick_dtype(str(device), ds.dtype)
    name = self_type(ds.draft)
    if name is not None:
        draft = self_draft(target, name, dtype)
    elif tokenizer is None:
        raise LocalLLMError("a synthetic target takes --draft self:TYPE or --lookup N, not a draft model")
    else:
        check_same_vocab(tokenizer, load_tokenizer(ds.draft), ds.draft)  # before the weights load
        draft = load_model(ds.draft, str(device), dtype).runtime
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise LocalLLMError(f"the draft model {ds.draft} does not share the target's vocabulary: its output has "
                                f"{draft.cfg.vocab_size} logits, the target's {target.cfg.vocab_size}")
    cost = step_bytes(draft.model) / step_bytes(target.model)
    return ModelDrafter(draft, draft_sampler(sampling, device), ds.min_p, cost)


def draft_sampler(sampling: SamplingSettings, device) -> Sampler:
    """The draft model's sampler for a request sampled with `sampling`: its own random stream (seed + 1):
    draws correlated with the target's acceptance tests would bias the output."""
    seed = None if sampling.seed is None else (sampling.seed + 1) % 2**63
    return Sampler(replace(sampling, seed=seed), device)


def step_bytes(model: Transformer) -> int:
    """Weight bytes a decode step reads, about (every linear and the output head): decoding is bound by
    reading them, so their ratio is a draft step's cost relative to the target's."""
    head = [model.token_embd.weight] if model.cfg.tied_output else []
    experts = sum(nbytes(w) for w in expert_weights(model)) * expert_share(model)  # k of E experts
    return sum(nbytes(w) for w in linear_weights(model) + head) + round(experts)
