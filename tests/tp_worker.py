"""One rank of tests/test_tp.py's (gloo, CPU) and tests/gpu/test_gpu_tp.py's (NCCL, CUDA) tensor-parallel
runs, started as a plain process:
    python tests/tp_worker.py RANK WORLD PORT DEVICE OUT_DIR IDS PROMPT_LEN STEPS MODEL...
For each model: the logits of the prompt IDS[:PROMPT_LEN] (T, V); then STEPS decode steps, each feeding
the previous step's greedy id ("greedy") or, where IDS holds more than the prompt, IDS's next id (teacher
forcing: "forced_logits" (STEPS, V)); and the shapes of this rank's tensors. Saved to OUT_DIR/<i>-<rank>.pt;
a LocalLLMError's line to OUT_DIR/<i>-<rank>.err. MODEL "synthetic": synthetic.synthetic_model of
tests/tiny_models.py's llama shape in Q8_0 (each rank makes only its shard)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # tiny_models


def open_runtime(path: str, tp, device: str):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if path == "synthetic":
        from tiny_hf import hf_config
        from tiny_spec import TinySpec
        from localllm.config_hf import config_from_hf
        from localllm.synthetic import synthetic_model

        cfg = config_from_hf(hf_config(TinySpec("llama")))
        return synthetic_model(cfg, "Q8_0", device, dtype, tp=tp)[0]
    from localllm.load import load_model

    return load_model(path, device, dtype, tp=tp).runtime


@torch.inference_mode()
def slot_logits(rt, ids: list[int], device: str) -> torch.Tensor:
    """serve's steps (slots.py): two prompts prefilled in one pass into slots 1 and 0, then one
    decode_slots step of both -> (2, V) + (2, V) logits stacked (4, V)."""
    slots = rt.new_slots(2, len(ids) + 4)
    first = rt.prefill_slots(slots, [1, 0], [ids, ids[:5]], [0, 0])
    nxt = rt.decode_slots(slots, [0, 1], torch.tensor(ids[5:7], device=device))
    return torch.cat([first.float().cpu(), nxt.float().cpu()])


@torch.inference_mode()
def run_model(path: str, tp, device: str, ids: list[int], prompt: int, steps: int) -> dict:
    rt = open_runtime(path, tp, device)
    cache = rt.new_cache(len(ids) + steps + 1)
    logits = rt.forward(torch.tensor([ids[:prompt]], device=device), cache, 0)[0].float().cpu()
    out, forced, tok = [], [], logits[-1].argmax().to(device)
    for s in range(steps):
        if len(ids) > prompt:
            tok = torch.tensor(ids[prompt + s], device=device)
        out.append(int(tok))
        row = rt.decode(cache, tok.view(1))[0]
        forced.append(row.float().cpu())
        tok = row.argmax(-1)
    slot_rows = slot_logits(rt, ids[:prompt], device) if device == "cpu" else None
    shapes = {k: tuple(v.shape) for k, v in rt.model.state_dict().items()}
    for name, mod in rt.model.named_modules():  # quantized weights held outside the state dict
        w = getattr(mod, "qweight", None)
        if w is None and type(mod).__name__ == "QEmbedding":
            w = mod.weight
        if w is not None:
            shapes[name + ".weight"] = tuple(w.shape)
    return {"logits": logits, "greedy": out, "forced_logits": torch.stack(forced), "shapes": shapes, "slots": slot_rows,
            "runtime": type(rt).__name__}


def main(argv: list[str]) -> None:
    rank, world, port, device = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    out = Path(argv[4])
    ids = [int(x) for x in argv[5].split(",")]
    prompt, steps = int(argv[6]), int(argv[7])
    cuda = device == "cuda"
    if cuda:
        from localllm.parallel import NO_MULTICAST
        import os

        os.environ.update(NO_MULTICAST)
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        torch.set_num_threads(1)
    torch.distributed.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world)
    from localllm.errors import LocalLLMError
    from localllm.parallel import TensorParallel

    tp = TensorParallel(rank, world)
    for i, path in enumerate(argv[8:]):
        try:
            torch.save(run_model(path, tp, device, ids, prompt, steps), out / f"{i}-{rank}.pt")
        except LocalLLMError as e:
            (out / f"{i}-{rank}.err").write_text(str(e))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
