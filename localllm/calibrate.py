"""Calibration: the measurements behind `localllm quantize --target-bpw` (quantize/allocate.py).

- `imatrix.collect_imatrix` (localllm/imatrix.py): per weight matrix W (out, in) consumed by a linear
  layer, the importance of each input column j, I_j = E[x_j^2] over all calibration tokens (llama.cpp's
  imatrix); per expert for the expert stacks of a mixture of experts, over the tokens routed to it
  (E, in). For a rounding error dW, E||dW x||^2 = tr(dW E[x x^T] dW^T) ~ sum_j I_j ||dW[:, j]||^2 (the
  diagonal of the input covariance, as llama.cpp keeps it): `weighted_error`.
- `sensitivity.measure_sensitivity` (localllm/sensitivity.py): the model's real response to one
  tensor's error, as the mean KL(base || perturbed) of its next-token distributions over every
  calibration position, one tensor at a time.
- `predict_losses`: the model the allocator uses to extend one measured probe to every candidate type.

Names are GGUF tensor names ("blk.0.attn_q.weight", "output.weight"); weights.to_module_name maps them
onto the model's parameters.
"""

from __future__ import annotations

from importlib import resources
from typing import Callable, Hashable, Mapping

import torch

from .cache import KVCache, make_cache
from .fused import file_shapes
from .model import Linear, Transformer
from .weights import gguf_name, to_module_name

# progress(stage, done, total), as localllm.progress.stage_progress's report takes it:
# ("imatrix", chunks done, chunks) and ("sensitivity", tensors done, tensors).
Progress = Callable[[str, int, int], None]


# ---- calibration text ----------------------------------------------------------------------------


def calibration_text() -> str:
    """The packaged calibration text (localllm/data/calibration.txt)."""
    return resources.files("localllm").joinpath("data/calibration.txt").read_text(encoding="utf-8")


def calibration_chunks(tokenizer, text: str, ctx: int, max_chunks: int) -> list[list[int]]:
    """Consecutive chunks of exactly ctx token ids; each starts with BOS when tokenizer.add_bos.

    The text is tokenized once, without special-token parsing (as llama.cpp's imatrix), and BOS is
    inserted before each chunk's ctx - 1 text tokens (llama.cpp overwrites the first token instead:
    here no text token is lost). A partial last chunk is dropped."""
    bos = [tokenizer.bos_id] if tokenizer.add_bos else []
    body = ctx - len(bos)
    if body < 1 or max_chunks < 1:
        raise ValueError(f"need ctx > {len(bos)} and max_chunks >= 1, got ctx {ctx}, max_chunks {max_chunks}")
    ids = tokenizer.encode(text, add_bos=False, parse_special=False)
    n = min(len(ids) // body, max_chunks)
    if n == 0:
        raise ValueError(f"calibration text too short: {len(ids)} tokens, one chunk of {ctx} needs {body}")
    return [bos + ids[i * body : (i + 1) * body] for i in range(n)]


# ---- names, and a cache for the model's passes --------------------------------------------------


def model_tensors(model: Transformer) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape (numpy order, (out, in) for matrices) of every weight of the model."""
    out = {gguf_name(n): tuple(p.shape) for n, p in model.named_parameters()}
    for n, m in model.named_modules():  # weights held quantized (CUDA) are no parameters
        if isinstance(m, Linear) and m.qweight is not None:
            out[gguf_name(n) + ".weight"] = tuple(m.qweight.shape)
    return file_shapes(model.cfg, out)  # as the checkpoint holds them (Phi-3's fused q|k|v, gate|up)


def get_weight(model: Transformer, name: str) -> torch.nn.Parameter:
    """The parameter of a GGUF name; weights held quantized (CUDA loads) are no parameters."""
    try:
        return model.get_parameter(to_module_name(name))
    except AttributeError:
        raise ValueError(f"the model has no dense weight {name!r} (quantized weights: load on the CPU)") from None


def device_cache(model: Transformer, length: int) -> KVCache:
    """A KV cache of `length` positions in the dtype and on the device of the model's weights."""
    w = model.token_embd.weight
    return make_cache(model.cfg, length, dtype=w.dtype, device=w.device)


# ---- predicting a type's loss from one probe -----------------------------------------------------


def weighted_error(w: torch.Tensor, w_hat: torch.Tensor, importance: torch.Tensor | None) -> float:
    """sum_j importance_j * ||w[:, j] - w_hat[:, j]||^2 for w, w_hat (out, in), importance (in,) or None
    (plain squared error): E||(W - W_hat) x||^2 under the imatrix's diagonal input covariance.

    An expert stack w, w_hat (E, out, in) (or its (E * out, in) rows) with a per-expert importance
    (E, in): the sum over experts of each expert's own weighted error."""
    groups = importance.shape[0] if importance is not None and importance.dim() == 2 else 1
    diff = w.detach().double() - w_hat.detach().double()
    col = diff.reshape(groups, -1, diff.shape[-1]).pow(2).sum(1)  # (groups, in)
    return float(col.sum() if importance is None else (col * importance.double().to(col.device).reshape(groups, -1)).sum())


def predict_losses(sens_kl: float, probe_err: float, errs: Mapping[Hashable, float]) -> dict[Hashable, float]:
    """Each type's predicted KL: sens_kl * err_q / probe_err.

    Why: a weight error dW moves the logits by dz = J dW x (linear in dW for small errors), and the KL
    is second order in dz: KL ~ 1/2 dz^T F dz (F the Fisher matrix of the output distribution). So for
    errors of the same character (block rounding noise, nearly independent across columns and of the
    input), E[KL] scales with E||dW x||^2 ~ weighted_error. One measured probe per tensor
    (sens_kl = its KL at the probe type, probe_err = the probe's weighted_error) fixes that tensor's
    constant J^T F J; every other type's loss follows from its weighted_error alone."""
    if probe_err <= 0:
        if all(e == 0 for e in errs.values()):
            return {q: 0.0 for q in errs}
        raise ValueError("the probe's weighted error is 0: probe with a lossy type")
    return {q: sens_kl * e / probe_err for q, e in errs.items()}


def roundtrip(w: torch.Tensor, qtype, importance: torch.Tensor | None = None, ext=None) -> torch.Tensor:
    """w (out, in) quantized to qtype (a GGUF type) and decoded back, in w's dtype: a ready perturbation.
    ext: the C++ encoders for w's device (kernels/cpu.py encoders_for) or None."""
    from localllm.quantize import dequantize_torch, quantize_tensor

    back = dequantize_torch(quantize_tensor(w.detach().float(), qtype, importance, ext=ext), qtype)
    return back.reshape(w.shape).to(device=w.device, dtype=w.dtype)

