"""Attention over the cache, with the variants of the families we run.

Shapes: q (B, H, T, D); keys, values (B, Hkv, S, D) (S = start + T cache rows); mask bool (T, S),
True = visible, or None = plain causal from position 0 (T > 1) / everything (T = 1).

Plain attention goes through torch's SDPA. Soft-capped scores (Gemma 2) and sink logits (gpt-oss) take
the explicit path, which must match transformers' eager attention of those models: scores in fp32,
times the scale, c * tanh(s / c), masked, a per-head sink logit joins the softmax and is dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig


def attention_mask(positions: torch.Tensor, n_keys: int, window: int | None) -> torch.Tensor | None:
    """positions (T,) of the queries -> (T, n_keys) bool: key j visible to query i iff j <= i and, with a
    window, i - window < j (transformers' sliding_window_causal, llama.cpp's SWA rule); None where
    plain causal from 0 (or a single query seeing every key) says the same."""
    T, start = positions.shape[0], n_keys - positions.shape[0]
    if window is None or n_keys <= window:
        if start == 0 or T == 1:
            return None
        keys = torch.arange(n_keys, device=positions.device)
        return keys[None, :] <= positions[:, None]
    keys = torch.arange(n_keys, device=positions.device)
    return (keys[None, :] <= positions[:, None]) & (keys[None, :] > positions[:, None] - window)


def attend(cfg: ModelConfig, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           mask: torch.Tensor | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """-> (B, H, T, D) in q's dtype."""
    T = q.shape[2]
    if cfg.attn_softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None and T > 1,
                                              scale=cfg.attn_scale, enable_gqa=True)
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scale = cfg.attn_scale if cfg.attn_scale is not None else q.shape[-1] ** -0.5
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    if cfg.attn_softcap is not None:
        scores = torch.tanh(scores / cfg.attn_softcap) * cfg.attn_softcap
    if mask is None and T > 1:
        mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)
    B, H = scores.shape[:2]
    sink = sinks.float().view(1, H, 1, 1).expand(B, H, T, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return (probs @ v).to(q.dtype)


class RowKeys:
    """The mask argument of a decode_slots step (localllm/slots.py): row b of the batch is one token of
    cache slot slots[b] at position ends[b] - 1, seeing that slot's keys [0, ends[b]) (within `window`
    on a sliding layer). Rows past len(slots) are padding: no keys, output zero.

    Each row runs `attend` as a batch-1 decode step of that slot would (the same keys, the same mask), so
    its output does not depend on the other rows (batch invariance: a fused padded attention would sum
    over a different number of masked keys per composition and round differently)."""

    def __init__(self, slots: list[int], ends: list[int], window: int | None):
        self.slots, self.ends, self.window = slots, ends, window

    def attend(self, cfg: ModelConfig, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               sinks: torch.Tensor | None) -> torch.Tensor:
        """q (N, H, 1, D); keys, values: the layer's whole cache buffers (n slots, Hkv, S, D) -> (N, H, 1, D)."""
        out = torch.zeros_like(q)
        for b, (s, end) in enumerate(zip(self.slots, self.ends)):
            mask = attention_mask(torch.tensor([end - 1], device=q.device), end, self.window)
            out[b:b + 1] = attend(cfg, q[b:b + 1], keys[s:s + 1, :, :end], values[s:s + 1, :, :end], mask, sinks)
        return out


class SegmentKeys:
    """The mask argument of a prefill_slots step (localllm/slots.py): the step's T rows (batch 1) are
    segments, segment i the prompt of slot slots[i] at positions [starts[i], starts[i] + lengths[i]),
    causal within its own prompt only, over that slot's keys [0, its end) (within `window` on a sliding
    layer). Each segment runs `attend` with the keys and mask a prefill of that slot alone would use
    (Transformer.layer_inputs'), so its rows do not depend on the other segments."""

    def __init__(self, slots: list[int], starts: list[int], lengths: list[int], window: int | None):
        self.slots, self.starts, self.lengths, self.window = slots, starts, lengths, window

    def attend(self, cfg: ModelConfig, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               sinks: torch.Tensor | None) -> torch.Tensor:
        """q (1, H, T, D); keys, values: the layer's whole cache buffers (n slots, Hkv, S, D) -> (1, H, T, D)."""
        out, a = torch.empty_like(q), 0
        for s, start, n in zip(self.slots, self.starts, self.lengths):
            end = start + n
            mask = attention_mask(torch.arange(start, end, device=q.device), end, self.window)
            out[:, :, a:a + n] = attend(cfg, q[:, :, a:a + n], keys[s:s + 1, :, :end], values[s:s + 1, :, :end],
                                        mask, sinks)
            a += n
        return out


class SlotMaskKeys:
    """The mask argument of a padded prompt pass (backends/cuda_prompt.py): the step's n Tb rows (batch
    1) are n prompts of Tb rows, prompt i in the slot held by the device tensor slot[i] (n,), seeing that
    slot's keys under mask[i] (n, Tb, S) over its whole capacity S (device tensors: the pass is a
    captured graph that serves any slots and starts). Each prompt attends as a batch of its own."""

    def __init__(self, slot: torch.Tensor, mask: torch.Tensor):
        self.slot, self.mask = slot, mask

    def attend(self, cfg: ModelConfig, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               sinks: torch.Tensor | None) -> torch.Tensor:
        """q (1, H, n Tb, D); keys, values: the layer's whole cache buffers (slots, Hkv, S, D) -> (1, H, n Tb, D)."""
        _, h, t, d = q.shape
        n = self.slot.shape[0]
        qn = q[0].reshape(h, n, t // n, d).transpose(0, 1)  # (n, H, Tb, D)
        y = attend(cfg, qn, keys.index_select(0, self.slot), values.index_select(0, self.slot), self.mask[:, None], sinks)
        return y.transpose(0, 1).reshape(1, h, t, d)
