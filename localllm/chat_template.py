"""Render chat templates with jinja2, with the semantics of transformers' `apply_chat_template`.

The environment matches transformers' (sandboxed, trim_blocks, lstrip_blocks, loop controls, a `tojson`
that does not HTML-escape, `raise_exception`, `strftime_now`), so the model's own template renders to
exactly the text transformers renders. Built-in templates serve `--chat-template NAME` and models
without one.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import LocalLLMError

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "qwen2": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
        "{% set messages = messages[1:] %}{% else %}{% set system = false %}{% endif %}"
        "{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if loop.index0 == 0 and system %}{% set content = '<<SYS>>\n' + system + '\n<</SYS>>\n\n' + message['content'] %}"
        "{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content | trim + ' [/INST]' }}"
        "{% else %}{{ ' ' + content | trim + ' ' + eos_token }}{% endif %}{% endfor %}"
    ),
    "mistral": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
        "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
        "{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{% if loop.first %}{{ '[INST] ' + system + message['content'] + ' [/INST]' }}"
        "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
        "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
    ),
}


class GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): render the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise LocalLLMError(f"chat template does not parse: {e.message} (line {e.lineno})") from None


def render(
    source: str,
    messages: list[Message],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    try:
        return compile_template(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token
        )
    except jinja2.TemplateError as e:
        raise LocalLLMError(f"chat template error: {e}") from None


def resolve_template(override: str | None, model_template: str | None) -> tuple[str, str | None]:
    """-> (template source, notice or None). override is a built-in name or a file path."""
    if override:
        if override in BUILTIN_TEMPLATES:
            return BUILTIN_TEMPLATES[override], None
        path = Path(override).expanduser()
        if path.is_file():
            return path.read_text(), None
        names = ", ".join(BUILTIN_TEMPLATES)
        raise LocalLLMError(f"--chat-template {override!r} is neither a built-in name ({names}) nor a file")
    if model_template:
        return model_template, None
    return BUILTIN_TEMPLATES["chatml"], "the model has no chat template: using chatml"


def user_spans(rendered: str, messages: list[Message]) -> list[tuple[int, int]]:
    """Character spans of user-written text in the rendered prompt, found in order.

    Special tokens inside these spans must be tokenized as plain text (a user typing `<|im_end|>` must
    not end the turn). Templates may trim content, so the stripped text is searched as a fallback.
    """
    spans, pos = [], 0
    for m in messages:
        content = m.get("content") or ""
        for needle in (content, content.strip()):
            i = rendered.find(needle, pos) if needle else -1
            if i >= 0:
                spans.append((i, i + len(needle)))
                pos = i + len(needle)
                break
    return spans
