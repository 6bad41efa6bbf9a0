"""Pre-tokenizer table for byte-level BPE vocabularies: GGUF `tokenizer.ggml.pre` name -> regex list.

Data only. Each entry must split text exactly as llama.cpp's `llm_tokenizer_bpe` does for that name
(src/llama-vocab.cpp: the `tokenizer_pre == ...` chain picks a pre-type, the `llm_tokenizer_bpe`
constructor picks the regex list). The regexes are applied in order; each one splits every piece left
by the ones before it into matches and the gaps between them (tokenizers' Split behavior "isolated",
which is what llama.cpp's `unicode_regex_split` does). Where llama.cpp rewrote a regex because
std::regex lacks a feature, we keep the original from the model's tokenizer.json (the Oniguruma engine
of the `tokenizers` library understands it), since that is what the reference outputs come from.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # llama.cpp `ignore_merges`: a whole word found in the vocab is one token
    add_bos: bool | None = None  # llama.cpp's default for add_bos when the GGUF does not say
    force_add_bos: bool = False  # llama.cpp sets add_bos whatever the GGUF says (its Gemma 4 workaround)
    # SentencePiece-style BPE (llama.cpp `byte_encode = false`, `escape_whitespaces`): the vocabulary
    # holds raw UTF-8 characters with spaces written "\u2581", a character without a token becomes
    # <0xNN> byte tokens, instead of GPT-2's byte alphabet.
    byte_encode: bool = True
    escape_spaces: bool = False
    # llama.cpp's Gemma 4 fix (PR 21343): a piece made only of newlines that is itself a token is
    # taken whole instead of being merged
    whole_newline_runs: bool = False


def _chars(ranges: list[tuple[int, int]]) -> str:
    """Regex character-class body from code point ranges (written as numbers so no editor can
    normalise the singleton-decomposing letters such as U+2126 OHM SIGN)."""
    return "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in ranges)


# GPT-2's regex, in llama.cpp's form (no trailing `|\s+`; the gaps it would match stay pieces anyway).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# GPT-2's regex as the `tokenizers` ByteLevel pre-tokenizer has it (HF gpt2 tokenizer.json).
GPT2_HF = GPT2 + r"|\s+"

# Llama 3 tokenizer.json (llama.cpp LLAMA3; also DBRX, smaug, chatglm-bpe).
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 tokenizer.json: like Llama 3 but digits one at a time (llama.cpp QWEN2, STABLELM2).
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral tekken tokenizer.json (llama.cpp TEKKEN, original form).
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k / GPT-4o tokenizer.json (llama.cpp GPT4O, original form).
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# BLOOM / Poro / Viking: everything but blanks and a few punctuation marks (llama.cpp BLOOM).
BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

# CJK ideographs, Samaritan..CJK, Hangul syllables: "[一-龥ࠀ-一가-퟿]+" (deepseek tokenizer.json).
CJK_HANGUL = "[" + _chars([(0x4E00, 0x9FA5), (0x0800, 0x4E00), (0xAC00, 0xD7FF)]) + "]+"

# DeepSeek LLM tokenizer.json: the cased letters (\p{LC}) spelled out, as of its Unicode version.
_DEEPSEEK_LETTERS = _chars([
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF),
    (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x376), (0x377, 0x377), (0x37B, 0x37D),
    (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C), (0x38E, 0x3A1), (0x3A3, 0x3F5),
    (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556), (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD),
    (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A),
    (0x1E00, 0x1F15), (0x1F18, 0x1F1D), (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57),
    (0x1F59, 0x1F59), (0x1F5B, 0x1F5B), (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4),
    (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE), (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3),
    (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102),
    (0x2107, 0x2107), (0x210A, 0x2113), (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124),
    (0x2126, 0x2126), (0x2128, 0x2128), (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139),
    (0x213C, 0x213F), (0x2145, 0x2149), (0x214E, 0x214E), (0x2183, 0x2183), (0x2184, 0x2184),
    (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE), (0x2CF2, 0x2CF2), (0x2CF3, 0x2CF3),
    (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E),
    (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A),
    (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2),
    (0x118A0, 0x118DF), (0x1E900, 0x1E943),
])
# ASCII and fullwidth punctuation, curly quotes, ideographic space..full stop: "[!-/:-~！-／：-～‘-‟　-。]".
_DEEPSEEK_PUNCT = _chars([(0x21, 0x2F), (0x3A, 0x7E), (0xFF01, 0xFF0F), (0xFF1A, 0xFF5E),
                          (0x2018, 0x201F), (0x3000, 0x3002)])

DEEPSEEK_LLM = (
    "[\r\n]",
    r"\s?[" + _DEEPSEEK_LETTERS + "]+",
    r"\s?[" + _DEEPSEEK_PUNCT + "]+",
    r"\s+$",
    CJK_HANGUL,
    r"\p{N}+",
)
DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK_HANGUL, r"\p{N}")
DEEPSEEK3 = (
    r"\p{N}{1,3}",
    "[" + _chars([(0x4E00, 0x9FA5), (0x3040, 0x309F), (0x30A0, 0x30FF)]) + "]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_LLAMA3 = PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)
_GPT2 = PreTokenizer((GPT2_HF,))
_DIGITS_GPT2 = PreTokenizer((r"\p{N}", GPT2_HF))  # starcoder family: single digits, then GPT-2
_QWEN2 = PreTokenizer((QWEN2,))
# Gemma 4 (llama.cpp GEMMA4): no word splitting, only runs of newlines apart from everything else.
_GEMMA4 = PreTokenizer((r"[^\n]+|[\n]+",), force_add_bos=True, byte_encode=False, escape_spaces=True,
                       whole_newline_runs=True)

# name -> pre-tokenizer; several names share one entry exactly as in llama.cpp's name chain.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2"], _LLAMA3),
    **dict.fromkeys(["dbrx", "smaug-bpe"], PreTokenizer((LLAMA3,))),
    "chatglm-bpe": PreTokenizer((LLAMA3,)),
    "glm4": PreTokenizer((LLAMA3,)),
    "gemma4": _GEMMA4,
    "deepseek-llm": PreTokenizer(DEEPSEEK_LLM),
    "deepseek-coder": PreTokenizer(DEEPSEEK_CODER),
    "deepseek-v3": PreTokenizer(DEEPSEEK3),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]")),
    **dict.fromkeys(["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"],
                    _DIGITS_GPT2),
    **dict.fromkeys(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                     "jina-v1-en", "jina-v2-code", "roberta-bpe", "a.x-4.0", "mellum", "modern-bert",
                     "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"], _GPT2),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan"], _QWEN2),
    **dict.fromkeys(["bloom", "poro-chat", "gpt3-finnish"], PreTokenizer((BLOOM,))),
    "viking": PreTokenizer((BLOOM, r"\p{N}")),
    "tekken": PreTokenizer((TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(["gpt-4o", "llama4"], PreTokenizer((GPT4O,))),
    "seed-coder": PreTokenizer((
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "chameleon": PreTokenizer((
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        GPT2,
    ), add_bos=True),
}
