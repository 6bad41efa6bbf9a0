"""IQ4_NL and IQ4_XS encoders: 4-bit indices into a non-linear 16-entry table (KVALUES), one scale per
32 values (IQ4_NL: fp16; IQ4_XS: a 6-bit scale under a super-block fp16). Bit layouts and decoders:
quantize/formats/iq_types.py.

Reference: llama.cpp ggml/src/ggml-quants.c quantize_row_iq4_nl_impl (quantize_iq4_nl and
quantize_iq4_xs, which llama-quantize calls with or without an imatrix, ntry = 7). Repeated here
operation by operation in float32, sums taken left to right as the C loops take them, so that the
bytes equal llama-quantize's (tests/test_iq4.py checks them against its output):

    sigma2 = 2 / S * sum x^2 over the super-block (S = 32 for IQ4_NL, 256 for IQ4_XS)
    weight = qw * sqrt(sigma2 + x^2) with an imatrix qw, else x^2
    per 32 values: max = the value of largest |x| (the first), d = max / 127; codes L = nearest table
      entry of x / d (best_index_int8); d = sum w q x / sum w q^2; then for t in -7..7 the scale
      1 / id with id = (t - 127) / max is tried, kept when (sum w q x)^2 > best * sum w q^2
    IQ4_NL: d stored as fp16, codes redone with 1 / d (float32, not the fp16 value)
    IQ4_XS: D = -(the sub-block scale of largest |d|) / 32 stored as fp16; each sub-block's
      l = round(d / D) clamped to [-32, 31] stored + 32; codes redone with 1 / (D * l)
"""

from __future__ import annotations

import torch

from .pack import fp16_bytes, pack_nibbles

# ggml's kvalues_iq4nl (gguf-py's IQ4_NL.kvalues)
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
GROUP_MAX_EPS = 1e-15
NTRY = 7


def best_index(x: torch.Tensor) -> torch.Tensor:
    """x float32 -> int64 index of the nearest KVALUES entry, as ggml's best_index_int8: the upper
    neighbour on a tie; below the first or above the last entry, that entry.

    The entries are integers, so x >= entry k exactly when floor(x) >= entry k: the first entry above x
    (mu) is looked up by floor(x) in a 243-slot table (faster than a search), then the nearer of
    entries mu - 1 and mu is taken with ggml's float comparison."""
    table = torch.tensor(KVALUES, dtype=torch.float32, device=x.device)
    slots = torch.arange(KVALUES[0], KVALUES[-1] + 1, device=x.device, dtype=torch.float32)  # -127 .. 113
    first_above = (slots[:, None] >= table[None, :]).sum(-1).clamp(1, 15)  # for floor(x) = slot
    f = torch.floor(x).clamp(KVALUES[0], KVALUES[-1]) - KVALUES[0]
    mu = first_above[f.long()]
    lower = (x - table[mu - 1]) < (table[mu] - x)
    return torch.where(lower, mu - 1, mu)


def _seq_sum(terms: torch.Tensor) -> torch.Tensor:
    """(..., n) float32 -> (...,) the sum taken left to right in float32, as a C loop does."""
    s = torch.zeros(terms.shape[:-1], dtype=torch.float32, device=terms.device)
    for j in range(terms.shape[-1]):
        s = s + terms[..., j]
    return s


def _weighted_sums(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sum w q x and sum w q^2 (left to right, float32) for codes idx of x (..., 32)."""
    q = torch.tensor(KVALUES, dtype=torch.float32, device=x.device)[idx]
    wq = w * q
    return _seq_sum(wq * x), _seq_sum(wq * q)


def sub_block_scales(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x, weight (N, 32) float32 -> (N,) the scale each 32 values' search keeps (0: an all-zero block)."""
    ax = x.abs()
    first = ax.argmax(-1, keepdim=True)  # the first largest |x|
    amax, vmax = ax.gather(-1, first)[:, 0], x.gather(-1, first)[:, 0]
    zero = amax < GROUP_MAX_EPS
    vmax = torch.where(zero, torch.ones_like(vmax), vmax)  # no division by 0 (the result is discarded)
    d = -vmax / float(KVALUES[0])
    sumqx, sumq2 = _weighted_sums(x, weight, best_index((1 / d)[:, None] * x))
    d = torch.where(sumq2 > 0, sumqx / sumq2, torch.zeros_like(sumqx))
    best = d * sumqx
    for t in range(-NTRY, NTRY + 1):
        inv = float(t + KVALUES[0]) / vmax
        sqx, sq2 = _weighted_sums(x, weight, best_index(inv[:, None] * x))
        better = (sq2 > 0) & (sqx * sqx > best * sq2)
        d = torch.where(better, sqx / torch.where(better, sq2, torch.ones_like(sq2)), d)
        best = torch.where(better, d * sqx, best)
    return torch.where(zero, torch.zeros_like(d), d)


def _weights(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """x, qw (B, S) -> llama.cpp's per-value weights (sigma2 over each whole super-block of S)."""
    if qw is None:
        return x * x
    sigma2 = _seq_sum(x * x) * (2.0 / x.shape[-1])
    return qw * torch.sqrt(sigma2[:, None] + x * x)


def _inv(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, 1 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))


def _pack_codes(L: torch.Tensor) -> torch.Tensor:
    """(B, n * 32) codes -> (B, n * 16) bytes: per 32 values, L[j] | L[j + 16] << 4."""
    g = L.reshape(L.shape[0], -1, 2, 16)
    return pack_nibbles(g[:, :, 0], g[:, :, 1]).reshape(L.shape[0], -1)


def encode_iq4_nl(x: torch.Tensor, qw: torch.Tensor | None) -> list[torch.Tensor]:
    """(B, 32) float32 values (and importance or None) -> [(B, 18) bytes]: fp16 d, 16 code bytes."""
    x = x.float()
    d = sub_block_scales(x, _weights(x, qw))
    L = best_index(_inv(d)[:, None] * x)
    return [torch.cat((fp16_bytes(d[:, None]), _pack_codes(L)), dim=-1)]


def encode_iq4_xs(x: torch.Tensor, qw: torch.Tensor | None) -> list[torch.Tensor]:
    """(B, 256) float32 values (and importance or None) -> [(B, 136) bytes]: fp16 d, scales_h (uint16
    LE: 2 high bits of sub-block s at bits 2s), scales_l (4 low bits, two sub-blocks a byte), 128 code bytes."""
    x = x.float()
    B = x.shape[0]
    w = _weights(x, qw)
    scales = sub_block_scales(x.reshape(-1, 32), w.reshape(-1, 32)).reshape(B, 8)
    first = scales.abs().argmax(-1, keepdim=True)  # the first largest |d|
    dmax = scales.gather(-1, first)
    big = dmax.abs() > 0  # amax_scale starts at 0: all-zero scales leave max_scale 0
    dmax = torch.where(big, dmax, torch.zeros_like(dmax))
    D = -dmax / 32
    l = torch.round(_inv(D) * scales).clamp(-32, 31)  # nearest_int: round half to even
    dl = D * l
    L = best_index(_inv(dl).reshape(B, 8, 1) * x.reshape(B, 8, 32)).reshape(B, 256)
    u = (l + 32).to(torch.int32)
    low = (u & 0xF).to(torch.uint8)
    scales_l = (low[:, 0::2] | (low[:, 1::2] << 4)).to(torch.uint8)
    high = ((u >> 4) << (2 * torch.arange(8, device=x.device, dtype=torch.int32))).sum(-1)
    scales_h = torch.stack((high & 0xFF, high >> 8), dim=-1).to(torch.uint8)
    return [torch.cat((fp16_bytes(D), scales_h, scales_l, _pack_codes(L)), dim=-1)]
