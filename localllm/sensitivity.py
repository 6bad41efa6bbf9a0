"""Sensitivity: the mean KL of the model's next-token distributions when one tensor is perturbed
(localllm/calibrate.py says what the allocator makes of it), measured against one reference run whose
residual stream lets each perturbed run restart at the tensor's own block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .cache import KVCache
from .calibrate import Progress, device_cache, get_weight
from .errors import LocalLLMError
from .model import Transformer


@dataclass
class Reference:
    """The unperturbed run: what KLs compare against, and where a perturbed run restarts. Per chunk:
    resid (L + 1, 1, T, C) fp32, the residual stream entering each block and leaving the last (18 MiB
    for 256 tokens of the 135M default model); z (T, V) fp32 logits and p (T, V) fp32 softmax (8 bytes
    per vocabulary entry and position: 100 MiB for 256 tokens at V = 49152); lse (T,) float64."""

    tokens: list[torch.Tensor]
    resid: list[torch.Tensor]
    z: list[torch.Tensor]
    p: list[torch.Tensor]
    lse: list[torch.Tensor]


def _lse(z: torch.Tensor) -> torch.Tensor:
    """(T, V) fp32 -> (T,) float64 log-sum-exp: exp in fp32, summed in float64 (an fp32 sum over the
    vocabulary leaves ~2e-7 of error in a position's KL; this ~1e-8, and ~1e-11 in the mean)."""
    m = z.max(-1, keepdim=True).values
    return m[:, 0].double() + (z - m).exp().sum(-1, dtype=torch.float64).log()


def _kl(ref: Reference, i: int, zq: torch.Tensor) -> torch.Tensor:
    """(T,) float64 KL(p || q) per position of chunk i, from q's logits zq (T, V) fp32.

    KL = sum_v p_v (log p_v - log q_v) = sum_v p_v (zp_v - zq_v) + lse(zq) - lse(zp)  (sum_v p_v = 1).
    Shift-invariant, so fp32 over the vocabulary suffices (1.3x faster than float64 log_softmaxes, and
    no float64 copy of the reference); the same logits give exactly 0."""
    return (ref.p[i] * (ref.z[i] - zq)).sum(-1).double() + _lse(zq) - ref.lse[i]


def _blocks(model: Transformer, x: torch.Tensor, first: int, cache: KVCache, rope, keep: list | None = None):
    """Run blocks first .. L-1 on x (1, T, C) at positions 0 .. T-1, as Transformer.forward does."""
    for i in range(first, len(model.blk)):
        if keep is not None:
            keep.append(x)
        x = model.blk[i](x, i, cache, 0, *rope[i])
    return x


def _head(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    """The last residual (1, T, C) -> logits (T, V) fp32, as Transformer.forward ends."""
    return model.head(x)[0]


@torch.inference_mode()
def reference_outputs(model: Transformer, chunks: Sequence[Sequence[int]]) -> Reference:
    """One forward pass per chunk of the unperturbed model (reusable across measure_sensitivity calls)."""
    if model.cfg.per_layer_dim:  # _blocks runs layers without Transformer.per_layer_inputs
        raise LocalLLMError("sensitivity measurement does not support per-layer embeddings (Gemma 4 E2B/E4B) yet")
    dev = model.token_embd.weight.device
    cache = device_cache(model, max(len(c) for c in chunks))
    ref = Reference([], [], [], [], [])
    for chunk in chunks:
        tokens, keep = torch.tensor([list(chunk)], device=dev), []
        rope = model.layer_inputs(0, len(chunk), dev)
        x = _blocks(model, model.embed(tokens), 0, cache, rope, keep)
        z = _head(model, x)
        ref.tokens.append(tokens)
        ref.resid.append(torch.stack(keep + [x]))
        ref.z.append(z)
        ref.p.append(torch.softmax(z.double(), -1).float())
        ref.lse.append(_lse(z))
    return ref


def _first_layer(name: str, n_layers: int) -> int | None:
    """Where a run restarts when this tensor changes: its block; L (output, output_norm); None: embedding."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" else None if name == "token_embd.weight" else n_layers


@torch.inference_mode()
def _perturbed_kl(model: Transformer, ref: Reference, first: int | None, cache: KVCache) -> float:
    """Mean KL over all positions of all chunks, restarting each chunk at block `first`."""
    total, count = 0.0, 0
    for i, tokens in enumerate(ref.tokens):
        T = tokens.shape[1]
        rope = model.layer_inputs(0, T, tokens.device)
        x = model.embed(tokens) if first is None else ref.resid[i][first]
        zq = _head(model, _blocks(model, x, first or 0, cache, rope))
        total += _kl(ref, i, zq).sum().item()
        count += T
    return total / count


def measure_sensitivity(model: Transformer, chunks: Sequence[Sequence[int]], tensors: Sequence[str],
                        perturb: Callable[[str, torch.Tensor], torch.Tensor], progress: Progress | None = None,
                        reference: Reference | None = None) -> dict[str, float]:
    """Tensor name -> mean KL(base || model with that one tensor replaced by perturb(name, w)) over
    every position of every chunk (chunks are not read when a reference is given). perturb gets a copy
    of the weight (it may work in place); the original is put back untouched (the same tensor object).

    Cost per tensor: the blocks from its own layer on (earlier ones restart from the reference), the
    output matmul and a few fp32 passes over the logits. 135M default model, 2 x 256 tokens, one core of
    the project's CPU: 0.8 s (last block) to 2.2 s (first block, token_embd), 1.5 s mean, so ~5 min
    for all 211 matrices at one probe type (plus the probe's quantize-dequantize, 0.01-0.35 s). With
    other processes busy on that 2-core machine, two torch threads ran 5-20x slower than one."""
    ref = reference if reference is not None else reference_outputs(model, chunks)
    cache = device_cache(model, max(t.shape[1] for t in ref.tokens))
    out: dict[str, float] = {}
    for k, name in enumerate(tensors):
        p = get_weight(model, name)
        original = p.data
        with torch.no_grad():
            new = perturb(name, original.clone())
        if tuple(new.shape) != tuple(original.shape):
            raise ValueError(f"perturb({name!r}) returned shape {tuple(new.shape)}, expected {tuple(original.shape)}")
        try:
            p.data = new.to(device=original.device, dtype=original.dtype)
            out[name] = _perturbed_kl(model, ref, _first_layer(name, len(model.blk)), cache)
        finally:
            p.data = original
        if progress:
            progress("sensitivity", k + 1, len(tensors))
    return out
