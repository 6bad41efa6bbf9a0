"""The command line's llama.cpp habits, resolved to plain values before any model loads: where the model
and the prompt come from (-m/--model, -p/--prompt, -f/--file, positional arguments, `-` for stdin),
and quantize's llama-quantize-style positional TYPE (what -ngl means: device.gpu_layers_notice).

llama.cpp's references: common/arg.cpp (-m, -p, -f: the file's text with one trailing newline dropped,
-ngl) and tools/quantize/quantize.cpp (`llama-quantize IN [OUT] TYPE`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TextIO

from localllm.errors import LocalLLMError


@dataclass(frozen=True)
class ModelPrompt:
    model: str | None  # path or name; None: the default model
    prompt: str


def model_and_prompt(args: Sequence[str], model: str | None, prompt: str | None, file: str | None,
                     stdin: TextIO, what: str = "PROMPT") -> ModelPrompt:
    """`complete [MODEL] PROMPT`, `complete -m MODEL PROMPT`, `complete [MODEL] -p PROMPT`,
    `complete [MODEL] -f FILE`; a prompt (or FILE) of `-` is read from stdin."""
    args = list(args or [])
    if prompt is not None and file is not None:
        raise LocalLLMError(f"give the {what.lower()} once: -p/--prompt or -f/--file, not both")
    if prompt is not None or file is not None:  # the prompt is an option: a positional argument is the model
        if len(args) > 1 or (args and model is not None):
            raise LocalLLMError(f"unexpected argument {args[-1]!r}: the {what.lower()} is already given by "
                                f"{'-p/--prompt' if prompt is not None else '-f/--file'}")
        model = model if model is not None else (args[0] if args else None)
        text = read_prompt_file(file, stdin) if file is not None else prompt
    elif model is not None:
        if len(args) != 1:
            raise LocalLLMError(f"expected {what} after -m MODEL (quote it), or -p {what} / -f FILE")
        text = args[0]
    elif len(args) == 1:
        text = args[0]
    elif len(args) == 2:
        model, text = args
    else:
        raise LocalLLMError(f"expected [MODEL] {what} (quote the {what.lower()}), or -p {what} / -f FILE")
    if text == "-" and file is None:  # as -f -: stdin's text, one trailing newline dropped
        text = read_prompt_file("-", stdin)
    return ModelPrompt(model, text)


def one_model(positional: str | None, option: str | None) -> str | None:
    """The MODEL argument or -m/--model (llama.cpp's spelling); both at once is an error."""
    if positional is not None and option is not None:
        raise LocalLLMError(f"two models given: {positional} (argument) and {option} (-m/--model); give one")
    return option if option is not None else positional


def read_prompt_file(file: str, stdin: TextIO) -> str:
    """-f FILE's text (UTF-8) with one trailing newline dropped, as llama.cpp's -f does; `-`: stdin."""
    from localllm.user_text import decode_utf8, read_utf8_file

    if file == "-":  # the bytes, so that input that is not UTF-8 is one error line, not a traceback
        buffer = getattr(stdin, "buffer", None)
        text = decode_utf8(buffer.read(), "stdin") if buffer is not None else stdin.read()
    else:
        text = read_utf8_file(file, "prompt file")
    return text[:-1] if text.endswith("\n") else text


def quantize_type(out: str | None, positional: str | None, option: str | None,
                  dry_run: bool) -> tuple[str | None, str | None]:
    """(OUT, TYPE) from `quantize IN OUT TYPE` (llama-quantize's order), `quantize IN OUT --type TYPE`
    and, with --dry-run (no OUT), `quantize IN TYPE --dry-run`."""
    from localllm.quantize.presets import find_preset

    if dry_run and positional is None and out is not None and find_preset(out) is not None:
        out, positional = None, out  # `IN TYPE --dry-run`: the only positional after IN is the type
    if positional is not None and option is not None and positional.upper() != option.upper():
        raise LocalLLMError(f"two types given: {positional} (argument) and {option} (--type); give one")
    return out, positional if positional is not None else option
