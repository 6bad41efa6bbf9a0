"""One rank of tests/test_tp_graph.py (gloo on the CPU, Triton's interpreter), started as a plain process:
    python tests/tp_graph_worker.py RANK PORT OUT_DIR
Per weight type: the CUDA decode step (backends/cuda_graph.GraphDecoder, eager: use_graph=False) of
this rank's shard of a tiny synthetic model at TP=2, and (rank 1) of the whole model at TP=1, fed the
same ids: each step's logits, and the greedy decoder's id; saved to OUT_DIR/<type>-<rank>.pt."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from localllm.config import ModelConfig  # noqa: E402

# one layer, head_dim 32 (the attention's int8-output path for Q8_0): per rank one q and one kv head, 32
# MLP columns (one Q8_0 block of the down projection's row) and 64 vocabulary rows
CFG = ModelConfig(arch="llama", n_layers=1, dim=64, ffn_dim=64, n_heads=2, n_kv_heads=2, head_dim=32,
                  vocab_size=128, context_length=64, norm_eps=1e-5, rope_theta=10000.0)
STEPS = [5, 100]  # ids of both ranks' vocabulary parts, at positions 0 and 1


def shard(state: dict, tp) -> dict:
    from localllm.tp_shard import shard_tensor
    from localllm.weights import QuantizedTensor

    out = {}
    for name, v in state.items():
        if isinstance(v, QuantizedTensor):
            out[name] = QuantizedTensor(v.qtype, shard_tensor(name, v.data, CFG, tp, v.qtype).contiguous())
        else:
            out[name] = shard_tensor(name, v, CFG, tp).contiguous()
    return out


@torch.inference_mode()
def steps(model, greedy: bool = False) -> torch.Tensor:
    """The decoder's logits (2, V) for STEPS at positions 0, 1 of an empty cache; greedy: the greedy
    decoder's id (1,) after STEPS[0]."""
    from localllm.backends.cuda_graph import GraphDecoder
    from localllm.cache import make_cache

    dec = GraphDecoder(model, make_cache(model.cfg, 4), use_graph=False, greedy=greedy)
    if greedy:
        return dec.step_greedy(torch.tensor([STEPS[0]])).clone()
    return torch.stack([dec.step(torch.tensor([t])).clone() for t in STEPS])


def main(argv: list[str]) -> None:
    rank, port, out = int(argv[0]), int(argv[1]), Path(argv[2])
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from localllm.backends.cuda import fuse
    from localllm.load import build_model
    from localllm.parallel import TensorParallel
    from localllm.synthetic import synthetic_state

    tp = TensorParallel(rank, 2)
    for wtype in argv[3:]:
        state, _ = synthetic_state(CFG, wtype, "cpu", seed=5)
        whole = build_model(CFG, dict(state), "cpu", torch.float32, keep_quantized=True).model
        part = build_model(CFG, shard(state, tp), "cpu", torch.float32, keep_quantized=True, tp=tp).model
        fuse(whole)
        fuse(part)
        res = {"tp2": steps(part), "greedy2": steps(part, greedy=True)}
        if rank == 1:  # the oracle (while rank 0 saves)
            res["tp1"] = steps(whole)
        torch.save(res, out / f"{wtype}-{rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
