"""Writes the llama.cpp tool samples in this folder (see README.md). Run from the repository root:

    PYTHONPATH=$PWD:$PWD/tests python tests/data/llamacpp/make_samples.py /path/to/llama.cpp/build/bin

It writes the tiny test models (tests/tiny_models.py: the llama case, F32 and Q4_0, and the MIXED shape
in F32 for 256-value rows) to a temporary folder, runs llama-imatrix, llama-perplexity and
llama-quantize on them, and keeps here: text.txt (the evaluated text), imatrix.gguf / imatrix.dat
(llama-imatrix, both formats), ours_imatrix.gguf (localllm's, which llama-quantize is then given),
base.kld (llama-perplexity --kl-divergence-base of the F32 model) and results.json (llama-perplexity's
printed KLD figures and the SHA-256 of each tensor llama-quantize wrote).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import torch

import test_evaluate
import tiny_models as tm
from tiny_gguf import write_gguf
import tiny_spec
from localllm.imatrix import collect_imatrix_stats, save_imatrix
from localllm.commands import evaluate as ev
from localllm.commands import llama_logits as ll
from localllm.load import load_model

HERE = Path(__file__).parent
CTX, KLD_CHUNKS, IMATRIX_CHUNKS = 32, 8, 4  # 8 x 15 scored: llama-perplexity prints its summary from 100


def run(*args) -> str:
    # to files, not pipes: llama-perplexity's log thread lost its last lines into a pipe
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        code = subprocess.run([str(a) for a in args], stdout=out, stderr=err).returncode
        out.seek(0), err.seek(0)
        text_out, text_err = out.read(), err.read()
    if code:
        raise SystemExit(f"{args[0]} failed:\n{text_out[-3000:]}\n{text_err[-3000:]}")
    return text_out + text_err


def kld_figures(out: str) -> dict:
    """llama-perplexity --kl-divergence's summary: Mean KLD, Same top p, Mean PPL(Q), Mean PPL(base)."""
    def grab(pattern):
        m = re.search(pattern, out)
        if not m:
            raise SystemExit(f"no {pattern!r} in llama-perplexity's output:\n{out[-3000:]}")
        return float(m.group(1))
    return {"mean_kld": grab(r"Mean\s+KLD:\s+(-?[0-9.eE+-]+)"), "same_top": grab(r"Same top p:\s+([0-9.]+)") / 100,
            "ppl": grab(r"Mean\s+PPL\(Q\)\s*:\s+([0-9.]+)"), "base_ppl": grab(r"Mean\s+PPL\(base\)\s*:\s+([0-9.]+)")}


def tensor_hashes(path: Path) -> dict:
    return {t.name: [t.tensor_type.name, hashlib.sha256(bytes(t.data)).hexdigest()] for t in gguf.GGUFReader(path).tensors}


def main(bin_dir: Path) -> None:
    text = HERE / "text.txt"
    text.write_text(test_evaluate.TEXT)
    results: dict = {"ctx": CTX, "kld_chunks": KLD_CHUNKS, "imatrix_chunks": IMATRIX_CHUNKS}
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        f32 = write_gguf(tm.case_spec("llama"), d / "tiny-f32.gguf")
        q4 = write_gguf(tm.case_spec("llama"), d / "tiny-q4_0.gguf", tiny_spec.Q.Q4_0)
        wide = write_gguf(tm.MIXED, d / "wide-f32.gguf")
        common = ["-c", CTX, "-t", 2, "-b", CTX]
        run(bin_dir / "llama-imatrix", "-m", f32, "-f", text, *common, "--chunks", IMATRIX_CHUNKS, "--process-output",
            "--no-ppl", "-o", HERE / "imatrix.gguf")
        run(bin_dir / "llama-imatrix", "-m", f32, "-f", text, *common, "--chunks", IMATRIX_CHUNKS, "--process-output",
            "--no-ppl", "--output-format", "dat", "-o", HERE / "imatrix.dat")
        run(bin_dir / "llama-perplexity", "-m", f32, "-f", text, *common, "--chunks", KLD_CHUNKS,
            "--kl-divergence-base", HERE / "base.kld")
        out = run(bin_dir / "llama-perplexity", "-m", q4, *common, "--kl-divergence-base", HERE / "base.kld",
                  "--kl-divergence")
        results["llama_q4_vs_llama_base"] = kld_figures(out)
        # localllm's base file of the F32 model, in llama.cpp's format, judged by llama-perplexity
        lm = load_model(str(f32), "cpu", torch.float32)
        ours_kld = d / "ours.kld"
        ev.evaluate(lm, ev.chunks_for(lm, text.read_text(), CTX, KLD_CHUNKS), save_to=ours_kld,
                    writer_cls=ll.LlamaLogitsWriter)
        out = run(bin_dir / "llama-perplexity", "-m", q4, *common, "--kl-divergence-base", ours_kld, "--kl-divergence")
        results["llama_q4_vs_ours_base"] = kld_figures(out)
        # localllm's imatrix of the F32 model on llama's chunks, handed to llama-quantize
        saved = ll.load_llama_logits(HERE / "base.kld")
        chunks = [list(map(int, row)) for row in saved.tokens[:IMATRIX_CHUNKS]]
        save_imatrix(HERE / "ours_imatrix.gguf", collect_imatrix_stats(lm.model, chunks, dataset="text.txt"))
        quantized = {}
        for name, model, imatrix, qtype in (
            ("tiny_iq4_nl_llama_imatrix", f32, HERE / "imatrix.gguf", "IQ4_NL"),
            ("tiny_iq4_nl_llama_dat", f32, HERE / "imatrix.dat", "IQ4_NL"),
            ("tiny_iq4_nl_ours_imatrix", f32, HERE / "ours_imatrix.gguf", "IQ4_NL"),
            ("tiny_iq4_xs", f32, None, "IQ4_XS"),
            ("wide_iq4_xs", wide, None, "IQ4_XS"),
            ("wide_iq4_nl", wide, None, "IQ4_NL"),
        ):
            out_path = d / f"{name}.gguf"
            run(bin_dir / "llama-quantize", *(["--imatrix", imatrix] if imatrix else []), model, out_path, qtype)
            quantized[name] = tensor_hashes(out_path)
        results["llama_quantize"] = quantized
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    shutil.rmtree(HERE / "__pycache__", ignore_errors=True)
    print(json.dumps({k: v for k, v in results.items() if k != "llama_quantize"}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
