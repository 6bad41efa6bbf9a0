"""Synthetic GGUF files of the families on one small shape, for bench/vs_llamacpp.py (the CPU
against llama.cpp on the same file): the shape's sizes with bench/cpu_families.py's layer fields, or
with --moe the mixture-of-experts families (moe_variants: Mixtral, Qwen3-MoE, gpt-oss with MXFP4 experts).

    python bench/family_files.py [--shape smollm2-135m] [-w Q4_0] [--vocab VOCAB.gguf] [--out DIR] [--moe]
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
from localllm.config import ModelConfig
from localllm.registry import shape_preset
from localllm.synthetic import write_synthetic_gguf

def moe_variants(cfg: ModelConfig, wtype: str) -> dict[str, tuple[ModelConfig, str]]:
    """The MoE families on cfg's sizes: name -> (config, file type). Experts half the dense MLP's width
    or less (a multiple of 32: MXFP4 / Q4_0 rows of ffn_down_exps); gpt-oss as its files are typed
    (MXFP4_MOE: experts MXFP4, the rest Q8_0), with its layer fields (sinks, biases, every other layer
    sliding, the clamped GLU, top-k then softmax) and an output matrix (llama.cpp's gpt-oss needs one)."""
    F = cfg.ffn_dim // 2 // 32 * 32
    L = cfg.n_layers
    return {
        # llama.cpp's llama architecture reads the experts' width from feed_forward_length
        "mixtral": (replace(cfg, arch="mixtral", ffn_dim=F, n_experts=8, n_experts_used=2, expert_ffn_dim=F), wtype),
        "qwen3moe": (replace(cfg, arch="qwen3_moe", qk_norm=True, n_experts=16, n_experts_used=4,
                             expert_ffn_dim=F // 2 // 32 * 32), wtype),
        "gpt-oss": (replace(cfg, arch="gpt_oss", tied_output=False, qkv_bias=True, attn_out_bias=True, attn_sinks=True,
                            sliding_window=128, sliding_layers=tuple(i % 2 == 0 for i in range(L)),
                            activation="swiglu_oai", swiglu_limit=7.0, moe_bias=True, moe_gating="topk_softmax",
                            n_experts=16, n_experts_used=4, expert_ffn_dim=F // 2 // 32 * 32), "MXFP4_MOE"),
    }


VOCAB = Path(__file__).resolve().parent.parent / "tests" / "data" / "vocab" / "ggml-vocab-llama-spm.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", help="a models.toml shape preset")
    ap.add_argument("-w", "--weights", default="Q4_0", help="GGUF file type")
    ap.add_argument("--vocab", type=Path, default=VOCAB, help="a GGUF file whose tokenizer keys are written")
    ap.add_argument("--out", type=Path, default=Path(".out/families"))
    ap.add_argument("--moe", action="store_true", help="the MoE families' files (moe_variants) instead")
    args = ap.parse_args()
    tok = read_gguf_metadata(args.vocab, keep=lambda key: key.startswith("tokenizer."))
    base = replace(shape_preset(args.shape), vocab_size=len(tok["tokenizer.ggml.tokens"].value))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.moe:
        for name, (cfg, wtype) in moe_variants(base, args.weights).items():
            print(write_synthetic_gguf(cfg, wtype, args.out / f"{name}-{wtype}.gguf", tok, quantized_embedding=True))
        return
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
