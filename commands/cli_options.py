"""The options several commands share (one definition each, their defaults from localllm/settings.py),
and the shared options turned into settings, each value checked before any model loads."""

from __future__ import annotations

import typer

from localllm.commands.cli_output import note
from localllm.settings import DEFAULT_DRAFT as D
from localllm.settings import DEFAULT_CPU as C
from localllm.settings import DEFAULT_GENERATION as G
from localllm.settings import DEFAULT_SAMPLING as S
from localllm.settings import DEFAULT_PARALLEL as TP
from localllm.settings import DraftSettings, GenerationSettings, SamplingSettings

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
OPT_TP = typer.Option(TP.tp, "--tp", metavar="N", help="tensor parallelism: split the model over N ranks (N GPUs on cuda), started through torch's launcher (torchrun)")
OPT_LOOKUP = typer.Option(D.lookup, "--lookup", metavar="N", help="speculative decoding by prompt lookup, no draft model: what followed the last N ids (N down to 1) earlier in the prompt or the text (0: off)")


def use_threads(threads: int | None) -> None:
    """-t/--threads applied; a count above the logical cores is capped, with a note."""
    from localllm.device import set_threads

    notice = set_threads(threads)
    if notice:
        note(notice)


def remote_settings(temp: float, top_k: int, top_p: float, min_p: float, seed: int | None, max_tokens: int,
                    stop: list[str]) -> tuple[SamplingSettings, GenerationSettings]:
    """The options a server's request takes -> settings, unchecked: the values' ranges are the server's to
    check (its 400 is the one error line), and sampling.py's checks would import torch."""
    sampling = SamplingSettings(temp, top_k, top_p, min_p, S.repeat_penalty, S.repeat_last_n, seed)
    return sampling, GenerationSettings(max_tokens=max_tokens, stop=tuple(stop))


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
                   lookup: int, tp=None) -> DraftSettings:
    """The options -> settings, checked before any model loads; tp: this rank's TensorParallel under
    --tp (tp_cmd.start's), where a draft that a rank's shard cannot be is refused too."""
    from localllm.draft import check_draft

    ds = DraftSettings(draft=draft, lookup=lookup, max_draft=draft_max, min_p=draft_min_p, dtype=draft_dtype)
    check_draft(ds)
    if tp is not None:
        from localllm.commands.tp_cmd import check_draft as check_rank_draft

        check_rank_draft(ds, tp)
    return ds
