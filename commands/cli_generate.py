"""The commands that load a model and generate: complete, chat, serve (their typer options and bodies;
cli.py registers them). Each starts its ranks under --tp, checks every option, then loads through
`load`, the prologue they share."""

from __future__ import annotations

import sys
from typing import List, Optional

import typer
from rich.markup import escape

from localllm.commands.cli_options import (
    OPT_CTX, OPT_DEVICE, OPT_DRAFT, OPT_DRAFT_DTYPE, OPT_DRAFT_MAX, OPT_DRAFT_MIN_P, OPT_DTYPE, OPT_LOOKUP, OPT_MIN_P,
    OPT_MODEL, OPT_NGL, OPT_REPEAT_LAST_N, OPT_REPEAT_PENALTY, OPT_SEED, OPT_TEMP, OPT_THREADS, OPT_TOP_K, OPT_TOP_P,
    OPT_TP, draft_settings, generation_settings, remote_settings, use_threads,
)
from localllm.commands.cli_output import err, first_tokens_shown, note, print_completion
from localllm.settings import DEFAULT_DRAFT as D
from localllm.settings import DEFAULT_GENERATION as G
from localllm.settings import DEFAULT_SAMPLING as S
from localllm.settings import DEFAULT_SERVE as V


def load(model: str | None, device: str, dtype: str | None, tp, threads: int | None, n_gpu_layers: int | None):
    """The model of a generating command -> (LoadedModel, load seconds): -t applied, the model (this
    rank's shard under --tp) opened, a worker rank following the driver from here on (it exits), and
    -ngl's note."""
    from localllm.commands import tp_cmd
    from localllm.device import gpu_layers_notice
    from localllm.runner import timed_open

    use_threads(threads)
    lm, load_s = timed_open(model, device, dtype, tp)
    lm = tp_cmd.run_rank(lm, tp)  # a worker rank follows the driver here and exits
    if notice := gpu_layers_notice(n_gpu_layers, lm.runtime.device):
        note(notice)
    return lm, load_s


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
    tp_n: int = OPT_TP,
    server: Optional[str] = typer.Option(None, "--server", metavar="URL", help="stream from a running `localllm serve` at URL (e.g. http://127.0.0.1:8080) instead of loading the model here: no load or start-up wait; MODEL then names one of the server's models"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="with --server: the key the server was started with"),
    keep_alive: Optional[str] = typer.Option(None, "--keep-alive", metavar="DURATION", help="keep the model loaded in a background `localllm serve` until DURATION (e.g. 5m, 1h) passes without a request; later commands with this option, the same model and load options stream from it at once (no load or start-up wait)"),
):
    """Stream the continuation of PROMPT to stdout (llama.cpp's `-m MODEL -p PROMPT` works too)."""
    if api_key is not None and server is None:
        raise typer.BadParameter("--api-key goes with --server", param_hint="--api-key")
    if keep_alive is not None:
        if server is not None:
            raise typer.BadParameter("--keep-alive starts its own server: not with --server", param_hint="--keep-alive")
        load_args = serve_load_args(device, dtype, threads, ctx, n_gpu_layers, tp_n, draft, draft_max, draft_min_p,
                                    draft_dtype, lookup)
        return complete_kept_alive(keep_alive, load_args, args, model_opt, prompt_opt, file, max_tokens, temp, top_k,
                                   top_p, min_p, seed, stop, verbose, json_out,
                                   {"--repeat-penalty": repeat_penalty != S.repeat_penalty})
    if server is not None:
        return complete_from_server(server, api_key, args, model_opt, prompt_opt, file, max_tokens, temp, top_k, top_p,
                                    min_p, seed, stop, verbose, json_out, {
                                        "--device": device != "auto", "--dtype": dtype is not None,
                                        "--threads": threads is not None, "--ctx": ctx is not None,
                                        "--draft": draft is not None, "--lookup": lookup != 0,
                                        "--gpu-layers": n_gpu_layers is not None, "--tp": tp_n != 1,
                                        "--repeat-penalty": repeat_penalty != S.repeat_penalty})
    from localllm.commands import tp_cmd
    from localllm.commands.inputs import model_and_prompt
    from localllm.commands.reports import completion_record
    from localllm.generate import Stats
    from localllm.runner import complete as run_complete
    from localllm.runner import context_notice, describe_stats, stop_notice, timed_drafter
    from localllm.speculative import SpecStats
    from localllm.user_text import PromptText

    tp = tp_cmd.start(tp_n, device)  # --tp N: this command as N ranks (exits here); a rank's part
    given = model_and_prompt(args, model_opt, prompt_opt, file, sys.stdin)
    model, prompt = given.model, given.prompt
    sampling, gen = generation_settings(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed, max_tokens,
                                        ctx, tuple(stop))
    ds = draft_settings(draft, draft_max, draft_min_p, draft_dtype, lookup, tp)
    lm, load_s = load(model, device, dtype, tp, threads, n_gpu_layers)
    typed = PromptText(note)  # notes after the load: a failing load stays one error line
    prompt = typed.clean(prompt, "the prompt")
    typed.check_vocabulary(lm.tokenizer, prompt)
    if notice := context_notice(lm, ctx):
        note(notice)
    drafter, draft_s = timed_drafter(lm, ds, sampling)
    load_s += draft_s
    stats = SpecStats() if drafter else Stats()
    plain_steps = D.plain_steps if verbose else 0
    pieces = first_tokens_shown(lm.runtime, run_complete(lm, prompt, gen, sampling, stats, drafter, ds, plain_steps))
    print_completion(pieces, json_out, lambda text: completion_record(text, stats, load_s, gen.max_tokens))
    if notice := stop_notice(stats):
        note(notice)
    if verbose:
        err.print(describe_stats(stats, load_s), highlight=False, soft_wrap=True)


def complete_from_server(server, api_key, args, model_opt, prompt_opt, file, max_tokens, temp, top_k, top_p, min_p, seed, stop,
                         verbose, json_out, local_options) -> None:
    """`complete --server URL`: commands/remote.py (nothing of torch imported)."""
    from localllm.commands.inputs import model_and_prompt
    from localllm.commands.remote import complete_remote, refuse_local_options

    refuse_local_options(local_options)
    given = model_and_prompt(args, model_opt, prompt_opt, file, sys.stdin)
    sampling, gen = remote_settings(temp, top_k, top_p, min_p, seed, max_tokens, stop)
    complete_remote(server, given.model, given.prompt, sampling, gen, verbose, json_out, api_key)


def serve_load_args(device, dtype, threads, ctx, n_gpu_layers, tp_n, draft, draft_max, draft_min_p, draft_dtype,
                    lookup) -> list[str]:
    """complete's load options given (not left at their defaults) -> the same options of `localllm serve`."""
    given = [("--device", device, "auto"), ("--dtype", dtype, None), ("--threads", threads, None),
             ("--ctx", ctx, None), ("--gpu-layers", n_gpu_layers, None), ("--tp", tp_n, 1), ("--draft", draft, None),
             ("--draft-max", draft_max, None), ("--draft-min-p", draft_min_p, D.min_p),
             ("--draft-dtype", draft_dtype, None), ("--lookup", lookup, 0)]
    return [part for name, value, default in given if value != default for part in (name, str(value))]


def complete_kept_alive(keep_alive, load_args, args, model_opt, prompt_opt, file, max_tokens, temp, top_k, top_p, min_p,
                        seed, stop, verbose, json_out, local_options) -> None:
    """`complete --keep-alive DURATION`: commands/remote.py through a background server (localllm/resident.py)."""
    from localllm.commands.inputs import model_and_prompt
    from localllm.commands.remote import complete_resident, refuse_local_options

    refuse_local_options(local_options, "--keep-alive")
    given = model_and_prompt(args, model_opt, prompt_opt, file, sys.stdin)
    sampling, gen = remote_settings(temp, top_k, top_p, min_p, seed, max_tokens, stop)
    complete_resident(keep_alive, load_args, given.model, given.prompt, sampling, gen, verbose, json_out)


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
    tp_n: int = OPT_TP,
    keep_alive: Optional[str] = typer.Option(None, "--keep-alive", metavar="DURATION", help="chat with a background `localllm serve` of the model kept until DURATION (e.g. 5m) passes without a request, started if none runs: later commands with the same model and load options start at once"),
):
    """Chat with a model using its own chat template.

    Reads one message per line when stdin is not a terminal; a line starting with / is a chat command
    there too (/help lists them), never sent to the model."""
    from localllm.chat_template import resolve_template
    from localllm.commands.inputs import one_model
    from localllm.commands.repl import run_chat

    if keep_alive is not None:
        load_args = serve_load_args(device, dtype, threads, ctx, n_gpu_layers, tp_n, draft, draft_max, draft_min_p,
                                    draft_dtype, lookup) + (["--chat-template", chat_template] if chat_template else [])
        return chat_kept_alive(keep_alive, load_args, one_model(model, model_opt), system, max_tokens, temp, top_k,
                               top_p, min_p, seed, stop, verbose, {"--repeat-penalty": repeat_penalty != S.repeat_penalty})
    from localllm.chat import ChatSession
    from localllm.runner import context_notice, describe_stats, timed_drafter

    from localllm.commands import tp_cmd

    tp = tp_cmd.start(tp_n, device)  # --tp N: this command as N ranks (exits here); a rank's part
    sampling, gen = generation_settings(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed, max_tokens, ctx,
                                        tuple(stop))
    model = one_model(model, model_opt)
    if chat_template:
        resolve_template(chat_template, None)  # a bad name fails before the slow model load
    ds = draft_settings(draft, draft_max, draft_min_p, draft_dtype, lookup, tp)
    lm, load_s = load(model, device, dtype, tp, threads, n_gpu_layers)
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
    run_chat(session, after, lambda pieces: first_tokens_shown(lm.runtime, pieces))



def chat_kept_alive(keep_alive, load_args, model, system, max_tokens, temp, top_k, top_p, min_p, seed, stop, verbose,
                    local_options) -> None:
    """`chat --keep-alive DURATION`: the REPL on a background server's /v1/chat/completions
    (localllm/resident.py, localllm/conversation.RemoteChat)."""
    from localllm.commands.remote import chat_resident, refuse_local_options

    refuse_local_options(local_options, "--keep-alive")
    sampling, gen = remote_settings(temp, top_k, top_p, min_p, seed, max_tokens, stop)
    chat_resident(keep_alive, load_args, model, system, sampling, gen, verbose)


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
    tp_n: int = OPT_TP,
    draft: Optional[str] = OPT_DRAFT,
    draft_max: Optional[int] = OPT_DRAFT_MAX,
    draft_min_p: float = OPT_DRAFT_MIN_P,
    draft_dtype: Optional[str] = OPT_DRAFT_DTYPE,
    lookup: int = OPT_LOOKUP,
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's log level; debug also logs each prefill pass (prompts, ids, ms to the first ids, queue waits)"),
    warm: bool = typer.Option(True, "--warm-up/--no-warm-up", help="compile and capture every kernel and CUDA graph a request can reach before listening (--no-warm-up: listen at once; each is made at its first use, a wait for that request)"),
    idle_exit: Optional[str] = typer.Option(None, "--idle-exit", metavar="DURATION", help="exit (cleanly, status 0) once no /v1 request has come for DURATION (e.g. 300, 5m, 1h); default: never"),
):
    """Serve the model over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models,
    /health), many requests at once (continuous batching). --lookup N or --draft MODEL|self:TYPE:
    speculative decoding while few requests run (greedy replies unchanged). Ctrl-C stops it."""
    from localllm.chat_template import resolve_template
    from localllm.commands.inputs import one_model
    from localllm.commands.serve import build_served, check_serve_options, in_own_thread
    from localllm.resident import parse_duration
    from localllm.generate import check_generation
    from localllm.runner import context_notice
    from localllm.server.run import listen, serve_forever

    from localllm.commands import tp_cmd

    check_serve_options(parallel, port, api_key, log_level)
    idle_s = parse_duration(idle_exit, "--idle-exit") if idle_exit is not None else 0.0
    ds = draft_settings(draft, draft_max, draft_min_p, draft_dtype, lookup)
    check_generation(1, G.ctx if ctx is None else ctx)
    model = one_model(model, model_opt)
    if chat_template:
        resolve_template(chat_template, None)  # a bad name fails before the slow model load
    tp = tp_cmd.start(tp_n, device, stops_on_signal=True)  # --tp N: as N ranks (exits here); a rank's part
    tp_cmd.check_draft(ds, tp)
    sock = listen(host, port) if tp is None or tp.driver else None  # a port in use, too; only the driver's

    def opened():
        lm, load_s = load(model, device, dtype, tp, threads, n_gpu_layers)
        if notice := context_notice(lm, ctx):
            note(notice)
        return load_s, build_served(lm, model, parallel, G.ctx if ctx is None else ctx, api_key, chat_template,
                                    notify=note, draft=ds, warm=warm)

    # one process: loaded in a thread that ends (commands/serve.in_own_thread); a --tp worker rank stays
    # in the main thread, where it follows the driver until the end
    load_s, served = opened() if tp is not None else in_own_thread(opened)
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    err.print(f"load {load_s:.2f} s; serving {escape(served.names[0])} on http://{host}:{port}/v1 "
              f"({parallel} slots of {served.engine.capacity} tokens; Ctrl-C stops)", highlight=False, soft_wrap=True)
    serve_forever(served, sock, log_level, idle_s)
