"""One rank of tests/test_tp_runtime.py's driver/worker runs (gloo on the CPU), started as a plain process:
    python tests/tp_runtime_worker.py RANK WORLD PORT OUT MODEL DRAFT
For each mode, "replicated" (every rank holds the whole model) then "sharded" (load_model(tp=)), rank 0
drives the scenarios of scenarios() through tp_runtime.Driver and saves their results to
OUT/<mode>.pt while the other ranks follow; then the driver fails amid a last session (exit status 1):
the workers must still end (status 0)."""

from __future__ import annotations

import sys

import torch


def scenarios(lm, draft: str) -> dict:
    """Greedy completions, plain, by prompt lookup and with a draft model, and two serve slots."""
    from dataclasses import replace

    from localllm.draft import open_drafter
    from localllm.runner import complete
    from localllm.settings import DEFAULT_GENERATION, DEFAULT_SAMPLING, DraftSettings

    gen = replace(DEFAULT_GENERATION, max_tokens=16, ctx=96)
    greedy = replace(DEFAULT_SAMPLING, temperature=0.0)
    prompt = "the cat sat on the mat. the cat sat on the"
    out = {"plain": "".join(complete(lm, prompt, gen, greedy))}
    for name, ds in (("lookup", DraftSettings(lookup=2)), ("draft", DraftSettings(draft=draft, max_draft=3))):
        drafter = open_drafter(lm.runtime, lm.tokenizer, ds, greedy)
        out[name] = "".join(complete(lm, prompt, gen, greedy, drafter=drafter, draft=ds))
    rt = lm.runtime  # serve's steps: two slots, prefilled apart, decoded together
    slots = rt.new_slots(2, 32)
    first = [int(rt.prefill_slot(slots, 0, [1, 5, 9, 13], 0).argmax()),
             int(rt.prefill_slots(slots, [1], [[2, 7, 7]], [0])[0].argmax())]
    ids = [first]
    for _ in range(6):
        ids.append(rt.decode_slots(slots, [0, 1], torch.tensor(ids[-1])).argmax(-1).tolist())
    slots.lengths[1] -= 2  # a caller's rollback, as speculative decoding does
    ids.append(rt.decode_slots(slots, [1], torch.tensor([ids[-1][1]])).argmax(-1).tolist())
    out["slots"] = ids
    return out


def main(argv: list[str]) -> None:
    rank, world, port, out, model, draft = int(argv[0]), int(argv[1]), int(argv[2]), *argv[3:]
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from localllm.parallel import TensorParallel

    tp = TensorParallel(rank, world)
    try:
        run_modes(tp, out, model, draft)
    finally:  # as the CLI does (tp_runtime.close): leave the group before exiting, also on the driver's error
        torch.distributed.destroy_process_group()


def run_modes(tp, out: str, model: str, draft: str) -> None:
    from localllm.load import load_model
    from localllm.tp_runtime import Driver, follow

    for mode in ("replicated", "sharded", "error"):
        lm = load_model(model, "cpu", tp=None if mode == "replicated" else tp)
        if not tp.driver:
            print(f"worker {tp.rank} {mode}: {follow(lm.runtime, tp)} calls")
            continue
        with Driver(lm.runtime, tp) as driver:
            lm.runtime = driver
            if mode == "error":  # a failure amid a session: the Driver's exit stops the workers
                driver.prefill(driver.new_cache(8), [[1, 2, 3]])
                raise SystemExit(1)
            torch.save(scenarios(lm, draft), f"{out}/{mode}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
