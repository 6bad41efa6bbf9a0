"""`localllm bench`: its typer options and body (cli.py registers it); the measuring is
commands/bench.py's, speculative decoding's commands/spec_bench.py's, --tp's commands/tp_cmd.py's."""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from localllm.commands.cli_options import (
    OPT_DEVICE, OPT_DRAFT, OPT_DRAFT_DTYPE, OPT_DRAFT_MAX, OPT_DRAFT_MIN_P, OPT_DTYPE, OPT_LOOKUP, OPT_NGL, OPT_THREADS,
    draft_settings, use_threads,
)
from localllm.commands.cli_output import note
from localllm.errors import LocalLLMError
from localllm.settings import DEFAULT_PARALLEL as TP


def flat(values: list[str]) -> list[str]:
    """Repeatable, comma-separated option values -> one list (blanks dropped)."""
    return [y.strip() for x in values for y in x.split(",") if y.strip()]


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
    tp_list: str = typer.Option(str(TP.tp), "--tp", metavar="N[,N...]", help="tensor-parallel degrees, comma-separated: each degree's rows in one table (each degree > 1 run as that many ranks through torch's launcher)"),
):
    """Prompt-processing and generation speed, with the share of the roofline measured in-process.

    With --draft or --lookup: greedy generation with speculative decoding against plain decoding, both
    measured in this run (acceptance rate, tokens per target pass, speedup, and whether the ids agree)."""
    from localllm.commands.bench import check_grid, run_bench
    from localllm.commands.spec_bench import run_spec_bench
    from localllm.device import gpu_layers_notice, pick_device
    from localllm.options import counts

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
    degrees = counts("--tp", tp_list, 1)
    if degrees != [1]:
        from localllm.commands import tp_cmd

        if spec:
            raise LocalLLMError("bench --tp measures plain decoding: leave out --draft / --lookup")
        if len(degrees) > 1 or not tp_cmd.launched():
            sys.stdout.write(tp_cmd.bench_degrees(degrees, device, output))  # each degree > 1 as its own launch
            return
        tp = tp_cmd.start(degrees[0], device)
        sys.stdout.write(run_bench(models or [], flat(synthetic), flat(wtype), prompts, gens, depths, reps, device,
                                   dtype, output, batches, tp=tp))
        return
    if spec:
        text = run_spec_bench(models or [], flat(synthetic), flat(wtype), prompts, gens, reps, device, dtype, ds, output)
    else:
        text = run_bench(models or [], flat(synthetic), flat(wtype), prompts, gens, depths, reps, device, dtype, output,
                         batches)
    sys.stdout.write(text)
