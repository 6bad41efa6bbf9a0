"""The `localllm` command line: parse options, call library functions, print. Nothing else lives here."""

from __future__ import annotations

import json
import sys
from functools import wraps
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from localllm.errors import LocalLLMError, out_of_memory
from localllm.signals import Terminated, sigterm_interrupts
from localllm.settings import DEFAULT_FILES
from localllm.settings import DEFAULT_DRAFT as D
from localllm.settings import DEFAULT_CPU as C
from localllm.settings import DEFAULT_GENERATION as G
from localllm.settings import DEFAULT_SAMPLING as S
from localllm.settings import DEFAULT_SERVE as V
from localllm.settings import DraftSettings, GenerationSettings, SamplingSettings

err = Console(stderr=True)


def print_error(message: str) -> None:
    # escape(): a message quoting user input such as "[/x]" must not be read as rich markup.
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, markup=True, soft_wrap=True)


def note(message: str) -> None:
    """One `note:` line on stderr (escaped: notes quote user text and token texts)."""
    err.print(f"[yellow]note:[/yellow] {escape(message)}", highlight=False, markup=True, soft_wrap=True)


# click's usage error class, as the click that typer runs on defines it (recent typers carry their own copy).
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


class OneLineUsageErrors(TyperGroup):
    """click's usage errors (an option value that is not a number, an unknown option or command) as one
    `error:` line naming the command's --help, not a boxed usage panel; exit status 2 as click's."""

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `localllm` alone: the help, as no_args_is_help says
                raise
            raise one_line(e) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UsageError as e:
            raise one_line(e) from None


def one_line(e: Exception) -> typer.Exit:
    ctx = getattr(e, "ctx", None)
    hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
    print_error(" ".join(e.format_message().split()).rstrip(".") + hint)
    return typer.Exit(e.exit_code)


app = typer.Typer(
    cls=OneLineUsageErrors,
    help="Run local LLMs (GGUF or safetensors) as llama.cpp's tools do; every command is listed below.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, powershell
)


def user_errors(fn):
    """Turn LocalLLMError, running out of memory (and Ctrl-C, SIGTERM) into one line on stderr and a non-zero exit: never a traceback."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with sigterm_interrupts():  # SIGTERM cleans up as Ctrl-C does (partial files removed)
                return fn(*args, **kwargs)
        except LocalLLMError as e:
            print_error(str(e))
            raise typer.Exit(1) from None
        except (KeyboardInterrupt, Terminated) as e:
            err.print("interrupted")
            raise typer.Exit(143 if isinstance(e, Terminated) else 130) from None
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            message = out_of_memory(e)  # partial output files are already gone (the writers' own cleanup)
            if message is None:
                raise
            print_error(message)
            raise typer.Exit(1) from None

    return wrapper


DEVICE_HELP = "auto (cuda, then mps, then cpu), cpu, cuda or mps"
DTYPE_HELP = ("weights' dtype: float32/bfloat16/float16 on cpu (default float16), bfloat16/float16 on cuda; "
              "on cpu a GGUF file keeps its quantized blocks and computes in float32")
# Options shared by several commands (one definition each; defaults from localllm/settings.py).
OPT_TEMP = typer.Option(S.temperature, "--temp", help="sampling temperature; 0 is greedy")
OPT_TOP_K = typer.Option(S.top_k, "--top-k", help="keep the k most likely tokens (0: off)")
OPT_TOP_P = typer.Option(S.top_p, "--top-p", help="nucleus sampling mass (1: off)")
OPT_MIN_P = typer.Option(S.min_p, "--min-p", help="drop tokens below this share of the top one (0: off)")
OPT_REPEAT_PENALTY = typer.Option(S.repeat_penalty, "--repeat-penalty", help="penalty for recent tokens (1: off)")
OPT_REPEAT_LAST_N = typer.Option(S.repeat_last_n, "--repeat-last-n", help="how many recent tokens are penalised (-1: all, 0: none)")
OPT_SEED = typer.Option(S.seed, "-s", "--seed", help="random seed, 0 to 2^64-1 (same seed, same output)")
OPT_CTX = typer.Option(None, "-c", "--ctx", "--ctx-size", help=f"context size in tokens, at least 2 (default {G.ctx}; capped at the model's)")
OPT_DEVICE = typer.Option("auto", "--device", help=DEVICE_HELP)
OPT_DTYPE = typer.Option(None, "--dtype", help=DTYPE_HELP)
OPT_THREADS = typer.Option(C.threads, "-t", "--threads", help="CPU threads (default: the physical cores; at most the logical cores)")
# Speculative decoding (localllm/speculative.py).
OPT_DRAFT = typer.Option(D.draft, "--draft", metavar="MODEL", help="speculative decoding with this draft model (path or name, same vocabulary), or self:TYPE: the model itself quantized in memory to TYPE (e.g. self:Q4_0)")
OPT_DRAFT_MAX = typer.Option(D.max_draft, "--draft-max", metavar="K", help="tokens drafted per target pass (default: adaptive, from the recent acceptance rate)")
OPT_DRAFT_MIN_P = typer.Option(D.min_p, "--draft-min-p", "--draft-p-min", metavar="P", help="stop drafting when the draft gives its token a probability below P (0: off)")
OPT_DRAFT_DTYPE = typer.Option(D.dtype, "--draft-dtype", help="the draft model's dense weights' dtype (default: the device's; quantized weights on the CPU compute in float32)")
OPT_MODEL = typer.Option(None, "-m", "--model", metavar="MODEL", help="model path or name, as llama.cpp's -m (instead of the MODEL argument)")
OPT_NGL = typer.Option(None, "-ngl", "--gpu-layers", "--n-gpu-layers", metavar="N", help="accepted for llama.cpp's habit: every layer runs on the GPU when one is used (ignored on the CPU)")
OPT_JSON = typer.Option(False, "--json", help="print one JSON object on stdout instead of text")
OPT_LOOKUP = typer.Option(D.lookup, "--lookup", metavar="N", help="speculative decoding by prompt lookup, no draft model: what followed the last N ids (N down to 1) earlier in the prompt or the text (0: off)")


def unfolded_width(table: Table) -> int:
    """The width at which rich prints `table` without folding any cell (its widest natural row)."""
    return Console(width=10**4).measure(table).maximum


def use_threads(threads: int | None) -> None:
    """-t/--threads applied; a count above the logical cores is capped, with a note."""
    from localllm.device import set_threads

    notice = set_threads(threads)
    if notice:
        note(notice)


def generation_settings(temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
                        repeat_last_n: int, seed: int | None, max_tokens: int, ctx: int | None,
                        stop: tuple[str, ...] = ()) -> tuple[SamplingSettings, GenerationSettings]:
    """The options -> settings, every value checked against its range before any model loads."""
    from localllm.generate import check_generation
    from localllm.sampling import check_settings

    sampling = SamplingSettings(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed)
    gen = GenerationSettings(max_tokens=max_tokens, ctx=G.ctx if ctx is None else ctx, stop=stop)
    check_settings(sampling)
    check_generation(gen.max_tokens, gen.ctx)
    return sampling, gen


def draft_settings(draft: str | None, draft_max: int | None, draft_min_p: float, draft_dtype: str | None,
                   lookup: int) -> DraftSettings:
    """The options -> settings, checked before any model loads."""
    from localllm.draft import check_draft

    ds = DraftSettings(draft=draft, lookup=lookup, max_draft=draft_max, min_p=draft_min_p, dtype=draft_dtype)
    check_draft(ds)
    return ds


@app.command()
@user_errors
def complete(
    args: List[str] = typer.Argument(None, metavar="[MODEL] PROMPT", help="model path or name (default: smollm2-135m), then the prompt (- reads stdin)"),
    model_opt: Optional[str] = OPT_MODEL,
    prompt_opt: Optional[str] = typer.Option(None, "-p", "--prompt", help="the prompt, as llama.cpp's -p (- reads stdin)"),
    file: Optional[str] = typer.Option(None, "-f", "--file", help="read the prompt from this UTF-8 file (one trailing newline dropped, as llama.cpp's -f; - reads stdin)"),
    max_tokens: int = typer.Option(G.max_tokens, "-n", "--max-tokens", help="most tokens to generate (-1: until the end of text or the context is full)"),
    temp: float = OPT_TEMP,
    top_k: int = OPT_TOP_K,
    top_p: float = OPT_TOP_P,
    min_p: float = OPT_MIN_P,
    repeat_penalty: float = OPT_REPEAT_PENALTY,
    repeat_last_n: int = OPT_REPEAT_LAST_N,
    seed: Optional[int] = OPT_SEED,
    ctx: Optional[int] = OPT_CTX,
    stop: List[str] = typer.Option([], "--stop", help="stop string (repeatable)"),
    device: str = OPT_DEVICE,
    dtype: Optional[str] = OPT_DTYPE,
    threads: Optional[int] = OPT_THREADS,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="print load time and speeds on stderr"),
    draft: Optional[str] = OPT_DRAFT,
    draft_max: Optional[int] = OPT_DRAFT_MAX,
    draft_min_p: float = OPT_DRAFT_MIN_P,
    draft_dtype: Optional[str] = OPT_DRAFT_DTYPE,
    lookup: int = OPT_LOOKUP,
    n_gpu_layers: Optional[int] = OPT_NGL,
    json_out: bool = typer.Option(False, "--json", help="print one JSON object at the end (text, token counts, timings, finish reason) instead of streaming"),
):
    """Stream the continuation of PROMPT to stdout (llama.cpp's `-m MODEL -p PROMPT` works too)."""
    from localllm.commands.inputs import model_and_prompt
    from localllm.device import gpu_layers_notice
    from localllm.commands.reports import completion_record
    from localllm.generate import Stats
    from localllm.runner import complete as run_complete
    from localllm.runner import context_notice, describe_stats, stop_notice, timed_drafter, timed_open
    from localllm.speculative import SpecStats
    from localllm.user_text import PromptText

    given = model_and_prompt(args, model_opt, prompt_opt, file, sys.stdin)
    model, prompt = given.model, given.prompt
    sampling, gen = generation_settings(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed, max_tokens,
                                        ctx, tuple(stop))
    ds = draft_settings(draft, draft_max, draft_min_p, draft_dtype, lookup)
    use_threads(threads)
    lm, load_s = timed_open(model, device, dtype)
    if notice := gpu_layers_notice(n_gpu_layers, lm.runtime.device):
        note(notice)
    typed = PromptText(note)  # notes after the load: a failing load stays one error line
    prompt = typed.clean(prompt, "the prompt")
    typed.check_vocabulary(lm.tokenizer, prompt)
    if notice := context_notice(lm, ctx):
        note(notice)
    drafter, draft_s = timed_drafter(lm, ds, sampling)
    load_s += draft_s
    stats = SpecStats() if drafter else Stats()
    plain_steps = D.plain_steps if verbose else 0
    pieces = run_complete(lm, prompt, gen, sampling, stats, drafter, ds, plain_steps)
    if json_out:
        text = "".join(pieces)
        print(json.dumps(completion_record(text, stats, load_s, gen.max_tokens), ensure_ascii=False))
    else:
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
    if notice := stop_notice(stats):
        note(notice)
    if verbose:
        err.print(describe_stats(stats, load_s), highlight=False, soft_wrap=True)


@app.command()
@user_errors
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


@app.command()
@user_errors
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


@app.command()
@user_errors
def chat(
    model: Optional[str] = typer.Argument(None, help="model path or name (default: smollm2-135m)"),
    model_opt: Optional[str] = OPT_MODEL,
    system: Optional[str] = typer.Option(None, "-sys", "--system", "--system-prompt", help="system message"),
    chat_template: Optional[str] = typer.Option(
        None, "--chat-template", help="built-in template name (chatml, llama2, llama3, mistral, qwen2) or a Jinja file"
    ),
    max_tokens: int = typer.Option(G.max_tokens, "-n", "--max-tokens", help="most tokens per reply (-1: until the end of text or the context is full)"),
    temp: float = OPT_TEMP,
    top_k: int = OPT_TOP_K,
    top_p: float = OPT_TOP_P,
    min_p: float = OPT_MIN_P,
    repeat_penalty: float = OPT_REPEAT_PENALTY,
    repeat_last_n: int = OPT_REPEAT_LAST_N,
    seed: Optional[int] = OPT_SEED,
    ctx: Optional[int] = OPT_CTX,
    device: str = OPT_DEVICE,
    dtype: Optional[str] = OPT_DTYPE,
    threads: Optional[int] = OPT_THREADS,
    stop: List[str] = typer.Option([], "--stop", help="stop string: a reply ends where it appears (repeatable)"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="print the load time once, and speeds after each reply, on stderr"),
    draft: Optional[str] = OPT_DRAFT,
    draft_max: Optional[int] = OPT_DRAFT_MAX,
    draft_min_p: float = OPT_DRAFT_MIN_P,
    draft_dtype: Optional[str] = OPT_DRAFT_DTYPE,
    lookup: int = OPT_LOOKUP,
    n_gpu_layers: Optional[int] = OPT_NGL,
):
    """Chat with a model using its own chat template.

    Reads one message per line when stdin is not a terminal; a line starting with / is a chat command
    there too (/help lists them), never sent to the model."""
    from localllm.chat import ChatSession
    from localllm.chat_template import resolve_template
    from localllm.commands.inputs import one_model
    from localllm.device import gpu_layers_notice
    from localllm.commands.repl import interactive, scripted
    from localllm.runner import context_notice, describe_stats, timed_drafter, timed_open
    from localllm.user_text import lenient_stdin, stdin_lines

    sampling, gen = generation_settings(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed, max_tokens, ctx,
                                        tuple(stop))
    model = one_model(model, model_opt)
    if chat_template:
        resolve_template(chat_template, None)  # a bad name fails before the slow model load
    ds = draft_settings(draft, draft_max, draft_min_p, draft_dtype, lookup)
    use_threads(threads)
    lm, load_s = timed_open(model, device, dtype)
    if notice := gpu_layers_notice(n_gpu_layers, lm.runtime.device):
        note(notice)
    if notice := context_notice(lm, ctx):
        note(notice)
    template, notice = resolve_template(chat_template, lm.tokenizer.chat_template)
    if notice:
        note(notice)
    drafter, draft_s = timed_drafter(lm, ds, sampling)
    load_s += draft_s
    session = ChatSession(
        lm, template, gen, sampling, system,
        notify=note,
        drafter=drafter, draft=ds, plain_steps=D.plain_steps if verbose else 0,
    )
    if verbose:  # the load once; each reply's speeds after it
        err.print(f"load {load_s:.2f} s", highlight=False)
    after = (lambda: err.print(describe_stats(session.last, None), highlight=False, soft_wrap=True)) if verbose else (lambda: None)
    if sys.stdin.isatty():
        lenient_stdin(sys.stdin)  # invalid UTF-8 typed in: replaced with a note (chat.py), no traceback
        interactive(session, Console(), after=after)
    else:
        scripted(session, stdin_lines(sys.stdin), after=after, console=Console(stderr=True))


@app.command()
@user_errors
def quantize(
    model: str = typer.Argument(..., metavar="IN", help="GGUF file, Hugging Face safetensors folder, or model name"),
    out: Optional[str] = typer.Argument(None, metavar="[OUT]", help="output GGUF file (not needed with --dry-run)"),
    type_arg: Optional[str] = typer.Argument(None, metavar="[TYPE]", help="the preset, as llama-quantize's third argument (or --type)"),
    type_name: Optional[str] = typer.Option(None, "--type", help="preset: F32 F16 BF16 Q8_0 Q6_K Q5_K_M Q5_K_S Q5_1 Q5_0 Q4_K_M Q4_K_S Q4_1 Q4_0 Q3_K_M Q2_K IQ4_NL IQ4_XS MXFP4_MOE (or MXFP4)"),
    target_bpw: Optional[float] = typer.Option(None, "--target-bpw", help="mixed precision: choose each tensor's type from measured sensitivity to land at X bits per weight"),
    target_size: Optional[str] = typer.Option(None, "--target-size", metavar="SIZE", help="like --target-bpw, for a file of SIZE (bytes, or with K/M/G: KiB/MiB/GiB)"),
    calib: Optional[str] = typer.Option(None, "--calib", metavar="FILE", help="calibration text for --target-* and --imatrix (default: a built-in text)"),
    imatrix: Optional[str] = typer.Option(None, "--imatrix", metavar="FILE", help="activation statistics, llama.cpp's imatrix file (GGUF or legacy .dat): reused if FILE exists, else measured on the calibration text and saved there (GGUF; .dat when FILE ends in .dat)"),
    tensor_type: List[str] = typer.Option([], "--tensor-type", metavar="REGEX=TYPE", help="type of the tensors whose name matches REGEX (repeatable; the first match wins)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan (types, sizes, predicted error) and write nothing"),
    device: str = typer.Option("auto", "--device", help="where the encoders run: auto (cuda if available, else cpu), cpu or cuda"),
    tokenizer_from: Optional[str] = typer.Option(None, "--tokenizer-from", metavar="GGUF", help="safetensors input, optional: copy the tokenizer metadata from this GGUF of the same model instead of building it from tokenizer.json / tokenizer.model"),
    allow_requantize: bool = typer.Option(False, "--allow-requantize", help="allow re-quantizing tensors already quantized (llama-quantize's flag: quality is lost against quantizing from 16 or 32 bits)"),
    threads: Optional[int] = OPT_THREADS,
    json_out: bool = typer.Option(False, "--json", help="with --dry-run: print the plan as one JSON object"),
):
    """Write a GGUF file: a preset (IN OUT TYPE) or mixed precision (--target-bpw / --target-size).

    A preset follows llama.cpp's per-tensor rules (TYPE as llama-quantize's third argument, or --type);
    mixed precision chooses each tensor's type from measured sensitivity to hit a size. An input already
    quantized is refused unless --allow-requantize (llama-quantize's rule)."""
    from localllm.quantize.plan import plan_table, total_bpw, total_bytes
    from localllm.commands.inputs import quantize_type
    from localllm.commands.quantize_native import phase_line, quantize_native
    from localllm.kernels.cpu_encode_lib import encodes_on

    out, type_name = quantize_type(out, type_arg, type_name, dry_run)
    if type_name is None and target_bpw is None and target_size is None:
        raise LocalLLMError("give TYPE (IN OUT TYPE, or --type TYPE), or --target-bpw X / --target-size SIZE for mixed precision")
    if json_out and not dry_run:
        raise LocalLLMError("--json is for --dry-run (the plan); a written file is reported on stderr")
    result = None
    plain = (type_name is not None and not dry_run and target_bpw is None and target_size is None and calib is None
             and imatrix is None and tokenizer_from is None and encodes_on(device))
    if plain:  # a preset on a GGUF: without torch where it can (commands/quantize_native.py), else None
        from localllm.cores import thread_count

        n_threads, notice = thread_count(threads)
        if notice:
            note(notice)
        result = quantize_native(model, out, type_name, tensor_type, threads=n_threads,
                                 allow_requantize=allow_requantize)
    if result is None:
        from localllm.commands.quantize_cmd import parse_size, quantize_model
        from localllm.device import set_threads

        set_threads(threads) if plain else use_threads(threads)  # -t's notice: given once
        result = quantize_model(
            model, out, type_name, tensor_type, dry_run, device, tokenizer_from=tokenizer_from, target_bpw=target_bpw,
            target_size=parse_size(target_size) if target_size else None, calib=calib, imatrix_file=imatrix,
            allow_requantize=allow_requantize,
        )
    size = f"{total_bytes(result.plan) / 2**20:.2f} MiB, {total_bpw(result.plan):.4f} bits per weight"
    if json_out:
        from localllm.commands.reports import plan_record

        print(json.dumps(plan_record(result.preset.name, result.plan, result.errors)))
        return
    if dry_run:
        # at its own width, never folded: a tensor name stays whole in a pipe or a narrow terminal
        table = plan_table(result.plan, result.errors, title=f"{result.preset.name} plan")
        Console(width=unfolded_width(table)).print(table)
        err.print(f"time: {phase_line(result.phases)}", highlight=False, soft_wrap=True)
        return
    err.print(f"wrote {escape(str(result.out))}: {result.preset.name}, {size}, {result.seconds:.1f} s", highlight=False, soft_wrap=True)
    err.print(f"time: {phase_line(result.phases)}", highlight=False, soft_wrap=True)


@app.command()
@user_errors
def perplexity(
    model: Optional[str] = typer.Argument(None, help="model path or name (default: smollm2-135m)"),
    model_opt: Optional[str] = OPT_MODEL,
    file: str = typer.Option(..., "--file", "-f", help="UTF-8 text file to evaluate"),
    ctx: int = typer.Option(512, "--ctx", "-c", "--ctx-size", help="tokens per chunk; the second half of each chunk is scored"),
    kld_base: Optional[str] = typer.Option(
        None, "--kld-base", help="KL divergence from this base: a model (path or name), a file written by --save-logits, or llama-perplexity's --kl-divergence-base file"
    ),
    save_logits: Optional[str] = typer.Option(
        None, "--save-logits", help="write this model's log-probs to FILE, to be a --kld-base later"
    ),
    logits_format: str = typer.Option(
        DEFAULT_FILES.logits_format, "--logits-format",
        help="--save-logits format: localllm, or llama.cpp (what llama-perplexity --kl-divergence-base writes and --kl-divergence reads)",
    ),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="evaluate at most N chunks (default: all the text holds)"),
    batch: int = typer.Option(1, "--batch", "-b", help="chunks per forward pass"),
    device: str = OPT_DEVICE,
    dtype: Optional[str] = OPT_DTYPE,
    threads: Optional[int] = OPT_THREADS,
    n_gpu_layers: Optional[int] = OPT_NGL,
    json_out: bool = typer.Option(False, "--json", help="print the result as one JSON object on stdout"),
):
    """Perplexity of a model over a text, and its KL divergence from a base model (--kld-base).

    As llama.cpp's perplexity computes it: ctx-token chunks, the second half of each scored. The base: a
    model, or a file of --save-logits or of llama-perplexity --kl-divergence-base."""
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from localllm.commands import evaluate as ev
    from localllm.commands.inputs import one_model
    from localllm.device import gpu_layers_notice
    from localllm.commands.reports import evaluation_record
    from localllm.commands import llama_logits as ll
    from localllm.load import load_tokenizer
    from localllm.runner import open_model

    ev.check_chunking(ctx, chunks, batch)
    model = one_model(model, model_opt)
    use_threads(threads)
    text = ev.read_text(file)
    if save_logits is not None and not Path(save_logits).expanduser().resolve().parent.is_dir():
        raise LocalLLMError(f"cannot write {save_logits}: no such folder")
    if logits_format not in ("localllm", "llama.cpp"):
        raise LocalLLMError(f"--logits-format must be localllm or llama.cpp, got {logits_format!r}")
    base_file = None
    if kld_base is not None and ev.is_logits_file(kld_base):
        base_file = ev.load_logits(kld_base)
    elif kld_base is not None and ll.is_llama_logits_file(kld_base):
        base_file = ll.load_llama_logits(kld_base)
    if kld_base is not None and base_file is None:
        base_tokenizer = load_tokenizer(kld_base)  # a vocabulary mismatch fails before any weights load
    lm = open_model(model, device, dtype)
    if notice := gpu_layers_notice(n_gpu_layers, lm.runtime.device):
        note(notice)
    evaluated = ev.chunks_for(lm, text, ctx, chunks)
    if base_file is not None:
        base_file.check(evaluated, lm.config.vocab_size)
        base = base_file
    elif kld_base is not None:
        ev.check_same_tokenizer(lm.tokenizer, base_tokenizer)
        base = open_model(kld_base, device, dtype)
    else:
        base = None
    err.print(
        f"{evaluated.text_tokens} tokens: {evaluated.n_chunks} chunk{'s' if evaluated.n_chunks > 1 else ''} of "
        f"{evaluated.ctx}, the last {evaluated.per_chunk} predictions of each scored", highlight=False,
    )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    result = None
    with Progress(*columns, console=err) as progress:
        task = progress.add_task("PPL", total=evaluated.n_chunks)
        writer = ll.LlamaLogitsWriter if logits_format == "llama.cpp" else ev.LogitsWriter
        for result in ev.evaluate_steps(lm, evaluated, base, batch, save_logits, writer):
            running = f"PPL {result.ppl:.4f}" + (f", KLD {result.kld.mean:.6f}" if result.kld else "")
            progress.update(task, completed=result.chunks_done, description=running)
    assert result is not None
    if json_out:
        print(json.dumps(evaluation_record(result)))
        if save_logits is not None:
            err.print(f"log-probs saved to {save_logits}", highlight=False, soft_wrap=True)
        return
    chunk_word = "chunk" if result.n_chunks == 1 else "chunks"
    print(f"PPL = {result.ppl:.4f} ± {result.ppl_stderr:.5f} ({result.n_chunks} {chunk_word} of {result.ctx} tokens, "
          f"{result.count} scored)")
    if result.kld is not None:
        k = result.kld
        print(f"base PPL = {k.base_ppl:.4f} ± {k.base_ppl_stderr:.5f}")
        print(f"mean KLD = {k.mean:.6f} ± {k.stderr:.6f}, 99% KLD = {k.p99:.6f}, median KLD = {k.median:.6f}, "
              f"same top = {100 * k.same_top:.2f} ± {100 * k.same_top_stderr:.2f}%")
    if save_logits is not None:
        err.print(f"log-probs saved to {save_logits}", highlight=False, soft_wrap=True)


@app.command()
@user_errors
def bench(
    models: List[str] = typer.Argument(None, metavar="[MODEL]...", help="model paths or names (none with --synthetic)"),
    model_opts: List[str] = typer.Option([], "-m", "--model", metavar="MODEL", help="a model path or name, as llama-bench's -m (repeatable)"),
    synthetic: List[str] = typer.Option([], "--synthetic", help="shape preset of models.toml for a random-weight model (repeatable, or comma-separated)"),
    wtype: List[str] = typer.Option(["bf16"], "--type", help="synthetic weight type: bf16, Q8_0, Q4_0, Q4_K_M, MXFP4_MOE (experts MXFP4, the rest Q8_0) or a GGUF type (repeatable, or comma-separated)"),
    prompt: str = typer.Option("512", "-p", "--n-prompt", help="prompt lengths, comma-separated"),
    gen: str = typer.Option("128", "-n", "--n-gen", help="generation lengths, comma-separated (0: pp only)"),
    reps: int = typer.Option(3, "-r", "--repetitions", help="repetitions of each test"),
    depth: str = typer.Option("0", "--depth", "-d", help="tokens already in the context, comma-separated"),
    batch: str = typer.Option("1", "-b", "--batch", help="prompts run at once (each its own cache), comma-separated"),
    output: str = typer.Option("md", "-o", "--output", help="md, json or csv"),
    device: str = OPT_DEVICE,
    dtype: Optional[str] = OPT_DTYPE,
    threads: Optional[int] = OPT_THREADS,
    draft: Optional[str] = OPT_DRAFT,
    draft_max: Optional[int] = OPT_DRAFT_MAX,
    draft_min_p: float = OPT_DRAFT_MIN_P,
    draft_dtype: Optional[str] = OPT_DRAFT_DTYPE,
    lookup: int = OPT_LOOKUP,
    n_gpu_layers: Optional[int] = OPT_NGL,
):
    """Prompt-processing and generation speed, with the share of the roofline measured in-process.

    With --draft or --lookup: greedy generation with speculative decoding against plain decoding, both
    measured in this run (acceptance rate, tokens per target pass, speedup, and whether the ids agree)."""
    from localllm.commands.bench import check_grid, run_bench
    from localllm.options import counts
    from localllm.commands.spec_bench import run_spec_bench

    flat = lambda xs: [y.strip() for x in xs for y in x.split(",") if y.strip()]  # noqa: E731
    from localllm.device import gpu_layers_notice, pick_device

    models = [*(models or []), *model_opts]
    if not models and not synthetic:
        raise LocalLLMError("give a MODEL or --synthetic PRESET")
    if output not in ("md", "json", "csv"):
        raise LocalLLMError(f"unknown output format {output!r} (md, json or csv)")
    prompts, gens = counts("-p/--n-prompt", prompt, 1), counts("-n/--n-gen", gen, 0)
    depths, batches = counts("-d/--depth", depth, 0), counts("-b/--batch", batch, 1)
    ds = draft_settings(draft, draft_max, draft_min_p, draft_dtype, lookup)
    spec = ds.draft is not None or ds.lookup
    check_grid(prompts, gens, depths, reps, batches, least_gen=1 if spec else 0)
    if notice := gpu_layers_notice(n_gpu_layers, pick_device(device)):
        note(notice)
    use_threads(threads)
    if spec:
        text = run_spec_bench(models or [], flat(synthetic), flat(wtype), prompts, gens, reps, device, dtype, ds, output)
    else:
        text = run_bench(models or [], flat(synthetic), flat(wtype), prompts, gens, depths, reps, device, dtype, output,
                         batches)
    sys.stdout.write(text)


@app.command()
@user_errors
def serve(
    model: Optional[str] = typer.Argument(None, help="model path or name (default: smollm2-135m)"),
    model_opt: Optional[str] = OPT_MODEL,
    host: str = typer.Option(V.host, "--host", help="address to listen on (localhost only by default; 0.0.0.0 for every interface)"),
    port: int = typer.Option(V.port, "--port", help="TCP port"),
    parallel: int = typer.Option(V.parallel, "-np", "--parallel", help="requests decoded together, each in its own slot of --ctx tokens"),
    ctx: Optional[int] = typer.Option(None, "-c", "--ctx", "--ctx-size", help=f"context of each slot in tokens (default {G.ctx}; capped at the model's)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="require 'Authorization: Bearer KEY' on every /v1 request"),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help="built-in template name (chatml, llama2, llama3, mistral, qwen2) or a Jinja file"),
    device: str = OPT_DEVICE,
    dtype: Optional[str] = OPT_DTYPE,
    threads: Optional[int] = OPT_THREADS,
    n_gpu_layers: Optional[int] = OPT_NGL,
):
    """Serve the model over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models,
    /health), many requests at once (continuous batching). Ctrl-C stops it."""
    from localllm.chat_template import resolve_template
    from localllm.commands.inputs import one_model
    from localllm.commands.serve import build_served, check_serve_options
    from localllm.device import gpu_layers_notice
    from localllm.generate import check_generation
    from localllm.runner import context_notice, timed_open
    from localllm.server.run import listen, serve_forever

    check_serve_options(parallel, port, api_key)
    check_generation(1, G.ctx if ctx is None else ctx)
    model = one_model(model, model_opt)
    if chat_template:
        resolve_template(chat_template, None)  # a bad name fails before the slow model load
    sock = listen(host, port)  # a port in use, too
    use_threads(threads)
    lm, load_s = timed_open(model, device, dtype)
    if notice := gpu_layers_notice(n_gpu_layers, lm.runtime.device):
        note(notice)
    if notice := context_notice(lm, ctx):
        note(notice)
    served = build_served(lm, model, parallel, G.ctx if ctx is None else ctx, api_key, chat_template, notify=note)
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    err.print(f"load {load_s:.2f} s; serving {escape(served.names[0])} on http://{host}:{port}/v1 "
              f"({parallel} slots of {served.engine.capacity} tokens; Ctrl-C stops)", highlight=False, soft_wrap=True)
    serve_forever(served, sock)


def show_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"localllm {version('localllm')}")
        except PackageNotFoundError:  # a source checkout that was never installed
            print("localllm (not installed)")
        raise typer.Exit()


@app.callback()
def main(
    _version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                  help="print the version and exit"),
):
    """Run local LLMs (GGUF or safetensors): complete, inspect, tokenize."""


@app.command()
@user_errors
def pull(model: str = typer.Argument(..., metavar="REPO[:QUANT]", help="owner/repo[:QUANT], e.g. bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M (no QUANT: Q4_K_M, else Q8_0, else the first GGUF), or a safetensors repo")):
    """Fetch a model from the Hugging Face Hub into its cache (HF_HOME; resumable; HF_TOKEN for gated repos).
    Afterwards REPO[:QUANT] works as MODEL in every command, offline too."""
    from localllm.commands.models import pull_model

    got = pull_model(model)
    err.print(f"pulled {escape(got.name)}: {got.kind}, {got.size / 2**20:.1f} MiB, {escape(str(got.path))}",
              highlight=False, soft_wrap=True)


@app.command("list")
@user_errors
def list_models():
    """Models ready to use: the names of models.toml and what `pull` fetched."""
    from localllm.commands.models import list_models as listed

    rows = [("NAME", "SIZE", "TYPE", "PATH")]
    for m in listed():
        size = f"{m.size / 2**20:.1f} MiB" if m.size is not None else "-"
        rows.append((m.name, size, m.kind, str(m.path) if m.path else "(not installed)"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]  # plain columns: a long path never folds
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])


@app.command("rm")
@user_errors
def remove(model: str = typer.Argument(..., metavar="REPO[:QUANT]", help="a pulled model as `list` names it: REPO:QUANT removes that quant, REPO the whole repo")):
    """Delete a pulled model from the Hugging Face cache."""
    from localllm.commands.models import remove_model

    remove_model(model)
    err.print(f"removed {escape(model)}", highlight=False, soft_wrap=True)


if __name__ == "__main__":
    app()
