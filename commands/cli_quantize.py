"""The commands that write a quantized GGUF and measure its quality: quantize and perplexity (their
typer options and bodies; cli.py registers them)."""

from __future__ import annotations

import json
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from localllm.commands.cli_options import OPT_DEVICE, OPT_DTYPE, OPT_MODEL, OPT_NGL, OPT_THREADS, use_threads
from localllm.commands.cli_output import err, note, unfolded_width
from localllm.errors import LocalLLMError
from localllm.settings import DEFAULT_FILES


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
    from localllm.commands.inputs import quantize_type
    from localllm.commands.quantize_native import quantize_native
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
    report_quantized(result, json_out, dry_run)


def report_quantized(result, json_out: bool, dry_run: bool) -> None:
    """quantize's report: the plan (a table, or JSON with --json) for --dry-run, else the written file
    on stderr; and the phases' times."""
    from localllm.commands.quantize_native import phase_line
    from localllm.quantize.plan import plan_table, total_bpw, total_bytes

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
    from localllm.commands import evaluate as ev
    from localllm.commands.inputs import one_model
    from localllm.device import gpu_layers_notice
    from localllm.runner import open_model

    ev.check_chunking(ctx, chunks, batch)
    model = one_model(model, model_opt)
    use_threads(threads)
    text = ev.read_text(file)
    check_saving(save_logits, logits_format)
    base_file, base_tokenizer = saved_base(kld_base)
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
    result = evaluate_with_progress(lm, evaluated, base, batch, save_logits, logits_format)
    print_evaluation(result, json_out, save_logits)


def check_saving(save_logits: str | None, logits_format: str) -> None:
    """--save-logits FILE's folder exists and --logits-format is known, before any model loads."""
    from pathlib import Path

    if save_logits is not None and not Path(save_logits).expanduser().resolve().parent.is_dir():
        raise LocalLLMError(f"cannot write {save_logits}: no such folder")
    if logits_format not in ("localllm", "llama.cpp"):
        raise LocalLLMError(f"--logits-format must be localllm or llama.cpp, got {logits_format!r}")


def saved_base(kld_base: str | None):
    """--kld-base -> (a file of log-probs, ours or llama-perplexity's, None), or for a model (None, its
    tokenizer: a vocabulary mismatch fails before any weights load); no --kld-base: (None, None)."""
    from localllm.commands import evaluate as ev
    from localllm.commands import llama_logits as ll
    from localllm.load import load_tokenizer

    if kld_base is None:
        return None, None
    if ev.is_logits_file(kld_base):
        return ev.load_logits(kld_base), None
    if ll.is_llama_logits_file(kld_base):
        return ll.load_llama_logits(kld_base), None
    return None, load_tokenizer(kld_base)


def evaluate_with_progress(lm, evaluated, base, batch: int, save_logits: str | None, logits_format: str):
    """evaluate.evaluate_steps over the chunks, the running PPL (and KLD) in a progress bar on stderr
    -> the final Evaluation."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from localllm.commands import evaluate as ev
    from localllm.commands import llama_logits as ll

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
    return result


def print_evaluation(result, json_out: bool, save_logits: str | None) -> None:
    """perplexity's result: llama.cpp's lines (or one JSON object) on stdout; where the log-probs went
    on stderr."""
    from localllm.commands.reports import evaluation_record

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
