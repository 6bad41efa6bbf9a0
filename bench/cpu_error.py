"""Error of the CPU path (int16-rounded activations, kernels/cpu.py) against the fp32 reference.

    python bench/cpu_error.py [MODEL] [-n 256] [--file bench/data/eval.txt]

Teacher-forced: the first n tokens of the text go through the CPU path one decode step at a time
and as one prompt (both with int16-rounded activations), and through the dense fp32
reference (weights decoded by quantize.dequantize_torch, torch ops) in one pass; prints, for each,
over the n positions, the largest and mean max-abs logit error
relative to the logits' range, the mean and largest KL divergence (reference || CPU) and the
share of positions whose top token agrees.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from localllm.cache import make_cache
from localllm.load import load_model

HERE = Path(__file__).resolve().parent


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--file", default=str(HERE / "data" / "eval.txt"))
    args = ap.parse_args()
    cpu = load_model(args.model, "cpu")
    ref = load_model(args.model, "cpu", torch.float32, keep_quantized=False)
    ids = cpu.tokenizer.encode(Path(args.file).read_text(), add_bos=cpu.tokenizer.add_bos)[: args.n]
    tokens = torch.tensor([ids])
    want = ref.model(tokens, make_cache(ref.config, len(ids)), 0)[0]
    cache = make_cache(cpu.config, len(ids))
    decode = torch.cat([cpu.model(tokens[:, i:i + 1], cache, i)[0] for i in range(len(ids))])
    prompt = cpu.model(tokens, make_cache(cpu.config, len(ids)), 0)[0]
    for name, got in ((f"decode, {len(ids)} steps", decode), (f"one {len(ids)}-token prompt", prompt)):
        err = (got - want).abs().amax(-1) / (want.amax(-1) - want.amin(-1))
        kl = (want.log_softmax(-1).exp() * (want.log_softmax(-1) - got.log_softmax(-1))).sum(-1)
        same = (got.argmax(-1) == want.argmax(-1)).float().mean()
        print(f"{cpu.path.name} {name}: logit error / range max {err.max():.2e}, mean {err.mean():.2e}"
              f" | KL mean {kl.mean():.2e}, max {kl.max():.2e} | same top token {same:.2%}")


if __name__ == "__main__":
    main()
