"""The Fisher diagonal of the model's output distribution, on chosen rows of chosen matrices.

F_ij = E[(d log p(y) / dW_ij)^2] with y sampled from the model itself, summed over the positions of a
calibration chunk (the Fisher of the whole chunk's output) and averaged over chunks (mixed.py says how
it predicts a quantization's loss). mixed.plan_mixed reads F only on the SAMPLE_ROWS rows of each
tensor that its sampled losses round-trip, so only those rows are kept: (k, cols) per matrix instead
of a float32 copy of every weight (32 GB for an 8B model).

Memory: the gradients are never held all at once. Each parameter's gradient is squared into its rows'
sums as soon as backward has accumulated it (Tensor.register_post_accumulate_grad_hook; autograd runs a
leaf's accumulation as soon as its gradient is complete, before the next layer's backward), then
dropped: the peak is the model, the chunk's activations and about one gradient. Only the matrices asked
for require gradients, so backward computes no other weight's gradient.

The sums are today's full diagonal's, bit for bit (tests/test_fisher_rows.py): the same gradient of each
parameter (autograd sums a parameter's uses in one buffer before accumulating, as torch.autograd.grad
does), the same float32 ops per value, the same order over chunks.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from .cache import KVCache, make_cache


def fisher_rows(model, chunks: Sequence[Sequence[int]], rows: Mapping[str, torch.Tensor | None],
                progress: Callable[[int, int], None] = lambda done, total: None, seed: int = 0
                ) -> dict[str, torch.Tensor]:
    """Module parameter name -> its Fisher diagonal on `rows[name]` (row indices of W.reshape(-1, cols):
    an expert stack (E, F, C) has E * F rows), float32 (len(rows), cols); None: every value, W's shape.

    Labels: one generator seeded `seed`, on the model's device, drawn through the chunks in order.
    A parameter no token reaches gets no gradient: 0 (an expert stack's unrouted expert: its rows 0)."""
    params = dict(model.named_parameters())
    wanted = {n: params[n] for n in rows}
    device = model.token_embd.weight.device
    sums = {n: torch.zeros_like(p, dtype=torch.float32) if rows[n] is None
            else torch.zeros(len(rows[n]), p.shape[-1], dtype=torch.float32, device=p.device)
            for n, p in wanted.items()}
    index = {n: None if r is None else r.to(wanted[n].device) for n, r in rows.items()}

    def square_into(name: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:  # p.grad: this chunk's whole gradient of p
            g, p.grad = p.grad, None
            if index[name] is not None:
                g = g.reshape(-1, g.shape[-1])[index[name]]
            sums[name] += g.float().pow(2) / len(chunks)
        return hook

    gen = torch.Generator(device=device).manual_seed(seed)
    handles = []
    with torch.enable_grad():
        try:
            for n, p in wanted.items():
                p.grad = None
                p.requires_grad_(True)
                handles.append(p.register_post_accumulate_grad_hook(square_into(n)))
            for i, ids in enumerate(chunks):
                tokens = torch.tensor([list(ids)], device=device)
                logp = model(tokens, layerwise_cache(model, len(ids)), 0)[0].log_softmax(-1)  # (T, V)
                y = torch.multinomial(logp.detach().exp(), 1, generator=gen)  # (T, 1)
                logp.gather(1, y).sum().backward()
                del logp
                progress(i + 1, len(chunks))
        finally:
            for h in handles:
                h.remove()
            for p in wanted.values():
                p.requires_grad_(False)
                p.grad = None
    return sums


def fisher_diagonal(model, chunks: Sequence[Sequence[int]], progress: Callable[[int, int], None] = lambda done, total: None,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """Every matrix and expert stack's whole Fisher diagonal (W's shape): fisher_rows of all rows."""
    names = [n for n, p in model.named_parameters() if p.dim() in (2, 3)]
    return fisher_rows(model, chunks, dict.fromkeys(names), progress, seed)


def layerwise_cache(model, length: int) -> KVCache:
    """A cache whose layers are separate tensors: autograd then sees each written once (one shared
    (L, ...) buffer would be modified in place after earlier layers saved views of it)."""
    c = make_cache(model.cfg, length, dtype=model.token_embd.weight.dtype, device=model.token_embd.weight.device)
    if isinstance(c.k, list):  # layered already (Gemma 4); its KV-shared layers must keep aliasing their source
        return c
    return KVCache([k.clone() for k in c.k], [v.clone() for v in c.v])
