"""The fuzz worker: a subprocess that imports torch once and runs many cases.

Protocol: the parent writes one case index per line on stdin; for each, the worker builds the case
(fuzz_cases, same seed as the parent), runs it and writes one JSON line on its protocol pipe (the
original stdout; library output goes to stderr, a log file). Before each case it logs
"START <idx>", so that on a hang (the parent sends SIGUSR1: faulthandler dumps the stack) or a crash
(faulthandler's fatal-signal dump) the parent can find where it was.

    python tests/fuzz_worker.py --seeds DIR --run-seed S --targets gguf,safetensors --scratch DIR
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import resource
import signal
import sys
import traceback
from pathlib import Path

from fuzz_cases import Case, Seeds, build_case, case_suffix, write_case
from fuzz_seeds import gguf_seeds, hf_seeds
from fuzz_text_cases import resolve_ids

PROMPT = "hello the"
RECYCLE_AT = 0.5  # of the address-space limit: past it the worker ends after its case (a leak, counted)
NONFINITE_MARK = " words of tensor "  # fuzz_gguf_mutate.nonfinite_data's description
PROJECT_DIRS = ("localllm", "quantize", "kernels")


def address_space() -> int:
    """This process's virtual memory size in bytes (what RLIMIT_AS limits)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) << 10
    return 0


def limit_memory(mb: int) -> None:
    """Address-space limit: allocation past it raises MemoryError (the finding "unbounded memory")."""
    if mb > 0:
        resource.setrlimit(resource.RLIMIT_AS, (mb << 20, mb << 20))


def load_tokenizers(vocabs: list[str]) -> list:
    """A tokenizer per vocabulary (None where the vocabulary's type is not supported at all)."""
    from localllm.errors import LocalLLMError
    from localllm.load import load_tokenizer

    out = []
    for path in vocabs:
        try:
            out.append(load_tokenizer(path))
        except LocalLLMError:
            out.append(None)
    return out


def run_model(path: Path) -> str:
    """load_model then 3 greedy tokens; "text" or "empty" (no text came out)."""
    from localllm.load import load_model
    from localllm.runner import complete
    from localllm.settings import GenerationSettings, SamplingSettings

    lm = load_model(str(path), "cpu")
    text = "".join(complete(lm, PROMPT, GenerationSettings(max_tokens=3), SamplingSettings(temperature=0)))
    return "text" if text else "empty"


class LossyRoundTrip(Exception):
    """decode(encode(s)) != s for valid text, and the tokenizer did not name a character it cannot represent."""


def check_round_trip(tok, text: str) -> None:
    """The issue's round-trip promise, where the tokenizer can say what it cannot represent
    (Tokenizer.unrepresentable): valid UTF-8 text comes back unchanged, or is named."""
    if not hasattr(tok, "unrepresentable"):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: not valid text, no round trip promised
        return
    back = tok.decode(tok.encode(text))
    if back != text and not tok.unrepresentable(text):
        raise LossyRoundTrip(f"decode(encode(s)) != s with nothing named unrepresentable: {text[:60]!r} -> {back[:60]!r}")


def run_tokenizer(case: dict, tokenizers: list) -> str:
    from localllm.tokenizer import StreamDecoder

    tok = tokenizers[case["vocab"]]
    if tok is None:
        return "unsupported vocab"
    if case["op"] == "encode":
        ids = tok.encode(case["text"], add_bos=case["add_bos"], parse_special=case["parse_special"])
        if case["kind"] != "specials":  # after a parsed special token SPM adds a space, as llama.cpp does
            check_round_trip(tok, case["text"])
        return "text" if ids else "empty"
    ids = resolve_ids(case["ids"], tok.vocab_size)
    if case["op"] == "decode":
        return "text" if tok.decode(ids, skip_special=case["skip_special"]) else "empty"
    stream = StreamDecoder(tok)
    text = "".join(stream.push(i) for i in ids) + stream.flush()
    return "text" if text else "empty"


def run_case(case: Case, where: Path, tokenizers: list) -> str:
    """How a case that raised nothing went: "text" or "empty", marked where NaN/Inf was written into
    the weights (then success is suspect: non-finite logits should be refused, not turned into text)."""
    if case.target == "tokenizer":
        return run_tokenizer(case.data, tokenizers)
    detail = run_model(write_case(case, where))
    return f"{detail} despite NaN/Inf weights" if any(NONFINITE_MARK in w for w in case.what) else detail


def project_frame(frames: list[tuple[str, int, str]]) -> str:
    """The innermost frame in the project's own code, as "localllm/x.py:LINE func" ("" if none)."""
    for filename, line, func in reversed(frames):
        parts = Path(filename).parts
        for top in PROJECT_DIRS:
            if top in parts:
                rel = "/".join(parts[len(parts) - parts[::-1].index(top) - 1:])
                return f"{rel}:{line} {func}"
    return ""


def classify(exc: BaseException) -> dict:
    """An exception as an outcome: "error" (LocalLLMError with one line) or a failure kind."""
    from localllm.errors import LocalLLMError

    msg = str(exc)
    if isinstance(exc, LocalLLMError):
        if msg.strip() and "\n" not in msg:
            return dict(outcome="error", message=msg)
        kind = "error-not-one-line"
    elif isinstance(exc, LossyRoundTrip):
        kind = "lossy-round-trip"
    elif isinstance(exc, MemoryError) or isinstance(exc, RuntimeError) and "allocate" in msg:
        kind = "memory"
    else:
        kind = "exception"
    tb = traceback.extract_tb(exc.__traceback__)
    frames = [(f.filename, f.lineno, f.name) for f in tb]
    inner = f"{Path(tb[-1].filename).name}:{tb[-1].lineno} {tb[-1].name}" if tb else ""
    return dict(outcome=kind, exc=type(exc).__name__, message=msg.strip().splitlines()[0][:300] if msg.strip() else "",
                frame=project_frame(frames), inner=inner)


def serve(args: argparse.Namespace, proto) -> None:
    seeds = Seeds(gguf_seeds(args.seeds), hf_seeds(args.seeds), args.vocabs.split(",") if args.vocabs else [])
    tokenizers = load_tokenizers(seeds.vocabs) if "tokenizer" in args.targets else []
    args.scratch.mkdir(parents=True, exist_ok=True)
    proto.write("READY\n")
    proto.flush()
    for line in sys.stdin:
        target, idx = line.split()
        print(f"START {target} {idx}", file=sys.stderr, flush=True)
        try:
            case = build_case(args.run_seed, target, int(idx), seeds)
        except Exception as e:  # noqa: BLE001 - the fuzzer's own bug: reported, not fatal
            result = dict(classify(e), outcome="fuzzer-bug")
        else:
            try:
                result = dict(outcome="ok", detail=run_case(case, args.scratch / f"case{case_suffix(target)}",
                                                            tokenizers))
            except BaseException as e:  # noqa: BLE001 - every other exception is the finding
                result = classify(e)
        proto.write(json.dumps(dict(target=target, idx=int(idx), **result)) + "\n")
        if address_space() > (args.mem_mb << 20) * RECYCLE_AT:
            proto.write(json.dumps(dict(target=target, idx=int(idx), outcome="recycle")) + "\n")
            proto.flush()
            return  # the parent starts a fresh worker: grown memory must not turn later cases into MemoryErrors
        proto.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=Path, required=True)
    p.add_argument("--scratch", type=Path, required=True)
    p.add_argument("--run-seed", type=int, required=True)
    p.add_argument("--targets", default="gguf")
    p.add_argument("--vocabs", default="")
    p.add_argument("--mem-mb", type=int, default=4096)
    args = p.parse_args()
    # The protocol pipe is the original stdout; anything the library prints goes to the log instead.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    faulthandler.enable(file=sys.stderr)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=False)
    import torch

    torch.set_num_threads(1)
    limit_memory(args.mem_mb)
    serve(args, proto)


if __name__ == "__main__":
    main()
