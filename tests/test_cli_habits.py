"""llama.cpp's habits through the CLI (in-process, a tiny model): -m/-p/-f/-c/-s/-sys/-ngl and `-` for
stdin give what the long forms give; `quantize IN OUT TYPE` writes what `--type` writes and refuses to
re-quantize without --allow-requantize; the --json objects hold what the text output shows; tokenize
prints readable pieces; chat reads --stop and slash commands from a pipe; tables and info lines keep
names whole at any width; the help lists every command.

Oracles: the same command in its long-form spelling, the library functions the commands call, the
gguf package's reading of written files, and the tokenizer's own decode."""

from __future__ import annotations

import json
import math
import re

import gguf
import pytest
from typer.testing import CliRunner

from _bad_files import write_tiny_model

TEMPLATE = "{% for message in messages %}<|{{ message.role }}|>{{ message.content }}\n{% endfor %}<|assistant|>"
PROMPT = "the the"
GREEDY = ["-n", "6", "--temp", "0", "--device", "cpu"]


def invoke(*args, input=None, columns=200):
    from localllm.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args], input=input, env={"COLUMNS": str(columns)})
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def ok(result) -> str:
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return result.stdout


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("habits") / "tiny.gguf", chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def plain(model):
    """The positional, long-form run every alias is compared with."""
    return json.loads(ok(invoke("complete", model, PROMPT, *GREEDY, "--seed", "5", "--ctx", "64", "--json")))


# ---- complete: names, prompt sources, --json


def test_complete_json_is_the_streamed_text(model, plain):
    streamed = ok(invoke("complete", model, PROMPT, *GREEDY))
    assert streamed == plain["text"] + "\n"
    assert plain["generated_tokens"] == 6 and plain["finish_reason"] == "length"
    from localllm.load import load_tokenizer

    tok = load_tokenizer(str(model))
    assert plain["prompt_tokens"] == len(tok.encode(PROMPT, add_bos=tok.add_bos, parse_special=True))
    assert set(plain["timings"]) >= {"load_s", "prompt_s", "generate_s", "prompt_tokens_per_s",
                                     "generate_tokens_per_s"}


@pytest.mark.parametrize("spelling", [
    ["-m", "{model}", "-p", PROMPT, "-s", "5", "-c", "64"],
    ["{model}", "-p", PROMPT, "--seed", "5", "--ctx-size", "64"],
    ["-m", "{model}", PROMPT, "-s", "5", "-c", "64", "-ngl", "99"],
])
def test_complete_llama_names(model, plain, spelling):
    args = [str(model) if a == "{model}" else a for a in spelling]
    result = invoke("complete", *args, *GREEDY, "--json")
    assert json.loads(ok(result))["text"] == plain["text"]
    if "-ngl" in args:  # said once, on stderr
        assert result.stderr.count("-ngl 99 is ignored") == 1, result.stderr


def test_prompt_from_file_and_stdin(model, plain, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text(PROMPT + "\n", encoding="utf-8")  # one trailing newline dropped, as llama.cpp's -f
    for args, given in (
        (["-f", f], None), (["-f", "-"], PROMPT + "\n"), (["-p", "-"], PROMPT + "\n"), (["-"], PROMPT),
    ):
        result = invoke("complete", "-m", model, *args, *GREEDY, "-s", "5", "-c", "64", "--json", input=given)
        assert json.loads(ok(result))["text"] == plain["text"], args


def test_prompt_given_twice_is_one_error(model, tmp_path):
    from cli_helpers import assert_one_error

    assert_one_error(invoke("complete", model, "-p", "a", "-f", tmp_path / "x.txt"), "give the prompt once")
    assert_one_error(invoke("complete", "-m", model, "x", "-p", "a"), "unexpected argument 'x'")
    assert_one_error(invoke("info", model, "-m", model), "two models given")


def test_stdin_not_utf8_is_one_error(model):
    from cli_helpers import assert_one_error

    assert_one_error(invoke("complete", model, "-", input=b"caf\xff"), "stdin is not UTF-8 text")


def test_complete_context_full(model):
    result = invoke("complete", model, PROMPT, "-n", "50", "--temp", "0", "-c", "6", "--json")
    out = json.loads(ok(result))
    assert out["finish_reason"] == "context" and out["prompt_tokens"] + out["generated_tokens"] == 6
    assert "the context (6 tokens) is full" in result.stderr


def test_perplexity_json_is_the_text_result(model, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the the theory of the thesis " * 12, encoding="utf-8")
    shown = ok(invoke("perplexity", "-m", model, "-f", text, "--ctx-size", "16", "--chunks", "2"))
    record = json.loads(ok(invoke("perplexity", model, "-f", text, "-c", "16", "--chunks", "2", "--json")))
    m = re.match(r"PPL = ([\d.]+) ± ([\d.]+) \((\d+) chunks of (\d+) tokens, (\d+) scored\)", shown)
    assert m, shown
    assert f"{record['ppl']:.4f}" == m.group(1) and f"{record['ppl_stderr']:.5f}" == m.group(2)
    assert (record["chunks"], record["ctx"], record["scored"]) == (2, 16, int(m.group(5)))
    assert record["ppl"] == pytest.approx(math.exp(record["mean_nll"]))


# ---- tokenize


def test_tokenize_readable_pieces(model):
    from localllm.load import load_tokenizer

    text = "the ö the"
    lines = ok(invoke("tokenize", "-m", model, "-p", text)).splitlines()
    tok = load_tokenizer(str(model))
    ids = tok.encode(text, add_bos=False)
    assert [int(line.split(" -> ")[0]) for line in lines] == ids
    shown = [line.split(" -> ", 1)[1] for line in lines]
    assert "' the'" in shown and not any("Ġ" in s for s in shown)
    # ö is two byte tokens in this vocabulary: half a character each, shown as bytes
    assert "b'\\xc3'" in shown and "b'\\xb6'" in shown
    assert b"".join(tok.piece_bytes(i) for i in ids).decode() == text


def test_tokenize_default_model_readable():
    """No model given: the default model, as every other command (llama.cpp's ' w' and 'ör')."""
    lines = ok(invoke("tokenize", "Hello wörld")).splitlines()
    shown = [line.split(" -> ", 1)[1] for line in lines]
    assert shown[:3] == ["'Hello'", "' w'", "'ör'"], shown


# ---- info


def test_info_json_and_template(model, tmp_path):
    from localllm.chat_template import BUILTIN_TEMPLATES
    from localllm.commands.info import model_info

    facts = json.loads(ok(invoke("info", "-m", model, "--json")))
    assert facts == json.loads(json.dumps(model_info(str(model))))
    first = TEMPLATE.splitlines()[0]  # 61 characters: cut at 60
    assert len(first) > 60 and facts["chat_template"] == "from the file: " + first[:57] + "..."
    chatml = write_tiny_model(tmp_path / "chatml.gguf", chat_template=BUILTIN_TEMPLATES["chatml"])
    assert json.loads(ok(invoke("info", chatml, "--json")))["chat_template"] == "chatml"
    bare = write_tiny_model(tmp_path / "bare.gguf")
    assert json.loads(ok(invoke("info", bare, "--json")))["chat_template"] == "none (chat uses chatml)"


def test_info_keeps_the_path_whole_when_narrow(tmp_path):
    deep = tmp_path / ("a-rather-long-folder-name-" * 3)
    deep.mkdir()
    path = write_tiny_model(deep / "tiny-model-with-a-long-name.gguf")
    lines = ok(invoke("info", path, columns=40)).splitlines()
    assert any(line.startswith("path") and line.endswith(str(path)) for line in lines), lines


# ---- quantize


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("quant") / "tiny-f32.gguf")


def test_quantize_positional_type_and_threads(f32_model, tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    ok(invoke("quantize", f32_model, a, "Q8_0", "-t", "1"))
    ok(invoke("quantize", f32_model, b, "--type", "Q8_0"))
    assert a.read_bytes() == b.read_bytes()
    types = {t.tensor_type for t in gguf.GGUFReader(a).tensors}
    assert gguf.GGMLQuantizationType.Q8_0 in types
    from cli_helpers import assert_one_error

    assert_one_error(invoke("quantize", f32_model, a, "Q8_0", "--type", "Q4_0"), "two types given")


def test_quantize_refuses_requantize(f32_model, tmp_path):
    from cli_helpers import assert_one_error

    q8 = tmp_path / "q8.gguf"
    ok(invoke("quantize", f32_model, q8, "Q8_0"))
    out = tmp_path / "q4.gguf"
    assert_one_error(invoke("quantize", q8, out, "Q4_0"), "--allow-requantize")
    assert not out.exists()
    ok(invoke("quantize", q8, out, "Q4_0", "--allow-requantize"))
    assert gguf.GGMLQuantizationType.Q4_0 in {t.tensor_type for t in gguf.GGUFReader(out).tensors}
    # the same type again: every tensor is copied, nothing is re-encoded
    ok(invoke("quantize", q8, tmp_path / "again.gguf", "Q8_0"))


def test_mixed_plan_refuses_requantize_before_calibrating(f32_model, tmp_path, monkeypatch):
    """--target-bpw on a quantized input: refused up front, not after minutes of calibration."""
    from cli_helpers import assert_one_error

    from localllm.commands import quantize_cmd

    q8 = tmp_path / "q8.gguf"
    ok(invoke("quantize", f32_model, q8, "Q8_0"))
    monkeypatch.setattr(quantize_cmd, "calib_chunks", lambda *a, **k: pytest.fail("calibration started"))
    out = tmp_path / "mixed.gguf"
    assert_one_error(invoke("quantize", q8, out, "--target-bpw", "5"), "--allow-requantize")
    assert not out.exists()


def test_quantize_metadata_from_the_cache(model, monkeypatch):
    """quantize copies the metadata from open_gguf's parse and cache (a large vocabulary is not parsed a
    second time, 7 s of a Q8_0 run of qwen2): every key, type and value as the gguf package reads them.
    The tiny model's section is cached here as a large one is (the size threshold lowered)."""
    from dataclasses import replace

    import localllm.gguf_file as gf
    from localllm.commands.quantize_cmd import _meta_value, read_gguf_metadata

    reader = gguf.GGUFReader(model, "r")
    expected = {k: _meta_value(k, f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    monkeypatch.setattr(gf, "DEFAULT_CPU", replace(gf.DEFAULT_CPU, header_cache_min_bytes=0))
    gf.open_gguf(model)  # parsed once, and cached
    monkeypatch.setattr(gf, "read_kv_section", lambda *a: pytest.fail("the cached section was parsed again"))
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("gguf's reader parsed the metadata again"))
    got = read_gguf_metadata(model, keep=lambda key: True)
    assert list(got) == list(expected) and got == expected
    assert {v.type for v in got.values()} >= {gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY}


def test_quantize_dry_run_json_matches_table(f32_model):
    from localllm.commands.quantize_cmd import plan_model
    from localllm.quantize.plan import total_bytes

    record = json.loads(ok(invoke("quantize", f32_model, "Q4_0", "--dry-run", "--json")))
    _, plan = plan_model(str(f32_model), "Q4_0")
    assert [(t["name"], t["type"], t["bytes"]) for t in record["tensors"]] == \
        [(r.name, r.target.name, r.nbytes) for r in plan]
    assert record["total_bytes"] == total_bytes(plan) and record["preset"] == "Q4_0"
    assert "rel_rmse" in record and all("rel_rmse" in t for t in record["tensors"])


def test_quantize_dry_run_table_never_folds_names(f32_model):
    table = ok(invoke("quantize", f32_model, "--type", "Q4_0", "--dry-run", columns=30))
    names = [t.name for t in gguf.GGUFReader(f32_model).tensors]
    for name in names:
        assert re.search(rf"(^|\s){re.escape(name)}\s", table), f"{name} folded:\n{table}"


# ---- chat


def test_chat_pipe_slash_commands_stop_and_load_once(model):
    base = ok(invoke("chat", model, *GREEDY, input="hello\n"))
    reply = base.splitlines()[0]
    assert len(reply) >= 4, base
    stop = reply[2:4]
    cut = reply[: reply.index(stop)]
    result = invoke("chat", "-m", model, *GREEDY, "--stop", stop, "-v", input="/help\nhello\n/exit\nhello again\n")
    assert ok(result).splitlines() == [cut]  # /help handled (never sent), one reply, /exit ends the input
    assert "/clear" in result.stderr  # the help text, on stderr
    lines = result.stderr.splitlines()
    assert sum(line.startswith("load ") for line in lines) == 1, result.stderr  # the load time once
    assert sum(line.startswith("prompt ") for line in lines) == 1, result.stderr  # one reply's speeds


def test_chat_system_prompt_spellings(model):
    a = ok(invoke("chat", model, *GREEDY, "--system", "be brief", input="hello\n"))
    b = ok(invoke("chat", model, *GREEDY, "-sys", "be brief", input="hello\n"))
    c = ok(invoke("chat", model, *GREEDY, "--system-prompt", "be brief", input="hello\n"))
    assert a == b == c


# ---- help, completion


def test_help_lists_every_command():
    from localllm.cli import app

    text = ok(invoke("--help", columns=200))
    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    assert len(names) >= 7
    for name in names:
        assert re.search(rf"│ {name}\s", text), f"{name} missing from --help"
    assert "--install-completion" in text


def test_completion_script():
    """The bash completion script, asked for by name as `--install-completion` installs it (click's
    _LOCALLLM_COMPLETE=source_bash): `--show-completion` finds the shell among the process's ancestors,
    which a test run in the background (no shell above it) does not have."""
    from localllm.cli import app

    result = CliRunner().invoke(app, [], env={"_LOCALLLM_COMPLETE": "source_bash"}, prog_name="localllm")
    text = ok(result)
    assert "_localllm_completion" in text and "_LOCALLLM_COMPLETE" in text and "complete " in text, text


# ---- bench's size and parameters


def test_bench_counts_a_tied_quantized_embedding(f32_model, tmp_path):
    """bench's size and params (footprint.model_stats of the loaded model) as the file's tensors add up
    (the gguf package's reading), the tied, quantized token embedding included: it is held as blocks,
    not as a torch parameter."""
    from localllm.footprint import model_stats
    from localllm.runner import open_model

    q8 = tmp_path / "q8.gguf"
    ok(invoke("quantize", f32_model, q8, "Q8_0", "--tensor-type", "token_embd=Q8_0"))
    tensors = gguf.GGUFReader(q8).tensors
    assert any(t.name == "token_embd.weight" and t.tensor_type == gguf.GGMLQuantizationType.Q8_0 for t in tensors)
    assert not any(t.name == "output.weight" for t in tensors)  # tied
    held, params = model_stats(open_model(str(q8), "cpu", None).model)
    assert params == sum(int(t.n_elements) for t in tensors)
    # bytes held: the file's, plus the CPU tiles' padding of the 260-row embedding to 8-row tiles (4 rows
    # of 68 bytes); without the embedding (17,680 bytes of Q8_0) it was 12% short
    file_bytes = sum(int(t.n_bytes) for t in tensors)
    assert held == pytest.approx(file_bytes, rel=0.01) and held >= file_bytes


@pytest.mark.parametrize("command, names", [
    ("complete", ["-m", "-p", "-f", "-c", "--ctx-size", "-s", "-ngl", "--draft-p-min", "-t", "--json"]),
    ("chat", ["-m", "-sys", "--system-prompt", "--stop", "-c", "-s", "-ngl", "-t"]),
    ("perplexity", ["-m", "-f", "--ctx-size", "-ngl", "-t", "--json"]),
    ("bench", ["-m", "-ngl", "-t"]),
    ("quantize", ["--allow-requantize", "-t", "--type", "--json"]),
    ("info", ["-m", "--json"]),
    ("tokenize", ["-m", "-p", "-f"]),
])
def test_help_shows_llama_cpp_names(command, names):
    text = ok(invoke(command, "--help", columns=200))
    for name in names:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{name} missing from {command} --help"


def test_gpu_layers_notice_words():
    from localllm.device import gpu_layers_notice

    assert gpu_layers_notice(None, "cuda") is None
    assert "every layer runs on the GPU" in gpu_layers_notice(99, "cuda")
    assert "ignored" in gpu_layers_notice(0, "cpu")
