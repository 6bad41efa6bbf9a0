"""Small helpers shared by the tests in tests/gpu."""

from __future__ import annotations

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error |a - b| / |b| (Frobenius norms, fp64, on the CPU)."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def random_ids(vocab_size: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def take_dense_values(ref_model: torch.nn.Module, gpu_model: torch.nn.Module) -> int:
    """Give the CPU fp32 reference the dense values the GPU model holds (bf16: a file's F16 embedding and
    F32 norms are rounded on the GPU), so both sides compute with the same weights and only the
    arithmetic differs. Tensors the GPU keeps quantized or fused have other names or shapes there and
    are left alone (the reference holds their exact fp32 decoding). Returns how many were taken."""
    gpu = gpu_model.state_dict()
    taken = 0
    for name, ref in ref_model.state_dict().items():
        got = gpu.get(name)
        if (got is None or got.is_meta or not got.is_floating_point() or tuple(got.shape) != tuple(ref.shape)
                or name == "rope_freqs"):
            continue
        ref.copy_(got.float().cpu())
        taken += 1
    return taken


def decode_errors(gpu, ref, gpu_cache, ref_cache, ids: list[int]) -> tuple[list[float], int]:
    """One decode step per id on both runtimes -> (each step's relative error of the GPU's logits
    against the reference's, the number of steps whose greedy ids differ)."""
    errs, disagree = [], 0
    for t in ids:
        lg = gpu.decode(gpu_cache, torch.tensor([t], device=gpu.device))[0].float().cpu()
        lc = ref.decode(ref_cache, torch.tensor([t]))[0]
        errs.append(rel(lg, lc))
        disagree += int(lg.argmax() != lc.argmax())
    return errs, disagree
