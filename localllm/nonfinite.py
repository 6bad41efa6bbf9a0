"""Non-finite logits: a file with NaN or Inf weights gives all-NaN logits, whose argmax is id 0 (often the
end token), so generation would print nothing and exit 0. generate() checks the first step's logits
(one isfinite over V values) and names the first weight holding NaN or Inf, found by a scan that runs
only then."""

from __future__ import annotations

import torch

from localllm.kernels.linear import dequantize_qweight
from localllm.kernels.qweight import QWeight

from .errors import LocalLLMError
from .model import Linear, Transformer
from .moe import ExpertLinear
from .weights import gguf_name


def matrices(model: Transformer) -> dict[str, torch.Tensor | QWeight]:
    """Module name -> every 2-D weight, dense or quantized: the linears, and the embedding."""
    out = {}
    for name, module in model.named_modules():
        w = module.w if isinstance(module, Linear) else module.weight if name == "token_embd" else None
        if isinstance(module, ExpertLinear):  # E experts' rows as one (E * F, C) matrix
            w = module.qweight if module.qweight is not None else module.weight.reshape(-1, module.weight.shape[-1])
        if w is not None:
            out[f"{name}.weight"] = w
    return out


def dense(w: torch.Tensor | QWeight) -> torch.Tensor:
    return dequantize_qweight(w, torch.float32) if isinstance(w, QWeight) else w.detach()


def nonfinite_tensor(model: Transformer) -> str | None:
    """The GGUF name of the first weight (in the model's order) holding NaN or Inf, or None. Quantized
    weights are decoded one at a time (their block scales can be NaN too)."""
    weights = {**matrices(model), **dict(model.named_parameters())}
    for name, w in weights.items():
        values = dense(w)
        if values.is_floating_point() and not bool(torch.isfinite(values).all()):
            return gguf_name(name)
    return None


def check_vectors(state: dict[str, torch.Tensor]) -> None:
    """Every 1-D tensor of a checkpoint (norm weights, biases, rope factors: a few KB per layer) holds
    finite values, checked at load. A NaN there need not reach the logits (torch's CPU attention can
    drop a NaN query dimension), so the logits check alone would let it pass silently."""
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.dim() == 1 and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise LocalLLMError(f"tensor {gguf_name(name)} holds NaN or Inf values")


def check_logits(model: Transformer, logits: torch.Tensor) -> None:
    """logits: a step's (..., V). One host sync; a non-finite value is one error line."""
    if bool(torch.isfinite(logits).all()):
        return
    name = nonfinite_tensor(model)
    where = f": tensor {name} holds NaN or Inf values" if name else " (every weight is finite: an overflow in the computation)"
    raise LocalLLMError(f"the model's logits are not finite numbers (NaN or Inf){where}")
