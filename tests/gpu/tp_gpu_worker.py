"""One rank of tests/gpu/test_gpu_tp.py, started by torch's launcher (2 processes, a GPU each):
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/gpu/tp_gpu_worker.py OUT CASES.json
CASES.json: [{"name", "path", "draft"}] (GGUF files; draft: a same-vocabulary model for --draft).

Every rank runs the same calls (the collectives match); rank 0 also runs TP=1 on its GPU (the oracle)
and saves, per case, OUT/<name>.pt: the TP=1 and TP=2 prompt logits, TP=1's 64 greedy ids and each
step's logits, TP=2's logits on those same ids (teacher forced) twice (bit-equality run to run) and
once more with the NCCL all-reduce (the push kernel's sums must be the same bits), TP=2's greedy
ids (the greedy graph), and its --lookup and --draft ids. The test asserts on them.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from localllm.draft import LookupDrafter, ModelDrafter
from localllm.generate import generate
from localllm.load import load_model
from localllm.backends.launch import from_launcher
from localllm.sampling import Sampler
from localllm.settings import DraftSettings, SamplingSettings
from localllm.speculative import generate_speculative

STEPS = 64
CAP = 256
GREEDY = SamplingSettings(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)


def prompt_ids(vocab: int) -> list[int]:
    """24 ids, the last 8 repeating the first 8 (prompt lookup finds n-grams)."""
    ids = torch.randint(3, vocab, (16,), generator=torch.Generator().manual_seed(11)).tolist()
    return ids + ids[:8]


@torch.inference_mode()
def forced(rt, prompt: list[int], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt logits (V,) and each step's logits (len(ids), V) fp32 on the CPU, feeding `ids` (the decode
    graph, not the greedy one)."""
    cache = rt.new_cache(CAP)
    first = rt.prefill(cache, [prompt])[0].float().cpu()
    steps = []
    for t in ids:
        steps.append(rt.decode(cache, torch.tensor([t], device=rt.device))[0].float().cpu())
    return first, torch.stack(steps)


def greedy_ids(rt, prompt: list[int]) -> list[int]:
    sampler = Sampler(GREEDY, rt.device)
    return list(generate(rt, rt.new_cache(CAP), prompt, sampler, STEPS))


def speculative_ids(rt, prompt: list[int], drafter) -> list[int]:
    sampler = Sampler(GREEDY, rt.device)
    return list(generate_speculative(rt, rt.new_cache(CAP), prompt, sampler, drafter, STEPS,
                                     settings=DraftSettings(lookup=3)))


def run_case(case: dict, tp, out: str) -> None:
    torch.distributed.barrier()
    if tp.rank == 0:
        print(f"[tp worker] {case['name']}: TP=1, then TP=2", flush=True)
    res: dict = {"name": case["name"]}
    if tp.rank == 0:  # the oracle: the whole model on this GPU alone
        whole = load_model(case["path"], "cuda", torch.bfloat16).runtime
        prompt = prompt_ids(whole.cfg.vocab_size)
        g1 = greedy_ids(whole, prompt)
        res["tp1_first"], res["tp1_steps"] = forced(whole, prompt, g1)
        res["tp1_ids"] = g1
        del whole
        torch.cuda.empty_cache()
    box = [res.get("tp1_ids")]
    torch.distributed.broadcast_object_list(box, src=0)
    g1 = box[0]
    rt = load_model(case["path"], "cuda", torch.bfloat16, tp=tp).runtime
    res["runtime"] = type(rt).__name__
    prompt = prompt_ids(rt.cfg.vocab_size)
    t0 = time.perf_counter()
    res["tp2_first"], res["tp2_steps"] = forced(rt, prompt, g1)
    res["all_reduce"] = getattr(rt, "all_reduce", None)
    res["tp2_first_again"], res["tp2_steps_again"] = forced(rt, prompt, g1)
    res["tp2_ids"] = greedy_ids(rt, prompt)
    res["tp2_ids_again"] = greedy_ids(rt, prompt)
    res["lookup_ids"] = speculative_ids(rt, prompt, LookupDrafter(3, 0.05))
    draft = load_model(case["draft"], "cuda", torch.bfloat16).runtime  # whole on every rank: no collectives
    res["draft_ids"] = speculative_ids(rt, prompt, ModelDrafter(draft, Sampler(GREEDY, rt.device), 0.0, 0.2))
    if hasattr(rt, "all_reduce"):  # the same steps with the other all-reduces: the same integer sums
        picked = rt.all_reduce
        for kind in ("nccl", "push"):
            rt.all_reduce = kind
            _, res[f"tp2_steps_{kind}"] = forced(rt, prompt, g1)
        rt.all_reduce = picked
    res["seconds"] = time.perf_counter() - t0
    if tp.rank == 0:
        torch.save(res, f"{out}/{case['name']}.pt")
        print(f"[tp worker] {case['name']}: {res['runtime']}, all-reduce {res['all_reduce']}, "
              f"{res['seconds']:.1f} s", flush=True)
    del rt, draft
    torch.cuda.empty_cache()


def main() -> None:
    out, cases = sys.argv[1], json.loads(open(sys.argv[2]).read())
    tp = from_launcher("cuda")
    assert tp is not None and tp.world == 2, "start with 2 processes (torch.distributed.run)"
    try:
        for case in cases:
            run_case(case, tp, out)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
