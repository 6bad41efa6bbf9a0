"""`complete --server URL`: the completion streamed from a running `localllm serve` (localllm/client.py)
instead of a model this process loads: no torch import, no load, no kernel compilation (the first
token in a fraction of a second where a loading run waits seconds). The options that only a local
model has (device, dtype, threads, draft, lookup, context, tensor parallelism, repeat penalty) are
refused with --server: the server was started with its own."""

from __future__ import annotations

from localllm.client import RemoteStats, completion_body, first_model, server_url, stream_completion
from localllm.commands.cli_output import err, print_completion
from localllm.errors import LocalLLMError
from localllm.settings import GenerationSettings, SamplingSettings


def refuse_local_options(given: dict[str, bool]) -> None:
    """given: option name -> whether the user set it; one line naming those --server cannot take."""
    local = [name for name, set_ in given.items() if set_]
    if local:
        raise LocalLLMError(f"{', '.join(local)} cannot be used with --server: the server runs its own model "
                            "(set them on `localllm serve`)")


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
