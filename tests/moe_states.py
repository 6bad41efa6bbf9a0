"""Expert stacks of a synthetic state (localllm.synthetic.synthetic_state) in another GGUF type: gpt-oss's
GGUF files hold their experts as MXFP4 and the rest as Q8_0 / F32 (tests/test_triton_moe_decode.py,
tests/gpu/test_gpu_moe_graph.py)."""

from __future__ import annotations

import gguf
import torch

from localllm.quantize import dequantize_torch, quantize_tensor
from localllm.weights import QuantizedTensor


def experts_as(state: dict, qtype: gguf.GGMLQuantizationType) -> dict:
    """state with every expert stack (`*_exps.weight`) re-quantized to qtype from its decoded values."""
    out = {}
    for name, v in state.items():
        if "_exps." in name and name.endswith(".weight"):
            dense = dequantize_torch(v.data, v.qtype) if isinstance(v, QuantizedTensor) else v.reshape(-1, v.shape[-1])
            v = QuantizedTensor(qtype, torch.from_numpy(quantize_tensor(dense.float().cpu(), qtype)))
        out[name] = v
    return out
