"""The commands about a model's files: info, tokenize, the Hugging Face cache's pull, list and rm, and
the background servers of `complete --keep-alive`: ps and stop (their typer options and bodies; cli.py
registers them)."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer
from rich.markup import escape

from localllm.commands.cli_options import OPT_JSON, OPT_MODEL
from localllm.commands.cli_output import err, note


def info(
    model: Optional[str] = typer.Argument(None, help="model path or name (default: smollm2-135m)"),
    model_opt: Optional[str] = OPT_MODEL,
    json_out: bool = OPT_JSON,
):
    """Architecture, size, tensor types, context, tokenizer and chat template of a model."""
    from localllm.commands.info import model_info
    from localllm.commands.inputs import one_model

    facts = model_info(one_model(model, model_opt))
    if json_out:
        print(json.dumps(facts, ensure_ascii=False))
        return
    # Plain lines, not a rich table: a long path or name stays whole at any width (a pipe, a narrow terminal).
    width = max(len(key) for key in facts) + 2
    for key, value in facts.items():
        if key == "tensor_types":
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        elif key == "parameters":
            value = f"{value:,} ({value / 1e6:.1f} M)"
        elif key == "file_size":
            value = f"{value:,} bytes ({value / 2**20:.1f} MiB)"
        print(f"{key.replace('_', ' '):<{width}}{value}")



def tokenize(
    args: List[str] = typer.Argument(None, metavar="[MODEL] TEXT", help="model path or name (default: smollm2-135m; a vocab-only GGUF works too), then the text (- reads stdin)"),
    model_opt: Optional[str] = OPT_MODEL,
    prompt_opt: Optional[str] = typer.Option(None, "-p", "--prompt", help="the text, as llama-tokenize's -p"),
    file: Optional[str] = typer.Option(None, "-f", "--file", help="read the text from this UTF-8 file"),
    ids: bool = typer.Option(False, "--ids", help="print only the ids, as a JSON array on one line"),
    bos: bool = typer.Option(False, "--bos", help="add the BOS token"),
    parse_special: bool = typer.Option(False, "--special", help="parse special tokens written in the text"),
):
    """Split TEXT into tokens: each id with its text.

    Each piece is shown as text (' w', not the vocabulary's 'Ġw'), as llama-tokenize prints it."""
    from localllm.commands.inputs import model_and_prompt
    from localllm.commands.reports import readable_piece
    from localllm.load import load_tokenizer
    from localllm.user_text import PromptText

    given = model_and_prompt(args, model_opt, prompt_opt, file, sys.stdin, what="TEXT")
    tok = load_tokenizer(given.model)
    typed = PromptText(note)  # notes after the load: a failing load stays one error line
    text = typed.clean(given.prompt, "the text")
    typed.check_vocabulary(tok, text)
    out = tok.encode(text, add_bos=bos, parse_special=parse_special)
    if ids:
        print(json.dumps(out))
        return
    for t in out:
        print(f"{t:>8} -> {readable_piece(tok.piece_bytes(t))}")



def pull(model: str = typer.Argument(..., metavar="REPO[:QUANT]", help="owner/repo[:QUANT], e.g. bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M (no QUANT: Q4_K_M, else Q8_0, else the first GGUF), or a safetensors repo")):
    """Fetch a model from the Hugging Face Hub into its cache (HF_HOME; resumable; HF_TOKEN for gated repos).
    Afterwards REPO[:QUANT] works as MODEL in every command, offline too."""
    from localllm.commands.models import pull_model

    got = pull_model(model)
    err.print(f"pulled {escape(got.name)}: {got.kind}, {got.size / 2**20:.1f} MiB, {escape(str(got.path))}",
              highlight=False, soft_wrap=True)



def list_models():
    """Models ready to use: the names of models.toml and what `pull` fetched."""
    from localllm.commands.models import list_models as listed

    rows = [("NAME", "SIZE", "TYPE", "PATH")]
    for m in listed():
        size = f"{m.size / 2**20:.1f} MiB" if m.size is not None else "-"
        rows.append((m.name, size, m.kind, str(m.path) if m.path else "(not installed)"))
    print_columns(rows)


def print_columns(rows: list[tuple[str, ...]]) -> None:
    """Rows as plain columns padded to their widest cell, the last one unpadded (a long path never folds,
    as a rich table would fold it)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])



def remove(model: str = typer.Argument(..., metavar="REPO[:QUANT]", help="a pulled model as `list` names it: REPO:QUANT removes that quant, REPO the whole repo")):
    """Delete a pulled model from the Hugging Face cache."""
    from localllm.commands.models import remove_model

    remove_model(model)
    err.print(f"removed {escape(model)}", highlight=False, soft_wrap=True)


def ps():
    """The background servers `complete --keep-alive` started and that still run: each keeps its model
    loaded until its keep-alive time passes without a request (or `localllm stop`)."""
    import time

    from localllm.resident import running
    from localllm.settings import DEFAULT_CPU

    rows = [("MODEL", "PID", "ADDRESS", "KEEP-ALIVE", "UP", "LOAD OPTIONS")]
    for r in running(DEFAULT_CPU.cache_dir / "resident"):
        rows.append((r.model, str(r.pid), r.url, f"{r.idle:g} s", f"{time.time() - r.started:.0f} s",
                     " ".join(r.args) or "-"))
    print_columns(rows)


def stop(model: Optional[str] = typer.Argument(None, help="the model whose background servers stop (path or name; default: every one)")):
    """Stop the background servers of `complete --keep-alive` now (of MODEL, or all), freeing their memory."""
    from pathlib import Path

    from localllm.registry import resolve_model
    from localllm.resident import stop_running
    from localllm.settings import DEFAULT_CPU

    stopped = stop_running(DEFAULT_CPU.cache_dir / "resident", resolve_model(model) if model is not None else None)
    for r in stopped:
        err.print(f"stopped {escape(Path(r.model).name)} (pid {r.pid})", highlight=False, soft_wrap=True)
    if not stopped:
        note(f"no background server{' of ' + model if model else ''} is running")
