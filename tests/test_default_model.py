"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same file.

Transformers reads the GGUF itself (`gguf_file=`), dequantizes with the gguf package and runs in fp32
on CPU: our fp32 logits, greedy tokens, tokenization and the CLI's output must agree with it. The
model package missing is a failure (conftest.default_model_path), never a skip.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import EXPECTED_START, GREEDY_TOKENS, PROMPT
from localllm.cache import make_cache
from localllm.runner import encode_prompt

TOL = 1e-3
LONG_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father "
    "had taught him. At the top he polished the great lens, trimmed the wick and watched the ships pass "
    "the rocks below. One stormy night in November, a small fishing boat lost its way in the fog, and "
    "the keeper knew that only his light could guide the sailors safely home."
)


@pytest.fixture(scope="module")
def hf_model(default_path):
    model = AutoModelForCausalLM.from_pretrained(str(default_path.parent), gguf_file=default_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(default_path):
    return AutoTokenizer.from_pretrained(str(default_path.parent), gguf_file=default_path.name)


def hf_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=True)["input_ids"]


@torch.inference_mode()
def test_logits_64_tokens_match_transformers(default_lm, hf_model, hf_tokenizer):
    ids = encode_prompt(default_lm, LONG_TEXT)
    assert ids == hf_ids(hf_tokenizer, LONG_TEXT)
    assert len(ids) >= 64
    tokens = torch.tensor([ids[:64]])
    ours = default_lm.model(tokens, make_cache(default_lm.config, 64), 0)
    ref = hf_model(tokens).logits.float()
    assert ours.shape == ref.shape == (1, 64, default_lm.config.vocab_size)
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.3g}"


@torch.inference_mode()
def test_greedy_matches_transformers_generate(default_lm, default_greedy, hf_model, hf_tokenizer):
    prompt, ids, _ = default_greedy
    assert prompt == hf_ids(hf_tokenizer, PROMPT)
    out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, do_sample=False,
                            num_beams=1, top_k=None, top_p=None, temperature=None, repetition_penalty=None)
    assert out[0, len(prompt):].tolist() == ids
    text = default_lm.tokenizer.decode(ids)
    assert text == hf_tokenizer.decode(ids)
    assert text.startswith(EXPECTED_START), text


def test_cli_complete_prints_the_greedy_continuation(default_lm, default_greedy):
    _, ids, _ = default_greedy
    script = Path(sys.executable).with_name("localllm")
    script = str(script) if script.is_file() else shutil.which("localllm")
    assert script, "the `localllm` command is not installed (pip install -e .)"
    cmd = [script, "complete", PROMPT, "-n", str(GREEDY_TOKENS), "--temp", "0", "--dtype", "float32",
           "--device", "cpu"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == default_lm.tokenizer.decode(ids)
    assert proc.stdout.startswith(EXPECTED_START)
