"""`--json`: the commands' results as one plain JSON object for scripts (complete, info, perplexity,
quantize --dry-run). Each function returns a dict of numbers, strings, lists and dicts only; the CLI
prints it with json.dumps. Field names follow the text output's words."""

from __future__ import annotations

import math
from typing import Any, Sequence

from localllm.generate import Stats
from localllm.quantize.plan import PlanRow, total_bpw, total_bytes

from localllm.commands.evaluate import Evaluation


def readable_piece(data: bytes) -> str:
    """A token's bytes as `tokenize` shows them: the text quoted as Python writes it (' w', 'ör', '\\n'),
    or, when the bytes are not whole UTF-8 (a byte token, half a character), the bytes literal (b'\\xc3')."""
    try:
        return repr(data.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(data)


def finish_reason(stats: Stats, max_tokens: int) -> str:
    """Why generation ended, in OpenAI's words: "length" (-n reached), "context" (the context was
    full), "stop" (an end-of-text token or a --stop string)."""
    if stats.context_full:
        return "context"
    if max_tokens != -1 and stats.generated_tokens >= max_tokens:
        return "length"
    return "stop"


def completion_record(text: str, stats: Stats, load_seconds: float, max_tokens: int) -> dict[str, Any]:
    """`complete --json`: the whole text, token counts, timings and why it ended."""
    return {
        "text": text,
        "finish_reason": finish_reason(stats, max_tokens),
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "timings": {
            "load_s": round(load_seconds, 6),
            "prompt_s": round(stats.prompt_seconds, 6),
            "generate_s": round(stats.generate_seconds, 6),
            "prompt_tokens_per_s": round(stats.prompt_tps(), 3),
            "generate_tokens_per_s": round(stats.generate_tps(), 3),
        },
    }


def evaluation_record(result: Evaluation) -> dict[str, Any]:
    """`perplexity --json`: PPL with its standard error, chunking, and the KLD statistics when a base
    was given."""
    out: dict[str, Any] = {
        "ppl": result.ppl,
        "ppl_stderr": result.ppl_stderr,
        "mean_nll": result.mean_nll,
        "chunks": result.n_chunks,
        "ctx": result.ctx,
        "scored": result.count,
    }
    if result.kld is not None:
        k = result.kld
        out["kld"] = {
            "mean": k.mean, "stderr": k.stderr, "p99": k.p99, "median": k.median, "max": k.maximum,
            "same_top": k.same_top, "same_top_stderr": k.same_top_stderr,
            "base_ppl": k.base_ppl, "base_ppl_stderr": k.base_ppl_stderr,
        }
    return out


def plan_record(preset_name: str, rows: Sequence[PlanRow], errors: Sequence[float] | None) -> dict[str, Any]:
    """`quantize --dry-run --json`: every tensor's type and size, the totals as the table's footer."""
    values = sum(r.n_values for r in rows)
    tensors = []
    for i, r in enumerate(rows):
        row = {"name": r.name, "shape": list(r.shape), "from": r.source.name, "type": r.target.name,
               "bits_per_weight": r.bits, "bytes": r.nbytes, "note": r.note}
        if errors is not None:
            row["rel_rmse"] = errors[i]
        tensors.append(row)
    out: dict[str, Any] = {
        "preset": preset_name,
        "tensors": tensors,
        "total_bytes": total_bytes(rows),
        "source_bytes": sum(r.source_nbytes for r in rows),
        "bits_per_weight": total_bpw(rows),
    }
    if errors is not None and values:
        # the values-weighted root mean square of the per-tensor errors (plan_table's footer)
        out["rel_rmse"] = math.sqrt(sum(e * e * r.n_values for e, r in zip(errors, rows)) / values)
    return out
