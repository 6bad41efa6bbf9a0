"""Chat templates beyond the published ones: the built-in templates (each renders as the published
template it stands for), --chat-template resolution and its fallback, template errors as one local
error, the Jinja features real templates use, and the chat command's template options.
"""

from __future__ import annotations

import pytest

from chat_data import CONVERSATIONS, LLAMA2, LLAMA3, MISTRAL_V01, MULTI, QWEN2, USER
from localllm.chat_template import BUILTIN_TEMPLATES, render, resolve_template
from localllm.errors import LocalLLMError


def test_builtin_templates_render_sensibly():
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    expected = {
        "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                  "Hello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n",
        "qwen2": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                 "Hello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n",
        "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"
                  "<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant"
                  "<|end_header_id|>\n\n",
        "llama2": "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello. </s><s>[INST] Bye [/INST]",
        "mistral": "<s>[INST] Be brief.\n\nHi [/INST]Hello.</s>[INST] Bye [/INST]",
    }
    assert set(BUILTIN_TEMPLATES) == set(expected)
    for name, text in expected.items():
        assert render(BUILTIN_TEMPLATES[name], conv, True, "<s>", "</s>") == text, name
    # where the published template takes the same conversation, the built-in renders the same text
    for name, real in (("llama2", LLAMA2), ("llama3", LLAMA3), ("qwen2", QWEN2), ("mistral", MISTRAL_V01)):
        for messages in CONVERSATIONS.values():
            if name == "mistral" and messages[0]["role"] == "system":
                continue
            assert render(BUILTIN_TEMPLATES[name], messages, True, "<s>", "</s>") == render(
                real, messages, True, "<s>", "</s>"), name
    assert render(BUILTIN_TEMPLATES["qwen2"], USER).startswith("<|im_start|>system\nYou are a helpful assistant.")


def test_resolve_template(tmp_path):
    assert resolve_template("llama3", "model's") == (BUILTIN_TEMPLATES["llama3"], None)
    assert resolve_template(None, "model's") == ("model's", None)
    source, notice = resolve_template(None, None)
    assert source == BUILTIN_TEMPLATES["chatml"] and "no chat template" in notice and "chatml" in notice
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}")
    assert resolve_template(str(f), "model's") == (f.read_text(), None)
    with pytest.raises(LocalLLMError, match="neither a built-in name .*chatml.* nor a file"):
        resolve_template(str(tmp_path / "missing.jinja"), None)


def test_template_errors_are_local_errors():
    with pytest.raises(LocalLLMError, match="roles must alternate"):
        render(LLAMA2, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(LocalLLMError, match="chat template error: nope"):
        render("{{ raise_exception('nope') }}", USER)
    with pytest.raises(LocalLLMError, match="^chat template does not parse"):
        render("{% for m in messages %}", USER)
    with pytest.raises(LocalLLMError, match="chat template error"):
        render("{{ messages[0]['content'] + 1 }}", USER)  # a TypeError inside the template
    with pytest.raises(LocalLLMError, match="chat template error"):  # the sandbox stays shut
        render("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", USER)


def test_jinja_features_of_real_templates():
    loops = ("{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}{% if loop.index0 == 3 %}"
             "{% break %}{% endif %}{{ m.content }},{% endfor %}")
    assert render(loops, MULTI) == "Answer in one sentence.,Hello! How can I help?,"
    assert render("{{ messages | tojson }}", [{"role": "user", "content": "é <b>"}]) == (
        '[{"role": "user", "content": "é <b>"}]')  # not HTML-escaped, not ASCII-escaped
    assert render("{{ {'a': [1]} | tojson(indent=2) }}", USER) == '{\n  "a": [\n    1\n  ]\n}'
    assert render("{% generation %}{{ messages[0].content }}{% endgeneration %}", USER) == USER[0]["content"]
    assert render("{% if true %}\n  x\n{% endif %}\n", USER) == "  x\n"  # trim_blocks, lstrip_blocks
    assert len(render("{{ strftime_now('%Y-%m-%d') }}", USER)) == 10
    assert render("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                  "{{ ns.n }}", MULTI) == "6"


# ---- the chat command: --chat-template FILE, the chatml fallback ----------------------------------

def run_chat(args: list[str], text: str):
    from typer.testing import CliRunner

    import localllm.cli as cli

    return CliRunner().invoke(cli.app, ["chat", *args], input=text)


def test_chat_command_templates(tiny, tmp_path):
    model = str(tiny.gguf("llama"))  # its vocabulary has <|im_start|>/<|im_end|> but no chat template
    common = [model, "-n", "2", "--temp", "0", "--device", "cpu", "--dtype", "float32"]
    r = run_chat(common, "hello\n")
    assert r.exit_code == 0, r.output
    assert "no chat template: using chatml" in r.stderr
    raising = tmp_path / "raising.jinja"
    raising.write_text("{{ raise_exception('custom template [/INST] was read') }}")
    r = run_chat([*common, "--chat-template", str(raising)], "hello\n")
    assert r.exit_code == 1 and "error: chat template error: custom template [/INST] was read" in r.stderr
    assert "Traceback" not in r.output
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}<|im_start|>")
    r = run_chat([*common, "--chat-template", str(plain)], "hello\nagain\n")
    assert r.exit_code == 0 and "no chat template" not in r.stderr, r.output
    r = run_chat([*common, "--chat-template", "nosuch"], "hello\n")
    assert r.exit_code == 1 and "neither a built-in name" in r.stderr
