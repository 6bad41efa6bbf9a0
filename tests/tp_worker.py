"""One rank of tests/test_tp.py's tensor-parallel runs (gloo on the CPU), started as a plain process:
    python tests/tp_worker.py RANK WORLD PORT OUT_DIR PROMPT_IDS STEPS MODEL...
For each model: the logits of the prompt (T, V), STEPS greedy ids after it, and the shapes of this
rank's tensors, saved to OUT_DIR/<i>-<rank>.pt; a LocalLLMError's line to OUT_DIR/<i>-<rank>.err."""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def run_model(path: str, tp, ids: list[int], steps: int) -> dict:
    from localllm.load import load_model
    from localllm.tp_load import shard_bytes  # noqa: F401  (the loader's module, imported as the CLI does)

    lm = load_model(path, "cpu", tp=tp)
    rt = lm.runtime
    cache = rt.new_cache(len(ids) + steps + 1)
    logits = rt.forward(torch.tensor([ids]), cache, 0)[0].clone()
    out, tok = [], logits[-1].argmax()
    for _ in range(steps):
        out.append(int(tok))
        tok = rt.decode(cache, tok.view(1)).argmax(-1)[0]
    shapes = {k: tuple(v.shape) for k, v in rt.model.state_dict().items()}
    for name, mod in rt.model.named_modules():  # quantized weights held outside the state dict
        w = getattr(mod, "qweight", None)
        if w is None and type(mod).__name__ == "QEmbedding":
            w = mod.weight
        if w is not None:
            shapes[name + ".weight"] = tuple(w.shape)
    return {"logits": logits, "greedy": out, "shapes": shapes, "runtime": type(rt).__name__}


def main(argv: list[str]) -> None:
    rank, world, port = int(argv[0]), int(argv[1]), int(argv[2])
    out = Path(argv[3])
    ids = [int(x) for x in argv[4].split(",")]
    steps = int(argv[5])
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from localllm.errors import LocalLLMError
    from localllm.parallel import TensorParallel

    tp = TensorParallel(rank, world)
    for i, path in enumerate(argv[6:]):
        try:
            torch.save(run_model(path, tp, ids, steps), out / f"{i}-{rank}.pt")
        except LocalLLMError as e:
            (out / f"{i}-{rank}.err").write_text(str(e))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
