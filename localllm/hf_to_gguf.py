"""GGUF tokenizer metadata (tokenizer.*) built from a Hugging Face folder, as convert_hf_to_gguf does.

- tokenizer.model present: a SentencePiece vocabulary, tokenizer.ggml.model "llama"
  (the converter's _create_vocab_sentencepiece: pieces, scores and types from sentencepiece,
  then added_tokens.json and tokenizer_config.json's added_tokens_decoder on top).
- else tokenizer.json with a byte-level BPE model: tokenizer.ggml.model "gpt2" (get_vocab_base:
  vocab by id, added tokens typed control or user-defined, missing ids padded as "[PAD{i}]").
Merges, special token ids, add_*_token flags and the chat template come from gguf.SpecialVocab, the
very class the converter calls.

tokenizer.ggml.pre is never guessed: the converter names it by hashing the tokenizer's output, a table
localllm does not have. Instead the tokenizer.json pre-tokenizer (its Split regexes, Digits and
ByteLevel steps) must equal, regex for regex, an entry of localllm.tokenizer.pretok.PRE_TOKENIZERS;
and the built vocabulary, loaded by localllm's own GGUF tokenizer, must tokenize a fixed multi-script
text to exactly the ids the `tokenizers` library gives. Anything else is refused (LocalLLMError, one line).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from .errors import LocalLLMError
from .tensor_names import GGUF_ARCHS, gguf_arch  # noqa: F401 (moved there, re-exported)
from .tokenizer import load_gguf_tokenizer
from .tokenizer.pretok import GPT2_HF, PRE_TOKENIZERS

from localllm.quantize.writer import MetaValue

V = gguf.GGUFValueType
T = gguf.Keys.Tokenizer
K = gguf.Keys.General

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Letters, digits, blanks, newlines, punctuation, contractions, accents, CJK, Cyrillic, Arabic,
# Devanagari, emoji, code: the text the built tokenizer must split exactly as tokenizer.json does.
CHECK_TEXT = (
    "Hello world! It's 2024: the year's 12345 tokens cost $3.50 (or 1,000,000 yen).\n\n"
    "  Two  spaces,\ttab,\r\nCRLF and trailing   \n"
    "Ünïcödé façade naïve café — “quotes” ‘single’ …\n"
    "日本語のテキスト、中文文本。한국어 텍스트 Привет, мир! "
    "مرحبا بالعالم नमस्ते दुनिया 🦙🚀👍🏽\n"
    "def f(x):\n    return {'a': [x**2, x // 3]}  # comment\n"
    "if (a != b && c <= 0x1F) { printf(\"%d\\n\", a); }\n"
    "I'LL DON'T we've they're you'd 3.14159 1e-9 ---=== ...!!!??? \n\t\n   \n"
)


def hf_tokenizer_metadata(folder: Path, vocab_size: int | None) -> dict[str, MetaValue]:
    """The tokenizer.* keys the converter would write for this folder, checked against tokenizer.json
    (or tokenizer.model). vocab_size: config.json's (ids beyond the tokenizer's are padded)."""
    if (folder / "tokenizer.model").is_file():
        kv = _sentencepiece_vocab(folder, vocab_size)
    elif (folder / "tokenizer.json").is_file():
        kv = _bpe_vocab(folder, vocab_size)
    else:
        raise LocalLLMError(f"{folder} has no tokenizer.json or tokenizer.model: pass --tokenizer-from FILE.gguf")
    kv |= _special_vocab(folder, len(kv[T.LIST].value), kv[T.MODEL].value == "gpt2")
    _check_ids(folder, kv)
    return kv


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LocalLLMError(f"bad {path.name} in {path.parent}: {e}") from None


def looks_special(text: str) -> bool:
    """convert_hf_to_gguf's does_token_look_special: added tokens typed control though not marked special."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or text.startswith("<|") and text.endswith("|>")
            or text.startswith("<｜") and text.endswith("｜>")
            or text.startswith("<unused") and text.endswith(">"))


# ---- byte-level BPE (tokenizer.json)

def _bpe_vocab(folder: Path, vocab_size: int | None) -> dict[str, MetaValue]:
    spec = _read_json(folder / "tokenizer.json")
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise LocalLLMError(f"{folder}/tokenizer.json has a {model.get('type')} model, not byte-level BPE: "
                            "pass --tokenizer-from FILE.gguf")
    pre = pre_tokenizer_name(spec, folder)
    vocab: dict[int, str] = {i: t for t, i in model.get("vocab", {}).items()}
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    for i, a in added.items():
        vocab[i] = a["content"]
    n = vocab_size or (max(vocab) + 1 if vocab else 0)
    if vocab and max(vocab) >= n:
        raise LocalLLMError(f"{folder}/tokenizer.json has token id {max(vocab)}, config.json's vocab_size is {n}")
    tokens, types = [], []
    for i in range(n):
        if i not in vocab:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(vocab[i])
            types.append(CONTROL if added[i].get("special") or looks_special(vocab[i]) else USER_DEFINED)
        else:
            tokens.append(vocab[i])
            types.append(NORMAL)
    return {T.MODEL: MetaValue("gpt2", V.STRING), T.PRE: MetaValue(pre, V.STRING),
            T.LIST: MetaValue(tokens, V.ARRAY, V.STRING), T.TOKEN_TYPE: MetaValue(types, V.ARRAY, V.INT32)}


def pre_tokenizer_name(spec: dict, folder: Path) -> str:
    """The PRE_TOKENIZERS name whose regexes are exactly tokenizer.json's pre-tokenizer's."""
    regexes = pre_tokenizer_regexes(spec.get("pre_tokenizer"))
    if regexes is None:
        raise LocalLLMError(f"{folder}/tokenizer.json: its pre-tokenizer is not a byte-level one localllm can "
                            "read (Split regexes / Digits / ByteLevel): pass --tokenizer-from FILE.gguf")
    names = [name for name, p in PRE_TOKENIZERS.items() if p.regexes == regexes]
    if not names:
        raise LocalLLMError(f"{folder}/tokenizer.json: its pre-tokenizer regexes match no known tokenizer.ggml.pre "
                            "name: pass --tokenizer-from FILE.gguf (a GGUF of the same model)")
    ignore = bool((spec.get("model") or {}).get("ignore_merges", False))
    return next((n for n in names if PRE_TOKENIZERS[n].ignore_merges == ignore), names[0])


def pre_tokenizer_regexes(pre: Any) -> tuple[str, ...] | None:
    """The regexes (in order, each splitting "isolated") of a byte-level pre-tokenizer, or None when it
    is not made only of Split(Regex, Isolated) / Digits steps and one final ByteLevel without prefix space."""
    if not isinstance(pre, dict):
        return None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if not steps or not isinstance(steps[-1], dict) or steps[-1].get("type") != "ByteLevel":
        return None
    out = []
    for step in steps[:-1]:
        kind = step.get("type")
        if kind == "Split":
            regex = (step.get("pattern") or {}).get("Regex")
            if regex is None or step.get("behavior") != "Isolated" or step.get("invert"):
                return None
            out.append(regex)
        elif kind == "Digits":
            out.append(r"\p{N}" if step.get("individual_digits") else r"\p{N}+")
        else:
            return None
    last = steps[-1]
    if last.get("add_prefix_space"):
        return None
    if last.get("use_regex", True):
        out.append(GPT2_HF)
    return tuple(out)


# ---- SentencePiece (tokenizer.model)

def _sentencepiece_vocab(folder: Path, vocab_size: int | None) -> dict[str, MetaValue]:
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise LocalLLMError(f"{folder} has a SentencePiece tokenizer.model: install sentencepiece, "
                            "or pass --tokenizer-from FILE.gguf") from None
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(folder / "tokenizer.model"))
    except (OSError, RuntimeError) as e:
        raise LocalLLMError(f"cannot read {folder}/tokenizer.model: {e}") from None
    n = vocab_size or sp.vocab_size()
    tokens = [f"[PAD{i}]" for i in range(n)]
    scores = [-10000.0] * n
    types = [UNUSED] * n
    for i in range(min(n, sp.vocab_size())):
        tokens[i], scores[i] = sp.IdToPiece(i), sp.GetScore(i)
        types[i] = (UNKNOWN if sp.IsUnknown(i) else CONTROL if sp.IsControl(i) else
                    UNUSED if sp.IsUnused(i) else BYTE if sp.IsByte(i) else NORMAL)
    for text, i in _read_json(folder / "added_tokens.json").items():
        if i < n:
            tokens[i], scores[i], types[i] = text, -1000.0, USER_DEFINED
    decoder = _read_json(folder / "tokenizer_config.json").get("added_tokens_decoder", {})
    for key, data in decoder.items():
        i, text = int(key), data["content"]
        if i >= n:
            continue
        if data.get("special") or looks_special(text):
            types[i] = CONTROL
        else:
            text, types[i] = text.replace("\u2581", " "), USER_DEFINED
        tokens[i], scores[i] = text, -1000.0
    return {T.MODEL: MetaValue("llama", V.STRING), T.PRE: MetaValue("default", V.STRING),
            T.LIST: MetaValue(tokens, V.ARRAY, V.STRING), T.SCORES: MetaValue(scores, V.ARRAY, V.FLOAT32),
            T.TOKEN_TYPE: MetaValue(types, V.ARRAY, V.INT32)}


# ---- merges, special ids, add_*_token, chat template

def _special_vocab(folder: Path, n_vocab: int, merges: bool) -> dict[str, MetaValue]:
    try:
        sv = gguf.SpecialVocab(folder, load_merges=merges, n_vocab=n_vocab)
    except (ValueError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LocalLLMError(f"cannot read the tokenizer files of {folder}: {e}") from None
    kv = {}
    if sv.merges:
        kv[T.MERGES] = MetaValue(list(sv.merges), V.ARRAY, V.STRING)
    elif merges:
        raise LocalLLMError(f"{folder}/tokenizer.json has no merges")
    for typ, tid in sv.special_token_ids.items():
        key = getattr(T, {"pad": "PAD_ID", "unk": "UNK_ID"}.get(typ, f"{typ.upper()}_ID"), None)
        if key is not None:
            kv[key] = MetaValue(int(tid), V.UINT32)
    for typ, value in sv.add_special_token.items():
        key = getattr(T, f"ADD_{typ.upper()}", None)
        if key is not None:
            kv[key] = MetaValue(bool(value), V.BOOL)
    template = sv.chat_template
    if isinstance(template, list):  # named templates, as GGUFWriter.add_chat_template writes them
        named = {}
        for choice in template:
            name = "".join(c if c.isascii() and c.isalnum() else "_" for c in choice.get("name", ""))
            if name and choice.get("template") is not None:
                named[name] = choice["template"]
        for name, text in named.items():
            if name != "default":
                kv[T.CHAT_TEMPLATE_N.format(name=name)] = MetaValue(text, V.STRING)
        if len(named) > ("default" in named):
            kv[T.CHAT_TEMPLATES] = MetaValue([n for n in named if n != "default"], V.ARRAY, V.STRING)
        template = named.get("default")
    if isinstance(template, str):
        kv[T.CHAT_TEMPLATE] = MetaValue(template, V.STRING)
    return kv


# ---- the check that makes it faithful

def _check_ids(folder: Path, kv: dict[str, MetaValue]) -> None:
    """The built vocabulary, as localllm loads it, must give the reference tokenizer's ids on CHECK_TEXT."""
    ours = load_gguf_tokenizer({k: v.value for k, v in kv.items()})
    got = ours.encode(CHECK_TEXT, add_bos=False, parse_special=False)
    if kv[T.MODEL].value == "gpt2":
        from tokenizers import Tokenizer

        ref, source = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(
            CHECK_TEXT, add_special_tokens=False).ids, "tokenizer.json"
    else:
        from sentencepiece import SentencePieceProcessor

        sp = SentencePieceProcessor()
        sp.LoadFromFile(str(folder / "tokenizer.model"))
        ref, source = sp.EncodeAsIds(CHECK_TEXT), "tokenizer.model"
    if list(got) != list(ref):
        at = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        raise LocalLLMError(f"{folder}: the GGUF tokenizer built from {source} (pre {kv[T.PRE].value!r}) does not "
                            f"reproduce its ids (first difference at token {at}): pass --tokenizer-from FILE.gguf")


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute on the rows (output dim): rotate-half pairs -> interleaved."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def converter_rope_freqs(hp: dict, head_dim: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: llama3 rope scaling's per-frequency divisors, computed as
    the converter does (float32 base frequencies, python float arithmetic) so the bytes match."""
    rs = hp.get("rope_scaling") or hp.get("rope_parameters") or {}
    base = hp.get("rope_theta") or rs.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = rs.get("factor", 8.0)
    low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def hf_metadata(hp: dict, cfg, folder: Path, arch: str) -> dict[str, MetaValue]:
    """The keys convert_hf_to_gguf writes for these architectures (TextModel / LlamaModel
    set_gguf_parameters), from config.json's own values: absent ones are not written."""
    kv = {K.ARCHITECTURE: MetaValue(arch, V.STRING), K.TYPE: MetaValue("model", V.STRING),
          K.NAME: MetaValue(folder.resolve().name, V.STRING)}

    def put(key: str, value, vtype: gguf.GGUFValueType) -> None:
        if value is not None:
            kv[key.format(arch=arch)] = MetaValue(value, vtype)

    put(gguf.Keys.LLM.BLOCK_COUNT, cfg.n_layers, V.UINT32)
    put(gguf.Keys.LLM.CONTEXT_LENGTH, first_value(hp, "max_position_embeddings", "n_ctx", "n_positions"), V.UINT32)
    put(gguf.Keys.LLM.EMBEDDING_LENGTH, cfg.dim, V.UINT32)
    put(gguf.Keys.LLM.FEED_FORWARD_LENGTH, cfg.ffn_dim, V.UINT32)
    put(gguf.Keys.Attention.HEAD_COUNT, cfg.n_heads, V.UINT32)
    put(gguf.Keys.Attention.HEAD_COUNT_KV, cfg.n_kv_heads, V.UINT32)
    put(gguf.Keys.Rope.FREQ_BASE, hp.get("rope_theta"), V.FLOAT32)
    put(gguf.Keys.Attention.LAYERNORM_RMS_EPS, first_value(hp, "rms_norm_eps", "norm_eps"), V.FLOAT32)
    put(gguf.Keys.Attention.KEY_LENGTH, hp.get("head_dim"), V.UINT32)
    put(gguf.Keys.Attention.VALUE_LENGTH, hp.get("head_dim"), V.UINT32)
    kv[K.FILE_TYPE] = MetaValue(0, V.UINT32)  # set by the preset
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "linear":  # TextModel.set_gguf_parameters
        put(gguf.Keys.Rope.SCALING_TYPE, "linear", V.STRING)
        put(gguf.Keys.Rope.SCALING_FACTOR, cfg.rope_scaling.factor, V.FLOAT32)
    if arch in ("llama", "smollm3"):  # LlamaModel.set_gguf_parameters (SmolLM3Model is a LlamaModel)
        put(gguf.Keys.LLM.VOCAB_SIZE, cfg.vocab_size, V.UINT32)
        put(gguf.Keys.Rope.DIMENSION_COUNT, cfg.head_dim, V.UINT32)
    if arch == "phi3":
        kv |= {k.format(arch=arch): v for k, v in phi3_metadata(hp, cfg).items()}
    if arch in ("gemma2", "gemma3") and cfg.sliding_window is not None:  # Gemma2Model / Gemma3Model
        put(gguf.Keys.Attention.SLIDING_WINDOW, cfg.sliding_window, V.UINT32)
    if cfg.n_experts:
        moe_metadata(put, cfg, arch)
    return kv


def phi3_metadata(hp: dict, cfg) -> dict[str, MetaValue]:
    """Phi3MiniModel.set_gguf_parameters' own keys: the original context, the rotated dims, the sliding
    window (0: none) and, with LongRoPE, its attention factor from max / original context as the
    converter computes it (its rope_factors_short/long tensors: config_phi3.hf_rope_tensors)."""
    from .config_phi3 import longrope_attn_factor

    context = first_value(hp, "max_position_embeddings", "n_positions")
    original = hp.get("original_max_position_embeddings") or context
    kv = {gguf.Keys.Rope.SCALING_ORIG_CTX_LEN: MetaValue(original, V.UINT32),
          gguf.Keys.Rope.DIMENSION_COUNT: MetaValue(cfg.rotary_dim or cfg.head_dim, V.UINT32),
          gguf.Keys.Attention.SLIDING_WINDOW: MetaValue(hp.get("sliding_window") or 0, V.UINT32)}
    if cfg.rope_original_context is not None:
        kv[gguf.Keys.Rope.SCALING_ATTN_FACTOR] = MetaValue(longrope_attn_factor(context, original), V.FLOAT32)
    return kv


def moe_metadata(put, cfg, arch: str) -> None:
    """The converter's expert keys (TextModel: expert_count / expert_used_count; Qwen3MoeModel and
    GptOssModel: expert_feed_forward_length), and gpt-oss's sliding window and YaRN (the base class's
    rope scaling keys)."""
    put(gguf.Keys.LLM.EXPERT_COUNT, cfg.n_experts, V.UINT32)
    put(gguf.Keys.LLM.EXPERT_USED_COUNT, cfg.n_experts_used, V.UINT32)
    if arch != "llama":
        put(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, cfg.expert_ffn_dim, V.UINT32)
    if arch != "gpt-oss":
        return
    put(gguf.Keys.Rope.FREQ_BASE, cfg.rope_theta, V.FLOAT32)  # also where config.json has it in rope_parameters
    put(gguf.Keys.Attention.SLIDING_WINDOW, cfg.sliding_window, V.UINT32)
    rs = cfg.rope_scaling
    if rs is not None and rs.kind == "yarn":
        put(gguf.Keys.Rope.SCALING_TYPE, "yarn", V.STRING)
        put(gguf.Keys.Rope.SCALING_FACTOR, rs.factor, V.FLOAT32)
        put(gguf.Keys.Rope.SCALING_ORIG_CTX_LEN, rs.original_context, V.UINT32)
        put(gguf.Keys.Rope.SCALING_YARN_BETA_FAST, rs.beta_fast, V.FLOAT32)
        put(gguf.Keys.Rope.SCALING_YARN_BETA_SLOW, rs.beta_slow, V.FLOAT32)


def first_value(hp: dict, *keys: str):
    return next((hp[k] for k in keys if hp.get(k) is not None), None)
