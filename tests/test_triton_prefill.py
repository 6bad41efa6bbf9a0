"""kernels/triton_prefill.py under Triton's interpreter against the module ops it replaces on CUDA:
model.RMSNorm, model.rope_rotate + KVCache.update, F.silu(gate) * up. fp16 activations (the
interpreter truncates to bf16 where the GPU rounds; fp16 it rounds like torch)."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
# re-decorate if imported uninterpreted (the base first: the others read its INTERPRET)
for _name in ("triton_base", "triton_epilogue", "triton_prefill"):
    if f"localllm.kernels.{_name}" in sys.modules:
        importlib.reload(sys.modules[f"localllm.kernels.{_name}"])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from localllm.kernels import triton_prefill  # noqa: E402
from localllm.cache import make_cache  # noqa: E402
from localllm.config import ModelConfig  # noqa: E402
from localllm.model import RMSNorm, rope_rotate  # noqa: E402


def test_rmsnorm_rows_matches_module():
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(96, 1e-5).half()
    norm.weight.data = (1 + 0.1 * torch.randn(96, generator=g)).half()
    x = torch.randn(2, 5, 96, generator=g) * 3  # the fp32 residual stream
    want = norm(x).detach()
    got = triton_prefill.rmsnorm_rows(x, norm.weight.data, 1e-5)
    assert got.dtype == torch.float16 and got.shape == x.shape
    # rstd summed in another order: at most one fp16 step apart
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-10 + 1e-6).all()


def test_rope_cache_matches_rope_rotate_and_cache_update():
    cfg = ModelConfig(arch="llama", n_layers=2, dim=64, ffn_dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
                      vocab_size=8, context_length=32, norm_eps=1e-5, rope_theta=10000.0)
    g = torch.Generator().manual_seed(2)
    B, T, start = 2, 5, 3
    q = torch.randn(B, T, 4 * 16, generator=g).half()
    k, v = torch.randn(B, T, 2 * 16, generator=g).half(), torch.randn(B, T, 2 * 16, generator=g).half()
    pos = torch.arange(start, start + T).float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    cos, sin = (pos[:, None] * inv).cos(), (pos[:, None] * inv).sin()
    ref, got = make_cache(cfg, 16, batch=B, dtype=torch.float16), make_cache(cfg, 16, batch=B, dtype=torch.float16)
    qr = rope_rotate(q.view(B, T, 4, 16).transpose(1, 2), cos, sin)
    kr = rope_rotate(k.view(B, T, 2, 16).transpose(1, 2), cos, sin)
    keys_r, vals_r = ref.update(1, start, kr, v.view(B, T, 2, 16).transpose(1, 2))
    qkv = torch.cat((q, k, v), -1)  # as views of one fused q|k|v product
    qg, keys, vals = triton_prefill.rope_cache(*qkv.split([64, 32, 32], -1), got.k[1], got.v[1], start, cos, sin,
                                               4, 2, 16)
    for a, b in ((qg, qr), (keys, keys_r), (vals, vals_r)):  # fused multiply-adds: one fp16 step at most
        assert a.shape == b.shape and ((a.float() - b.float()).abs() <= b.float().abs() * 2**-10 + 1e-3).all()
    assert torch.equal(vals, vals_r) and not got.k[0].any() and not got.k[1][:, :, start + T:].any()


def test_silu_mul_matches_torch():
    g = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(3, 4100, generator=g) * 4).half(), torch.randn(3, 4100, generator=g).half()
    want = F.silu(gate) * up
    interleaved = torch.stack((gate, up), -1).flatten(-2)  # a fused gate/up product's (gate, up) pairs
    for got in (triton_prefill.silu_mul(gate, up), triton_prefill.silu_mul(interleaved)):
        # exp's last bit differs between implementations: one fp16 step, rarely
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-10 + 1e-6).all()
        assert (got != want).float().mean() < 1e-3
