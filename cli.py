"""The `localllm` command line: parse options, call library functions, print. Nothing else lives here."""

from __future__ import annotations

import json
import sys
from functools import wraps
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from localllm.errors import LocalLLMError
from localllm.settings import DEFAULT_GENERATION as G
from localllm.settings import DEFAULT_SAMPLING as S
from localllm.settings import GenerationSettings, SamplingSettings

app = typer.Typer(
    help="Run local LLMs (GGUF or safetensors): complete, inspect, tokenize.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
err = Console(stderr=True)


def user_errors(fn):
    """Turn LocalLLMError (and Ctrl-C) into one line on stderr and a non-zero exit: never a traceback."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LocalLLMError as e:
            err.print(f"[red]error:[/red] {e}", highlight=False, markup=True, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def split_model_prompt(args: list[str]) -> tuple[str | None, str]:
    if len(args) == 1:
        return None, args[0]
    if len(args) == 2:
        return args[0], args[1]
    raise LocalLLMError("expected [MODEL] PROMPT (quote the prompt)")


DEVICE_HELP = "auto (cuda, then mps, then cpu), cpu, cuda or mps"
DTYPE_HELP = "weights' dtype: float32/bfloat16/float16 on cpu (default float16), bfloat16/float16 on cuda"


@app.command()
@user_errors
def complete(
    args: List[str] = typer.Argument(..., metavar="[MODEL] PROMPT", help="model path or name (default: smollm2-135m), then the prompt"),
    max_tokens: int = typer.Option(G.max_tokens, "-n", "--max-tokens", help="most tokens to generate"),
    temp: float = typer.Option(S.temperature, "--temp", help="sampling temperature; 0 is greedy"),
    top_k: int = typer.Option(S.top_k, "--top-k", help="keep the k most likely tokens (0: off)"),
    top_p: float = typer.Option(S.top_p, "--top-p", help="nucleus sampling mass (1: off)"),
    min_p: float = typer.Option(S.min_p, "--min-p", help="drop tokens below this share of the top one (0: off)"),
    repeat_penalty: float = typer.Option(S.repeat_penalty, "--repeat-penalty", help="penalty for recent tokens (1: off)"),
    repeat_last_n: int = typer.Option(S.repeat_last_n, "--repeat-last-n", help="how many recent tokens are penalised"),
    seed: Optional[int] = typer.Option(S.seed, "--seed", help="random seed (same seed, same output)"),
    ctx: int = typer.Option(G.ctx, "--ctx", help="context size in tokens (capped at the model's)"),
    stop: List[str] = typer.Option([], "--stop", help="stop string (repeatable)"),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=DTYPE_HELP),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="print load time and speeds on stderr"),
):
    """Stream the continuation of PROMPT to stdout."""
    from localllm.generate import Stats
    from localllm.runner import complete as run_complete
    from localllm.runner import describe_stats, timed_open

    model, prompt = split_model_prompt(args)
    sampling = SamplingSettings(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed)
    gen = GenerationSettings(max_tokens=max_tokens, ctx=ctx, stop=tuple(stop))
    lm, load_s = timed_open(model, device, dtype)
    stats = Stats()
    for piece in run_complete(lm, prompt, gen, sampling, stats):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if verbose:
        err.print(describe_stats(stats, load_s), highlight=False, soft_wrap=True)


@app.command()
@user_errors
def info(model: Optional[str] = typer.Argument(None, help="model path or name (default: smollm2-135m)")):
    """Architecture, size, tensor types, context and tokenizer of a model."""
    from localllm.info import model_info

    table = Table(show_header=False, box=None)
    for key, value in model_info(model).items():
        if key == "tensor_types":
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        elif key == "parameters":
            value = f"{value:,} ({value / 1e6:.1f} M)"
        elif key == "file_size":
            value = f"{value:,} bytes ({value / 2**20:.1f} MiB)"
        table.add_row(key.replace("_", " "), str(value))
    Console().print(table)


@app.command()
@user_errors
def tokenize(
    model: str = typer.Argument(..., help="model path or name (a vocab-only GGUF works too)"),
    text: str = typer.Argument(..., help="text to tokenize"),
    ids: bool = typer.Option(False, "--ids", help="print only the ids, as a JSON array on one line"),
    bos: bool = typer.Option(False, "--bos", help="add the BOS token"),
    parse_special: bool = typer.Option(False, "--special", help="parse special tokens written in the text"),
):
    """Split TEXT into tokens."""
    from localllm.load import load_tokenizer

    tok = load_tokenizer(model)
    out = tok.encode(text, add_bos=bos, parse_special=parse_special)
    if ids:
        print(json.dumps(out))
        return
    for t in out:
        print(f"{t:>8} {tok.token_text(t)!r}")


if __name__ == "__main__":
    app()
