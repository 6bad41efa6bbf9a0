"""Render chat templates with jinja2, with the semantics of transformers' `apply_chat_template`.

The environment matches transformers' (sandboxed, trim_blocks, lstrip_blocks, loop controls, a `tojson`
that does not HTML-escape, `raise_exception`, `strftime_now`, a `namespace` without "_" attributes), so the model's own template renders to
exactly the text transformers renders. Built-in templates serve `--chat-template NAME` and models
without one. A template is code from the model file or the user: it renders within a time and size
budget (template_budget.py, settings.TemplateSettings), and every failure in it is one error line.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.ext import Extension, loopcontrols

from .errors import LocalLLMError
from .settings import DEFAULT_TEMPLATE, TemplateSettings
from .template_budget import BudgetedEnvironment, BudgetExceeded, render_budgeted, within_budget
from .user_text import read_utf8_file

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


class GuardedNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses attribute names starting with "_", as transformers' does (its
    chat-template sandbox fix): such a name raises the same SecurityError there and here."""

    def __init__(*args, **kwargs):  # jinja's signature trick: `namespace(self=...)` stays a plain key
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_key(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_namespace_key(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_key(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a chat template cannot store the attribute {name!r} on a namespace")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str, limits: TemplateSettings = DEFAULT_TEMPLATE) -> jinja2.Template:
    env = BudgetedEnvironment(limits, trim_blocks=True, lstrip_blocks=True,
                              extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = env.checked_filter(_tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = GuardedNamespace
    if not isinstance(source, str):
        raise LocalLLMError(f"chat template is a {type(source).__name__}, expected text")
    if len(source) > limits.max_source_chars:
        raise LocalLLMError(f"chat template is {len(source):,} characters long (at most {limits.max_source_chars:,})")
    try:
        with within_budget(env):  # parsing runs in Python too: the same clock
            return env.from_string(source)
    except BudgetExceeded as e:
        raise LocalLLMError(f"chat template exceeded its budget: parsing it {e}") from None
    except jinja2.TemplateSyntaxError as e:
        raise LocalLLMError(f"chat template does not parse: {one_line(e.message)} (line {e.lineno})") from None
    except Exception as e:  # e.g. RecursionError on absurdly nested source
        raise LocalLLMError(f"chat template does not compile: {one_line(e)}") from None


def one_line(message) -> str:
    """The first non-empty line of an error message, or its type (error lines are one line)."""
    lines = [line for line in str(message or "").splitlines() if line.strip()]
    return lines[0].strip() if lines else type(message).__name__


def render(
    source: str,
    messages: list[Message],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    limits: TemplateSettings = DEFAULT_TEMPLATE,
) -> str:
    """The template rendered within its time and size budget (template_budget.py)."""
    template = compile_template(source, limits)
    try:
        # tools and documents are passed as None, as transformers does: a template testing
        # `tools is not none` must not see an undefined value (which is "not none").
        return render_budgeted(
            template, template.environment, messages=messages, tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token,
        )
    except BudgetExceeded as e:
        raise LocalLLMError(f"chat template exceeded its budget: it {e}") from None
    except RecursionError:
        raise LocalLLMError("chat template error: recursion too deep") from None
    except Exception as e:  # the template is code from the model file: any failure in it is the user's to see
        raise LocalLLMError(f"chat template error: {one_line(e)}") from None


def resolve_template(override: str | None, model_template: str | None) -> tuple[str, str | None]:
    """-> (template source, notice or None). override is a built-in name or a file path."""
    if override:
        if override in BUILTIN_TEMPLATES:
            return BUILTIN_TEMPLATES[override], None
        path = Path(override).expanduser()
        if path.is_file():
            return read_utf8_file(path, "chat template"), None
        names = ", ".join(BUILTIN_TEMPLATES)
        raise LocalLLMError(f"--chat-template {override!r} is neither a built-in name ({names}) nor a file")
    if model_template:
        return model_template, None
    return BUILTIN_TEMPLATES["chatml"], "the model has no chat template: using chatml"


_MARK = "\ue000{}\ue001"  # private-use characters: no template trims them, no text holds them
_MARK_RE = re.compile("\ue000(\\d+)\ue001")


def render_with_spans(
    source: str,
    messages: list[Message],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered prompt and the character spans of the message texts in it.

    The spans come from a second render where each message's text is replaced by a numbered marker:
    the text around the markers is the template's own, and each marker stands for its message's text
    as printed (whole or trimmed). Searching for the text instead (user_spans) takes the template's
    own "<|im_end|>" for a user message that is just "<|im_end|>"; it stays the fallback for templates
    that do more with the text than print it (split it, test it).
    """
    text = render(source, messages, add_generation_prompt, bos_token, eos_token)
    contents = [m.get("content") for m in messages]
    if any(isinstance(c, str) and ("\ue000" in c or "\ue001" in c) for c in contents):
        return text, user_spans(text, messages)  # a message holding a marker character would fool the walk
    marked = [{**m, "content": _MARK.format(i)} if isinstance(c, str) and c else m
              for i, (m, c) in enumerate(zip(messages, contents))]
    try:
        spans = _walk_marks(text, render(source, marked, add_generation_prompt, bos_token, eos_token), contents)
    except LocalLLMError:
        spans = None
    return text, spans if spans is not None else user_spans(text, messages)


def _walk_marks(text: str, skeleton: str, contents: list) -> list[tuple[int, int]] | None:
    """Spans of the messages' texts in `text`, walking the marked render; None where the two part ways."""
    parts = _MARK_RE.split(skeleton)  # template text, message index, template text, ..., template text
    if not text.startswith(parts[0]):
        return None
    spans, pos = [], len(parts[0])
    for k in range(1, len(parts), 2):
        content, after, last = contents[int(parts[k])], parts[k + 1], k + 2 == len(parts)
        for printed in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
            end = pos + len(printed)
            if text.startswith(printed, pos) and (text[end:] == after if last else text.startswith(after, end)):
                break
        else:
            return None
        if end > pos:
            spans.append((pos, end))
        pos = end + len(after)
    return spans if pos == len(text) else None


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
