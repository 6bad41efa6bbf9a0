"""The real chat templates of issue 19's families render to exactly what transformers renders.

Templates: tests/data/templates/*.jinja (origins and licences in NOTICE.md there) and the templates
inside llama.cpp's Gemma 4 and Phi-3 vocabulary files. Oracle: transformers' own renderer
(`render_jinja_template`, what `apply_chat_template(tokenize=False)` calls) on the same text, with the
special tokens its tokenizer passes (`special_tokens_map`) and nothing else: tools and documents None,
no date, no reasoning effort, no enable_thinking; the templates' own defaults fill those in, and
`strftime_now` gives both renderers today's date. Ours goes through the chat session's path
(render_with_spans, and chat_prompt where a tokenizer is loaded from a file by our loaders)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import gguf
import pytest

from localllm.chat import chat_prompt
from localllm.chat_template import render, render_with_spans
from localllm.errors import LocalLLMError
from localllm.gguf_file import open_gguf
from localllm.hf_to_gguf import hf_tokenizer_metadata
from localllm.load import load_tokenizer
from test_chat_template import CONVERSATIONS, QWEN2_SPECIALS, QWEN2_SPLIT, trained_bpe, write_bpe_gguf

DATA = Path(__file__).resolve().parent / "data"
TEMPLATES = DATA / "templates"

# file -> the special tokens the model's HF tokenizer passes to its template (special_tokens_map;
# those a template never reads are left out, as a tokenizer without them would).
SPECIALS: dict[str, dict[str, str]] = {
    "gemma-2-2b-it.jinja": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
    "gemma-3-it.jinja": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
    "gemma-3-it-first-release.jinja": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                                       "unk_token": "<unk>"},
    "gemma-4-31b-it.jinja": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
    "phi-3-mini-instruct.jinja": {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>"},
    "phi-3-medium-instruct.jinja": {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>"},
    "phi-3.5-mini-instruct.jinja": {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>"},
    "phi-4.jinja": {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|dummy_85|>"},
    "phi-4-mini-instruct.jinja": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
    "smollm3-3b.jinja": {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"},
    "mixtral-8x7b-instruct-v0.1.jinja": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "qwen3-0.6b.jinja": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "gpt-oss-120b.jinja": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
}

THINK = [  # a reply of a reasoning model as our chat records it: the think block in the content
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4."},
    {"role": "user", "content": "And 3+3?"},
]
TRANSCRIPT = [  # ends with the assistant's turn: rendered with and without a generation prompt
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
]
ALL_CONVERSATIONS = {**CONVERSATIONS, "think": THINK, "transcript": TRANSCRIPT}


def template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def vocab_template(name: str) -> str:
    """tokenizer.chat_template of a llama.cpp vocabulary file (our GGUF reader; gguf.GGUFReader takes
    minutes over Gemma 4's 262k-token arrays)."""
    return open_gguf(DATA / "vocab" / name).metadata[gguf.Keys.Tokenizer.CHAT_TEMPLATE]


def theirs(source: str, messages, add_generation_prompt: bool, specials: dict[str, str]) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template([messages], chat_template=source, add_generation_prompt=add_generation_prompt,
                                 **specials)[0][0]


def ours(source: str, messages, add_generation_prompt: bool, specials: dict[str, str]) -> str:
    """The chat path's render (render_with_spans), checked to place every span on a message's text."""
    text, spans = render_with_spans(source, messages, add_generation_prompt, specials.get("bos_token", ""),
                                    specials.get("eos_token", ""))
    contents = {m["content"] for m in messages} | {m["content"].strip() for m in messages}
    assert all(text[a:b] in contents or text[a:b].strip() in contents for a, b in spans), spans
    return text


def assert_same(source: str, specials: dict[str, str], conversations=ALL_CONVERSATIONS) -> dict[str, str]:
    """Equal text for every conversation, with and without the generation prompt; where transformers'
    render raises (the template refuses the conversation), ours raises the same message as one error
    line. -> {conversation name: our text with the generation prompt} for the renders that succeed."""
    rendered = {}
    for name, messages in conversations.items():
        for add in (True, False):
            try:
                expected = theirs(source, messages, add, specials)
            except Exception as e:  # jinja2's TemplateError (raise_exception) or an error in the template
                with pytest.raises(LocalLLMError, match="^chat template error: "):
                    ours(source, messages, add, specials)
                try:
                    render(source, messages, add, specials.get("bos_token", ""), specials.get("eos_token", ""))
                except LocalLLMError as ours_error:
                    assert str(ours_error) == f"chat template error: {str(e).splitlines()[0]}", name
                continue
            got = ours(source, messages, add, specials)
            assert got == expected, (name, add)
            if add:
                rendered[name] = got
    return rendered


# ---- every stored template against transformers -------------------------------------------------

def test_every_stored_template_is_covered():
    assert sorted(p.name for p in TEMPLATES.glob("*.jinja")) == sorted(SPECIALS)


@pytest.mark.parametrize("name", sorted(SPECIALS))
def test_family_template_matches_transformers(name):
    source = template(name)
    rendered = assert_same(source, SPECIALS[name])
    # the conversations of a chat (user first, alternating) render on every one of these templates
    assert {"user", "no_system_multi", "think"} <= set(rendered), name
    for text in rendered.values():
        assert "What is" in text or "Hi" in text or "Ünïcödé" in text  # the messages are in it


def test_template_specific_features():
    """What each family's template does with no extra variables (the defaults transformers leaves to
    the template), pinned so that a renderer mistake that also hit the oracle would show."""
    today = datetime.now().strftime("%Y-%m-%d")
    gpt = template("gpt-oss-120b.jinja")
    text = render(gpt, CONVERSATIONS["system"], True)
    assert text.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n")
    assert f"Current date: {today}\n\nReasoning: medium\n\n" in text  # strftime_now, reasoning_effort's default
    assert "<|start|>developer<|message|># Instructions\n\nYou are a terse assistant." in text
    assert text.endswith("<|start|>user<|message|>What is the capital of France?<|end|><|start|>assistant")

    smol = render(template("smollm3-3b.jinja"), CONVERSATIONS["user"], True)
    assert "Reasoning Mode: /think\n" in smol  # enable_thinking's default (the template's own): on
    assert smol.endswith("<|im_start|>assistant\n")

    qwen = render(template("qwen3-0.6b.jinja"), THINK, True)  # the earlier turn's think block is dropped
    assert "<|im_start|>assistant\n4.<|im_end|>" in qwen and "Two and two" not in qwen

    gemma3 = render(template("gemma-3-it.jinja"), CONVERSATIONS["system"], True, "<bos>")
    assert gemma3 == ("<bos><start_of_turn>user\nYou are a terse assistant.\n\nWhat is the capital of France?"
                      "<end_of_turn>\n<start_of_turn>model\n")
    # Gemma 3's first template reads a system message only as content parts: a plain string is refused,
    # by transformers as by us (the later revision above takes both)
    with pytest.raises(LocalLLMError, match="'str object' has no attribute 'text'"):
        render(template("gemma-3-it-first-release.jinja"), CONVERSATIONS["system"], True, "<bos>")
    with pytest.raises(LocalLLMError, match="System role not supported"):
        render(template("gemma-2-2b-it.jinja"), CONVERSATIONS["system"], True, "<bos>")

    mixtral = render(template("mixtral-8x7b-instruct-v0.1.jinja"), CONVERSATIONS["multi"], True, "<s>", "</s>")
    assert mixtral.startswith("<s> [INST] Answer in one sentence.\n\nHi there [/INST] Hello! How can I help?</s>")

    assert render(template("phi-4-mini-instruct.jinja"), CONVERSATIONS["system"], True) == (
        "<|system|>You are a terse assistant.<|end|><|user|>What is the capital of France?<|end|><|assistant|>")
    assert render(template("phi-4.jinja"), CONVERSATIONS["user"], True) == (
        "<|im_start|>user<|im_sep|>What is the capital of France?<|im_end|><|im_start|>assistant<|im_sep|>")


@pytest.mark.parametrize("vocab", ["ggml-vocab-gemma-4.gguf", "ggml-vocab-phi-3.gguf"])
def test_vocab_file_template_through_our_reader(vocab):
    """The template inside a real GGUF, as our GGUF reader reads it (tokenizer.chat_template), rendered
    with the file's own BOS/EOS texts, equals transformers' render of the same text with those tokens."""
    meta = open_gguf(DATA / "vocab" / vocab).metadata
    source = meta[gguf.Keys.Tokenizer.CHAT_TEMPLATE]
    assert source.startswith("{") and len(source) > 200
    tokens = meta[gguf.Keys.Tokenizer.LIST]
    specials = {"bos_token": tokens[meta[gguf.Keys.Tokenizer.BOS_ID]],
                "eos_token": tokens[meta[gguf.Keys.Tokenizer.EOS_ID]]}
    assert {"user", "no_system_multi"} <= set(assert_same(source, specials))
    if vocab == "ggml-vocab-gemma-4.gguf":  # another revision than llama.cpp's gemma-4-31B-it copy
        assert source != template("gemma-4-31b-it.jinja") and specials["bos_token"] == "<bos>"


def test_phi3_vocab_file_chat_prompt():
    """Phi-3's GGUF through our tokenizer loader and chat_prompt: transformers' text and one BOS (the
    template's). The ids are the tokenizer's business (llama.cpp gives Phi-3's special tokens rstrip, as
    its tokenizer.json does, so the newline after <|user|> goes; transformers' GGUF reader does not know
    that, so its ids are no oracle here). (Gemma 4's vocabulary type, 'gemma4', is read
    by the Gemma 4 tokenizer of issue 19; test_vocab_file_template_through_our_reader covers its template.)"""
    path = DATA / "vocab" / "ggml-vocab-phi-3.gguf"
    tok = load_tokenizer(str(path))
    source = vocab_template(path.name)
    assert tok.chat_template == source and "{{ bos_token }}" in source
    specials = {"bos_token": tok.token_text(tok.bos_id), "eos_token": tok.token_text(tok.eos_id)}
    for name, messages in ALL_CONVERSATIONS.items():
        text, ids = chat_prompt(tok, source, messages)
        assert text == theirs(source, messages, True, specials), name
        assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id, name


# ---- our loaders find the templates where transformers and llama.cpp's converter do -------------

def hf_folder(path: Path, config_template: str | None, jinja: str | None) -> Path:
    """A Qwen-style HF tokenizer folder: tokenizer.json, tokenizer_config.json (with or without a
    "chat_template"), and chat_template.jinja if given (how transformers >= 4.50 saves templates)."""
    path.mkdir()
    (path / "tokenizer.json").write_text(trained_bpe(tuple(QWEN2_SPECIALS), QWEN2_SPLIT).to_str())
    cfg = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "add_bos_token": False}
    if config_template is not None:
        cfg["chat_template"] = config_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return path


def test_hf_folder_chat_template_jinja(tmp_path):
    """SmolLM3's and Qwen3's templates in chat_template.jinja beside a tokenizer_config.json without
    one: our loader and AutoTokenizer read the same text, and the prompt ids equal transformers'."""
    from transformers import AutoTokenizer

    for name in ("smollm3-3b.jinja", "qwen3-0.6b.jinja"):
        source = template(name)
        folder = hf_folder(tmp_path / name, None, source)
        tok, hf = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
        assert tok.chat_template == hf.chat_template == source
        for conv, messages in ALL_CONVERSATIONS.items():
            text, ids = chat_prompt(tok, tok.chat_template, messages)
            assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), conv
            assert ids == hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 return_dict=False), conv
        # llama.cpp's converter (gguf.SpecialVocab) writes it into the GGUF's tokenizer.chat_template
        kv = hf_tokenizer_metadata(folder, None)
        assert kv[gguf.Keys.Tokenizer.CHAT_TEMPLATE].value == source


def test_hf_folder_jinja_beside_config_template(tmp_path):
    """Both present: chat_template.jinja is the one transformers uses, so it is ours too."""
    from transformers import AutoTokenizer

    jinja, config = template("qwen3-0.6b.jinja"), template("phi-4.jinja")
    folder = hf_folder(tmp_path / "both", config, jinja)
    assert AutoTokenizer.from_pretrained(str(folder)).chat_template == jinja
    assert load_tokenizer(str(folder)).chat_template == jinja
    folder = hf_folder(tmp_path / "config_only", config, None)
    assert AutoTokenizer.from_pretrained(str(folder)).chat_template == config
    assert load_tokenizer(str(folder)).chat_template == config


@pytest.mark.parametrize("name", ["gpt-oss-120b.jinja", "gemma-4-31b-it.jinja", "qwen3-0.6b.jinja"])
def test_gguf_chat_template_key(name, tmp_path):
    """The long templates survive a GGUF's tokenizer.chat_template (written by gguf.GGUFWriter) and
    render through chat_prompt to transformers' text."""
    source = template(name)
    path = write_bpe_gguf(tmp_path / "t.gguf", QWEN2_SPECIALS, QWEN2_SPLIT, "qwen2", "<|endoftext|>", "<|im_end|>",
                          False, source)
    tok = load_tokenizer(str(path))
    assert tok.chat_template == source
    specials = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    for conv, messages in ALL_CONVERSATIONS.items():
        try:
            expected = theirs(source, messages, True, specials)
        except Exception:
            continue  # refusals are covered by test_family_template_matches_transformers
        assert chat_prompt(tok, source, messages)[0] == expected, conv


# ---- the jinja environment: what transformers' adds, and the budget still holds -----------------

def test_namespace_refuses_underscore_names_like_transformers():
    specials = {"bos_token": "<s>"}
    for source in ("{% set ns = namespace(_x=1) %}{{ ns._x }}", "{% set ns = namespace() %}{% set ns._y = 2 %}ok"):
        with pytest.raises(Exception, match="underscore"):
            theirs(source, CONVERSATIONS["user"], True, specials)
        with pytest.raises(LocalLLMError, match="^chat template error: .*'_[xy]'.* namespace"):
            render(source, CONVERSATIONS["user"])
    ok = "{% set ns = namespace(a=1, self=2) %}{% set ns.b = 3 %}{{ ns.a }}{{ ns.b }}{{ ns.self }}"
    assert render(ok, CONVERSATIONS["user"]) == theirs(ok, CONVERSATIONS["user"], True, specials) == "132"


def test_family_templates_within_budget():
    """The longest real templates render far inside the default budget, and a tight budget still stops
    them with one error line (the budget is not bypassed by anything these templates use)."""
    from localllm.settings import TemplateSettings

    tight = TemplateSettings(max_chars=200)
    for name in ("gpt-oss-120b.jinja", "gemma-4-31b-it.jinja"):
        with pytest.raises(LocalLLMError, match="exceeded its budget"):
            render(template(name), CONVERSATIONS["multi"], True, limits=tight)
