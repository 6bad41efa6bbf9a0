"""A GGUF file as a Hugging Face safetensors folder (config.json, model.safetensors, tokenizer files), for
timing `localllm bench FOLDER` against `localllm bench FILE` on the same weights (issue 20).

    python bench/hf_folder.py smol-F32.gguf OUT_FOLDER [--dtype float32|float16|bfloat16]

transformers (a test dependency) reads the GGUF (undoing llama.cpp's q/k row order); its config goes out by
save_pretrained and its weights by safetensors' save_file (transformers will not save_pretrained a model
it read from GGUF; a tied output weight is left out, as save_pretrained leaves it); an F32 source keeps the values exact in float32, and float16 / bfloat16 folders
hold the same rounding as `localllm quantize FILE --type F16|BF16` of that source.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    a = ap.parse_args()
    src = a.gguf.resolve()
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    from safetensors.torch import save_file

    a.out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, a.dtype)
    state = {k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(a.out / "model.safetensors"), metadata={"format": "pt"})
    model.config.dtype = dtype
    if hasattr(model.config, "quantization_config"):  # GGUF's marker: the folder holds plain weights
        del model.config.quantization_config
    model.config.save_pretrained(str(a.out))
    AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(a.out))
    print(f"wrote {a.out} ({a.dtype})")


if __name__ == "__main__":
    main()
