"""Generation with the default model (greedy, so every run is reproducible): the token limit, stop ids,
the context limit, stop strings end to end, and stream_text's handling of stop strings and UTF-8
characters that are split across tokens."""

from __future__ import annotations

import pytest

from _bad_files import default_model
from localllm.cache import make_cache
from localllm.errors import LocalLLMError
from localllm.generate import Stats, generate, stream_text
from localllm.runner import complete, encode_prompt, open_model
from localllm.sampling import Sampler
from localllm.settings import GenerationSettings, SamplingSettings

GREEDY = SamplingSettings(temperature=0.0)
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def lm():
    default_model()  # fails with a clear message when the model is not installed
    return open_model(None, "cpu", None)


@pytest.fixture(scope="module")
def tok(lm):
    return lm.tokenizer


def run(lm, max_tokens: int, stop_ids=(), capacity: int | None = None, stats: Stats | None = None):
    """Greedy ids after PROMPT and the cache they used."""
    ids = encode_prompt(lm, PROMPT)
    w = lm.model.token_embd.weight
    cache = make_cache(lm.config, capacity or len(ids) + max_tokens, dtype=w.dtype, device=w.device)
    out = list(generate(lm.runtime, cache, ids, Sampler(GREEDY), max_tokens, stop_ids, stats))
    return out, cache


@pytest.fixture(scope="module")
def reference(lm) -> list[int]:
    """12 greedy ids after PROMPT, no stop ids."""
    out, _ = run(lm, 12)
    assert len(out) == 12
    return out


def counted(ids, pulled: list[int]):
    """Yield ids, noting each one the consumer pulls (to see where it stopped pulling)."""
    for t in ids:
        pulled.append(t)
        yield t


# ---- generate()


def test_token_limit(lm, reference):
    stats = Stats()
    out, _ = run(lm, 5, stats=stats)
    assert out == reference[:5]
    assert stats.generated_tokens == 5


def test_stop_id_ends_generation_and_is_not_yielded(lm, reference):
    k = next(i for i in range(2, len(reference)) if reference[i] not in reference[:i])
    out, _ = run(lm, 12, stop_ids={reference[k]})
    assert out == reference[:k]
    assert reference[k] not in out


def test_stop_id_first(lm, reference):
    out, _ = run(lm, 12, stop_ids={reference[0], 999_999})
    assert out == []


def test_model_stop_ids_end_a_chat_reply(lm):
    # The tokenizer's own end-of-turn id (<|im_end|>) ends a reply before the token limit.
    stats = Stats()
    prompt = "<|im_start|>user\nWhat is 2+2? Answer with a number only.<|im_end|>\n<|im_start|>assistant\n"
    text = "".join(complete(lm, prompt, GenerationSettings(max_tokens=24), GREEDY, stats))
    assert "4" in text and 0 < stats.generated_tokens < 24, (text, stats)
    assert "<|im_end|>" not in text and "im_end" not in text


def test_context_limit_stops_without_error(lm, reference):
    n_prompt = len(encode_prompt(lm, PROMPT))
    out, cache = run(lm, 100, capacity=n_prompt + 4)
    assert out == reference[:4]  # the cache's end, not the token limit, stopped it
    assert cache.length <= cache.capacity


def test_context_limit_through_runner(lm, reference, tok):
    n_prompt = len(encode_prompt(lm, PROMPT))
    stats = Stats()
    text = "".join(complete(lm, PROMPT, GenerationSettings(max_tokens=100, ctx=n_prompt + 3), GREEDY, stats))
    assert stats.generated_tokens == 3
    assert text == tok.decode(reference[:3])


def test_prompt_that_fills_the_context_is_an_error(lm):
    n_prompt = len(encode_prompt(lm, PROMPT))
    with pytest.raises(LocalLLMError, match="context holds"):
        run(lm, 5, capacity=n_prompt)


# ---- stop strings, end to end


@pytest.fixture(scope="module")
def full_text(lm) -> str:
    """16 greedy tokens after PROMPT as text, without stop strings."""
    stats = Stats()
    text = "".join(complete(lm, PROMPT, GenerationSettings(max_tokens=16), GREEDY, stats))
    assert stats.generated_tokens == 16
    return text


def test_stop_string_end_to_end(lm, full_text):
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 4]
    cut = full_text.find(stop)
    assert stop.strip() and cut >= 0

    stats = Stats()
    pieces = list(complete(lm, PROMPT, GenerationSettings(max_tokens=16, stop=(stop,)), GREEDY, stats))
    text = "".join(pieces)
    assert text == full_text[:cut]  # everything before the stop string, exactly
    assert stop not in text
    assert stats.generated_tokens < 16  # and generation stopped there


def test_earliest_stop_string_wins(lm, full_text):
    late, early = full_text[-5:], full_text[3:7]
    text = "".join(complete(lm, PROMPT, GenerationSettings(max_tokens=16, stop=(late, early)), GREEDY))
    assert text == full_text[: min(full_text.find(late), full_text.find(early))]


# ---- stream_text

SENTENCE = "The quick brown fox jumps over the lazy dog."


def test_stop_string_split_across_tokens(tok):
    ids = tok.encode(SENTENCE, add_bos=False)
    stop = "fox jum"
    # Precondition: no single token holds the stop string.
    assert not any(stop in tok.decode([t]) for t in ids)
    pulled: list[int] = []
    pieces = list(stream_text(tok, counted(ids, pulled), (stop,)))
    assert "".join(pieces) == SENTENCE[: SENTENCE.find(stop)]
    assert all(stop not in p for p in pieces)
    # Pulling stopped at the token that completed the stop string.
    need = next(m for m in range(1, len(ids) + 1) if stop in tok.decode(ids[:m]))
    assert len(pulled) == need < len(ids)


def test_held_back_prefix_is_released(tok):
    # "dog" starts the stop string "dog!" and the text ends there: the held text must still come out.
    ids = tok.encode(SENTENCE, add_bos=False)
    for stops in [("dog!",), ("lazy cat", "dog!"), ("the lazy dogs",), ("",)]:
        pieces = list(stream_text(tok, iter(ids), stops))
        assert "".join(pieces) == SENTENCE, stops


def test_stream_without_stop_is_incremental(tok):
    ids = tok.encode(SENTENCE, add_bos=False)
    pulled: list[int] = []
    stream = stream_text(tok, counted(ids, pulled))
    first = next(stream)
    assert SENTENCE.startswith(first) and len(pulled) < len(ids)  # text before all ids were read
    assert first + "".join(stream) == SENTENCE


MULTI = "Llamas 🦙 and 日本語, ok"


def test_utf8_split_across_tokens(tok):
    ids = tok.encode(MULTI, add_bos=False)
    # Precondition: some token carries only part of a character.
    partial = [t for t in ids if not _is_utf8(tok.token_bytes(t))]
    assert partial, "the text no longer splits a character across tokens"
    pieces = list(stream_text(tok, iter(ids)))
    assert "".join(pieces) == MULTI
    assert all("\ufffd" not in p for p in pieces)
    assert len(pieces) > 1


def test_utf8_stop_string_split_across_tokens(tok):
    ids = tok.encode(MULTI, add_bos=False)
    for stop in ("日本", "🦙", "語,"):
        text = "".join(stream_text(tok, iter(ids), (stop,)))
        assert text == MULTI[: MULTI.find(stop)], stop


def test_stream_text_matches_decode_piece_by_piece(tok):
    # Decoding one id at a time never splits a character: every prefix of pieces is valid text.
    text = "Grüße, Ελλάδα — 🦙🦙 naïve café ✓"
    ids = tok.encode(text, add_bos=False)
    pieces = list(stream_text(tok, iter(ids), ("NEVER",)))
    assert "".join(pieces) == text == tok.decode(ids)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
