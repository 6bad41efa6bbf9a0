"""Bad text through the commands and the library (issue 17, the text part).

The policy (localllm/user_text.py): typed text (argv, stdin) with invalid UTF-8 is repaired with
U+FFFD and one `note:` line; a file that is not UTF-8 is one `error:` line naming the file and the
byte offset. Characters the vocabulary cannot write get one `note:` naming them. Chat templates run
within a time and size budget and fail as one line. Each case asserts the exit code, the exact count
of `error:` / `note:` lines, the words they must hold, and that no traceback appears.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from _bad_files import default_model, localllm_command, cli_env, write_tiny_model

from localllm.errors import LocalLLMError

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE_OUTPUT = "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}"


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("text")


@pytest.fixture(scope="module")
def tiny(d) -> Path:
    return write_tiny_model(d / "tiny.gguf")


def invoke(*args, input=None):
    from typer.testing import CliRunner

    from localllm.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args], input=input, env={"COLUMNS": "200"})
    # anything but the CLI's own exit would have been a traceback outside the test runner
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.stdout + result.stderr
    return result


def lines(result, kind: str) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith(kind + ":")]


def assert_one(result, kind: str, *needles: str, code: int) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    found = lines(result, kind)
    assert len(found) == 1, result.stderr
    for needle in needles:
        assert needle in found[0], found[0]
    if kind == "error":
        assert result.stderr.strip().splitlines() == found, result.stderr
    return found[0]


# ---- typed text: invalid UTF-8 is replaced, with one note ------------------------------------------

def test_tokenize_argv_with_invalid_bytes(tiny):
    """The real process: argv bytes that are not UTF-8 reach Python as surrogate escapes."""
    r = subprocess.run(localllm_command() + [b"tokenize", str(tiny).encode(), b"caf\xff \xc3(", b"--ids"],
                       capture_output=True, env=cli_env(), timeout=300, stdin=subprocess.DEVNULL)
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    assert [x for x in err.splitlines() if x] == [
        "note: the text is not valid UTF-8: invalid bytes replaced by U+FFFD"], err
    ids = json.loads(r.stdout)
    from localllm.load import load_tokenizer

    assert load_tokenizer(str(tiny)).decode(ids) == "caf\ufffd \ufffd("


def test_complete_prompt_with_invalid_bytes(tiny):
    r = invoke("complete", tiny, "the \udcff\udcfe end", "-n", "2", "--temp", "0")
    assert_one(r, "note", "the prompt is not valid UTF-8", "U+FFFD", code=0)
    assert not lines(r, "error")


def test_bad_model_with_invalid_prompt_is_one_error_line(d):
    """The note waits for the model: a file that fails to load stays exactly one line."""
    r = invoke("complete", d / "missing.gguf", "caf\udcff")
    assert_one(r, "error", "missing.gguf", code=1)
    r = invoke("tokenize", d / "missing.gguf", "caf\udcff")
    assert_one(r, "error", "missing.gguf", code=1)


def test_chat_stdin_with_invalid_utf8_and_binary(tiny):
    binary = bytes(range(0, 256, 7)).replace(b"\n", b"")
    data = b"hello \xff\xfe there\n\x00\x01\x02 binary \x80\x81\n" + binary + b"\n"
    r = invoke("chat", tiny, "-n", "2", "--temp", "0", input=data)
    assert r.exit_code == 0, r.stderr
    utf8 = [x for x in lines(r, "note") if "UTF-8" in x]
    assert utf8 == ["note: the message is not valid UTF-8: invalid bytes replaced by U+FFFD"], r.stderr
    assert not lines(r, "error")
    assert len(r.stdout.strip("\n").split("\n")) >= 1


def test_system_message_with_invalid_bytes(tiny):
    r = invoke("chat", tiny, "--system", "be \udcff brief", "-n", "1", "--temp", "0", input=b"hi\n")
    assert r.exit_code == 0 and not lines(r, "error"), r.stderr
    assert "note: the system message is not valid UTF-8: invalid bytes replaced by U+FFFD" in lines(r, "note")


# ---- characters the vocabulary cannot write ------------------------------------------------------

def test_unrepresentable_characters_are_named():
    r = invoke("tokenize", default_model(), "a\x14b\x14\x04", "--ids")
    note = assert_one(r, "note", "cannot represent", "'\\x14' (U+0014): dropped", "'\\x04' (U+0004): dropped",
                      code=0)
    assert note.count("U+0014") == 1
    # a text it can write gets no note
    r = invoke("tokenize", default_model(), "plain café 日本 😀", "--ids")
    assert r.exit_code == 0 and r.stderr == ""


def test_complete_notes_unrepresentable_characters(tiny, d):
    # the tiny vocabulary has every byte: nothing to say
    r = invoke("complete", tiny, "the \x14 end", "-n", "1", "--temp", "0")
    assert r.exit_code == 0 and not lines(r, "note"), r.stderr


# ---- files: one error naming the file and the byte offset ----------------------------------------

def test_chat_template_file_not_utf8(tiny, d):
    f = d / "latin1.jinja"
    f.write_bytes(b"{{ 'caf\xe9' }}")
    r = invoke("chat", tiny, "--chat-template", f, input=b"hi\n")
    assert_one(r, "error", str(f), "not UTF-8", "0xe9", "byte offset 7", code=1)


def test_perplexity_text_not_utf8(tiny, d):
    f = d / "latin1.txt"
    f.write_bytes(b"plain text then \xff here")
    r = invoke("perplexity", tiny, "--file", f)
    assert_one(r, "error", str(f), "not UTF-8", "0xff", "byte offset 16", code=1)


def test_hf_chat_template_jinja_not_utf8(d):
    from localllm.tokenizer import load_hf_tokenizer

    folder = d / "hf_bad_jinja"
    folder.mkdir()
    vocab = {"a": 0, "b": 1}
    (folder / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "a"}}))
    (folder / "chat_template.jinja").write_bytes(b"ok \x80")
    needle = r"chat_template.jinja is not UTF-8 text: invalid byte 0x80 at byte offset 3"
    with pytest.raises(LocalLLMError, match=needle):
        load_hf_tokenizer(folder)


def test_conversation_file_not_utf8_or_not_text(d):
    from localllm.chat import ChatSession

    session = ChatSession.__new__(ChatSession)  # load() needs no model
    f = d / "conv.json"
    f.write_bytes(b'[{"role": "user", "content": "\xff"}]')
    with pytest.raises(LocalLLMError, match=r"not UTF-8 text: invalid byte 0xff at byte offset 30"):
        session.load(f)
    f.write_text('[{"role": "user", "content": "a\\ud800"}]')
    with pytest.raises(LocalLLMError, match="message 1 is not valid text"):
        session.load(f)


# ---- chat templates: a budget, and failures as one line -------------------------------------------

def test_template_time_budget():
    from localllm.chat_template import render
    from localllm.settings import TemplateSettings

    start = time.monotonic()
    with pytest.raises(LocalLLMError, match="chat template exceeded its budget: it ran longer than 0.3 s"):
        render(NESTED_LOOPS, [{"role": "user", "content": "hi"}], limits=TemplateSettings(seconds=0.3))
    assert time.monotonic() - start < 3
    # a loop over a built list passes no hook: the alarm ends it
    listed = "{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}"
    with pytest.raises(LocalLLMError, match="ran longer than 0.3 s"):
        render(listed, [], limits=TemplateSettings(seconds=0.3))


def test_template_source_budget():
    """A template too long to parse in reasonable time is refused; parsing runs on the same clock."""
    from localllm.chat_template import render
    from localllm.settings import TemplateSettings

    with pytest.raises(LocalLLMError, match="chat template is 280,000 characters long"):
        render("{{ x }}" * 40000, [])
    with pytest.raises(LocalLLMError, match="parsing it ran longer than 0.2 s"):
        render("{{ y }}" * 20000, [], limits=TemplateSettings(seconds=0.2))


@pytest.mark.parametrize("source, needle", [
    (HUGE_OUTPUT, "wrote more than"),
    ("{{ 'x' * 10**10 }}", "built a value of 10,000,000,000 items"),
    ("{{ 'x'.ljust(10**10) }}", "asked for a size of 10,000,000,000"),
    ("{{ 'x'|center(10**10) }}", "asked for a size of 10,000,000,000"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "built a value"),
    ("{{ range(10**9)|list }}", "range of 1,000,000,000 items"),
])
def test_template_size_budget(source, needle):
    from localllm.chat_template import render

    with pytest.raises(LocalLLMError, match="chat template exceeded its budget") as e:
        render(source, [])
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("source, needle", [
    ("{{ raise_exception('Roles must alternate\\nuser/assistant') }}", "chat template error: Roles must alternate"),
    ("{{ nothing.here }}", "'nothing' is undefined"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion too deep"),
    ("{% for %}", "does not parse"),
])
def test_template_failures_are_one_line(source, needle):
    from localllm.chat_template import render

    with pytest.raises(LocalLLMError) as e:
        render(source, [{"role": "user", "content": "hi"}])
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("source, needles", [
    (HUGE_OUTPUT, ["chat template exceeded its budget", "wrote more than"]),
    ("{{ raise_exception('Only user and assistant roles\nare supported') }}",
     ["chat template error: Only user and assistant roles"]),
    ("{{ messages[5].content.upper() }}", ["chat template error:", "no element 5"]),
])
def test_template_failures_through_the_cli(tiny, d, source, needles):
    f = d / "bad.jinja"
    f.write_text(source)
    r = invoke("chat", tiny, "--chat-template", f, "-n", "1", input=b"hi\n")
    assert_one(r, "error", *needles, code=1)


def test_embedded_template_that_hangs(d):
    """A GGUF whose own chat template loops for ever: one line after the time budget (5 s)."""
    model = write_tiny_model(d / "hang.gguf", chat_template=NESTED_LOOPS)
    start = time.monotonic()
    r = invoke("chat", model, "-n", "1", input=b"hi\n")
    assert_one(r, "error", "chat template exceeded its budget: it ran longer than 5 s", code=1)
    assert time.monotonic() - start < 60


# ---- tokenizer metadata with odd content ---------------------------------------------------------

GOOD = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.token_type": [1, 1, 1]}


@pytest.mark.parametrize("key, value, needle", [
    ("tokenizer.ggml.model", 7, "tokenizer.ggml.model: int 7, expected a UTF-8 string"),
    ("tokenizer.ggml.tokens", "abc", "tokenizer.ggml.tokens: str 'abc', expected an array of texts"),
    ("tokenizer.ggml.tokens", ["a", 5, "ab"], "tokenizer.ggml.tokens[1]: int 5, expected UTF-8 text"),
    ("tokenizer.ggml.tokens", ["a", "b\udcff", "ab"], "tokenizer.ggml.tokens[1]"),
    ("tokenizer.ggml.token_type", [1, "x", 1], "tokenizer.ggml.token_type[1]: str 'x', expected ints"),
    ("tokenizer.ggml.merges", [["a", "b"]], "tokenizer.ggml.merges[0]: an array of 2, expected UTF-8 text"),
    ("tokenizer.ggml.bos_token_id", "1", "tokenizer.ggml.bos_token_id: str '1', expected a token id"),
    ("tokenizer.ggml.eos_token_id", 2.5, "tokenizer.ggml.eos_token_id: float 2.5"),
    ("tokenizer.ggml.add_bos_token", "yes", "tokenizer.ggml.add_bos_token: str 'yes', expected a boolean"),
    ("tokenizer.chat_template", [1, 2], "tokenizer.chat_template: an array of 2, expected a UTF-8 string"),
    ("tokenizer.ggml.pre", ["gpt-2"], "tokenizer.ggml.pre: an array of 1"),
])
def test_bad_tokenizer_metadata(key, value, needle):
    from localllm.tokenizer import load_gguf_tokenizer

    assert load_gguf_tokenizer(GOOD).decode(load_gguf_tokenizer(GOOD).encode("ab")) == "ab"
    with pytest.raises(LocalLLMError) as e:
        load_gguf_tokenizer({**GOOD, key: value})
    assert needle in str(e.value), str(e.value)


def test_bad_spm_scores():
    from localllm.tokenizer import load_gguf_tokenizer

    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a"],
          "tokenizer.ggml.scores": [0.0, "high"]}
    with pytest.raises(LocalLLMError, match=r"tokenizer.ggml.scores\[1\]: str 'high', expected numbers"):
        load_gguf_tokenizer(md)


def test_interactive_chat_with_invalid_bytes(tiny, tmp_path):
    """A terminal (the REPL's input()): a message with invalid UTF-8 gets the note, the session goes on."""
    import pexpect

    # strict decoding, as in a UTF-8 locale such as en_US.UTF-8 (C.UTF-8 would be lenient already)
    env = {**cli_env(), "TERM": "dumb", "PYTHONIOENCODING": "utf-8:strict"}
    child = pexpect.spawn(localllm_command()[0], ["chat", str(tiny), "-n", "2", "--temp", "0"], env=env,
                          timeout=120, dimensions=(50, 200))
    try:
        child.expect_exact(b">>> ")
        child.send(b"hi \xff\xfe there\r")
        child.expect_exact(b">>> ")
        shown = child.before
        # Ctrl-D leaves; a ^D that lands while the terminal is between rich's prompt and readline's
        # input() can be read as nothing (seen once under CI load: a 120 s wait), so it is sent again
        for _ in range(10):
            child.sendeof()
            if child.expect([pexpect.EOF, pexpect.TIMEOUT], timeout=12) == 0:
                break
        else:
            raise AssertionError("chat did not leave on Ctrl-D")
    finally:
        child.close(force=True)
    assert b"note: the message is not valid UTF-8: invalid bytes replaced by U+FFFD" in shown, shown
    assert b"Traceback" not in shown and b"error:" not in shown, shown
    assert child.exitstatus == 0


def test_budget_alarm_dropped_by_python_still_refuses():
    """The budget's SIGALRM raises in whatever code runs then; where Python drops that exception (a weakref
    callback or __del__ run by the garbage collector: seen in CI) the work goes on, and leaving the budget
    must still refuse it. Here the drop is a bare except around the interrupted sleep."""
    import time

    from localllm.settings import TemplateSettings
    from localllm.template_budget import BudgetedEnvironment, BudgetExceeded, within_budget

    env = BudgetedEnvironment(TemplateSettings(seconds=0.05))
    with pytest.raises(BudgetExceeded, match="ran longer than 0.05 s"):
        with within_budget(env):
            try:
                time.sleep(0.5)  # the alarm interrupts it
            except BudgetExceeded:
                pass  # dropped, as Python drops an exception raised in a weakref callback
    with within_budget(env):  # an ordinary quick body passes
        pass
