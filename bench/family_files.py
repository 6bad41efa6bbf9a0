"""Synthetic GGUF files of the dense families on one small shape, for bench/vs_llamacpp.py (the CPU
against llama.cpp on the same file): the shape's sizes with bench/cpu_families.py's layer fields.

    python bench/family_files.py [--shape smollm2-135m] [-w Q4_0] [--vocab VOCAB.gguf] [--out DIR]
    python bench/vs_llamacpp.py DIR/gemma3-Q4_0.gguf DIR/phi3-Q4_0.gguf ... -t 2

Written by localllm.synthetic.write_synthetic_gguf as llama.cpp reads them (Gemma's sliding-window key,
Phi-3's fused attn_qkv / ffn_up), the token embedding quantized as llama-quantize stores it (the CPU's
one-call decoder needs its blocks); the vocabulary is VOCAB's (its token count replaces the shape's).
Beside them gemma4-WTYPE.gguf: Gemma 4 of a small E2B-like shape of its own (bench/gemma4_file.py).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from cpu_families import variants
from gemma4_file import gemma4_shape, write_gemma4_gguf
from localllm.commands.quantize_cmd import read_gguf_metadata
from localllm.registry import shape_preset
from localllm.synthetic import write_synthetic_gguf

VOCAB = Path(__file__).resolve().parent.parent / "tests" / "data" / "vocab" / "ggml-vocab-llama-spm.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", help="a models.toml shape preset")
    ap.add_argument("-w", "--weights", default="Q4_0", help="GGUF file type")
    ap.add_argument("--vocab", type=Path, default=VOCAB, help="a GGUF file whose tokenizer keys are written")
    ap.add_argument("--out", type=Path, default=Path(".out/families"))
    args = ap.parse_args()
    tok = read_gguf_metadata(args.vocab, keep=lambda key: key.startswith("tokenizer."))
    base = replace(shape_preset(args.shape), vocab_size=len(tok["tokenizer.ggml.tokens"].value))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (cfg, _) in variants(base).items():
        if name.endswith("eager"):
            continue
        arch = {"gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "smollm3": "smollm3"}.get(name, "llama")
        path = write_synthetic_gguf(replace(cfg, arch=arch), args.weights, args.out / f"{name}-{args.weights}.gguf", tok,
                                    quantized_embedding=True)
        print(path)
    vocab = len(tok["tokenizer.ggml.tokens"].value)
    print(write_gemma4_gguf(gemma4_shape(vocab), args.weights, args.out / f"gemma4-{args.weights}.gguf", tok))


if __name__ == "__main__":
    main()
