"""`complete --server URL`: the completion streamed from a running `localllm serve` (localllm/client.py)
instead of a model this process loads: no torch import, no load, no kernel compilation (the first
token in a fraction of a second where a loading run waits seconds). The options that only a local
model has (device, dtype, threads, draft, lookup, context, tensor parallelism, repeat penalty) are
refused with --server: the server was started with its own. `complete --keep-alive DURATION`: the same
from a server of its own (localllm/resident.py), which takes the load options."""

from __future__ import annotations

from localllm.client import RemoteStats, completion_body, first_model, model_entry, server_url, stream_completion
from localllm.commands.cli_output import err, note, print_completion
from localllm.commands.repl import run_chat
from localllm.conversation import RemoteChat
from localllm.errors import LocalLLMError
from localllm.progress import elapsed_spinner
from localllm.registry import resolve_model
from localllm.resident import Resident, kept_alive, parse_duration
from localllm.settings import DEFAULT_CPU, GenerationSettings, SamplingSettings


def refuse_local_options(given: dict[str, bool], flag: str = "--server") -> None:
    """given: option name -> whether the user set it; one line naming those `flag` cannot take."""
    local = [name for name, set_ in given.items() if set_]
    if local and flag == "--server":
        raise LocalLLMError(f"{', '.join(local)} cannot be used with --server: the server runs its own model "
                            "(set them on `localllm serve`)")
    if local:
        raise LocalLLMError(f"{', '.join(local)} cannot be used with {flag}: the server's API has no such option")


def resident_server(keep_alive: str, load_args: list[str], model: str | None, verbose: bool) -> Resident:
    """The background server of this model and these load options (localllm/resident.py), started first
    when none runs (a spinner while it loads)."""
    idle = parse_duration(keep_alive)
    path = resolve_model(model)
    what = f"loading {path.name} in a background server (kept {keep_alive.strip()} after the last request)"
    folder = DEFAULT_CPU.cache_dir / "resident"
    resident = kept_alive(folder, path, idle, load_args, lambda: elapsed_spinner(what, delay=0.5))
    if verbose:
        err.print(f"background server pid {resident.pid} at {resident.url}", highlight=False, soft_wrap=True)
    return resident


def complete_resident(keep_alive: str, load_args: list[str], model: str | None, prompt: str, sampling: SamplingSettings,
                      gen: GenerationSettings, verbose: bool, json_out: bool) -> None:
    """`complete --keep-alive DURATION`: complete_remote from the background server."""
    resident = resident_server(keep_alive, load_args, model, verbose)
    complete_remote(resident.url, None, prompt, sampling, gen, verbose, json_out)


def chat_resident(keep_alive: str, load_args: list[str], model: str | None, system: str | None,
                  sampling: SamplingSettings, gen: GenerationSettings, verbose: bool) -> None:
    """`chat --keep-alive DURATION`: the REPL (commands/repl.py) on the background server's chat endpoint."""
    resident = resident_server(keep_alive, load_args, model, verbose)
    entry = model_entry(resident.url)
    session = RemoteChat(resident.url, entry["id"], int(entry.get("context_length", 0)), gen, sampling, system,
                         notify=note)

    def after() -> None:
        s = session.last
        err.print(f"prompt {s.prompt_tokens} tokens, first piece {s.first_piece_seconds:.3f} s | generated "
                  f"{s.generated_tokens} tokens, {s.generate_tps():.1f} tokens/s", highlight=False, soft_wrap=True)

    run_chat(session, after if verbose else (lambda: None))


def complete_remote(url: str, model: str | None, prompt: str, sampling: SamplingSettings, gen: GenerationSettings,
                    verbose: bool, json_out: bool, api_key: str | None = None) -> None:
    """Stream (or with json_out print as one JSON object) the server's continuation of prompt."""
    url = server_url(url)
    body = completion_body(model or first_model(url, api_key), prompt, gen.max_tokens, sampling, gen.stop)
    stats = RemoteStats()
    print_completion(stream_completion(url, body, stats, api_key), json_out, lambda text: record(text, stats))
    if verbose:
        err.print(f"server {url} | first piece {stats.first_piece_seconds:.3f} s | prompt {stats.prompt_tokens} "
                  f"tokens | generated {stats.generated_tokens} tokens, {stats.generate_tps():.1f} tokens/s",
                  highlight=False, soft_wrap=True)


def record(text: str, stats: RemoteStats) -> dict:
    """`complete --json`'s object (commands/reports.completion_record's keys; no load, the server's
    prompt time unknown: the first piece's time instead)."""
    return {
        "text": text,
        "finish_reason": stats.finish_reason,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "timings": {
            "first_piece_s": round(stats.first_piece_seconds, 6),
            "generate_s": round(stats.generate_seconds, 6),
            "generate_tokens_per_s": round(stats.generate_tps(), 3),
        },
    }
