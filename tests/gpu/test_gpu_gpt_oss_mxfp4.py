"""The released gpt-oss safetensors layout (MXFP4 experts as _blocks / _scales) on CUDA: the folder
loads with its experts as MXFP4 QWeights and runs as the MXFP4 GGUF of the same blocks does
(tests/tiny_mxfp4.py writes both from one quantization; tests/test_gpt_oss_mxfp4.py checks them on
the CPU against each other and against transformers). Same rows, same dense values, same kernels:
the logits agree to 1e-5 and greedy decoding gives the same ids.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from tiny_tokenizer import vocab_size
import tiny_mxfp4 as tx

from .gpu_helpers import random_ids, rel

Q = gguf.GGMLQuantizationType
PROMPT, STEPS = 10, 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.inference_mode()
def test_cuda_mxfp4_folder_runs_as_its_gguf(tmp_path, dtype):
    from localllm.load import load_model

    folder = tx.write_released_folder(tmp_path / "hf")
    path = tx.write_mxfp4_gguf(tmp_path / "mxfp4.gguf")
    a = load_model(str(folder), "cuda", dtype).runtime
    b = load_model(str(path), "cuda", dtype).runtime
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        qw = getattr(a.model.blk[0].moe, name).qweight
        assert qw is not None and qw.qtype == Q.MXFP4, name
    ids = random_ids(vocab_size(), PROMPT, seed=3)
    ca, cb = a.new_cache(32), b.new_cache(32)
    la, lb = a.prefill(ca, [ids], 0)[0].float(), b.prefill(cb, [ids], 0)[0].float()  # (V,)
    assert rel(la, lb) < 1e-5
    ta, tb = int(la.argmax()), int(lb.argmax())
    for _ in range(STEPS):  # greedy: each feeds its own choice
        assert ta == tb
        la = a.decode(ca, torch.tensor([ta], device=a.device))[0].float()
        lb = b.decode(cb, torch.tensor([tb], device=b.device))[0].float()
        assert rel(la, lb) < 1e-5
        ta, tb = int(la.argmax()), int(lb.argmax())
