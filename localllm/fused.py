"""Checkpoint tensors that hold several of our weights: Phi-3's fused attention and MLP inputs.

Phi-3 (HF `qkv_proj` / `gate_up_proj`; llama.cpp's converter writes them as `blk.N.attn_qkv.weight` and
`blk.N.ffn_up.weight` unchanged) stores q|k|v rows in one matrix (q_dim + 2 kv_dim, dim) and gate|up
rows in one (2 ffn_dim, dim), gate first: transformers' Phi3MLP chunks gate, up in that order, and
llama.cpp's phi3 graph runs LLM_FFN_SWIGLU on the fused ffn_up (silu of the first half times the second).
The loader checks the file's tensors against file_shapes (the fused layout) and splits them into our
attn_q / attn_k / attn_v and ffn_gate / ffn_up rows (whole rows: a quantized row is whole blocks, so
the raw rows split the same way) before the model is built.
"""

from __future__ import annotations

from .config import ModelConfig

FUSED_ARCHS = frozenset({"phi3"})  # architectures whose checkpoints hold fused q|k|v and gate|up


def file_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """shapes: our tensor set (validate.expected_shapes) -> the set a checkpoint of cfg's architecture
    holds: for FUSED_ARCHS, attn_qkv and the 2*ffn_dim ffn_up in place of attn_q/k/v and ffn_gate/up."""
    if cfg.arch not in FUSED_ARCHS:
        return shapes
    out = {}
    for name, shape in shapes.items():
        parts = name.split(".")
        if parts[0] != "blk" or parts[2] not in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"):
            out[name] = shape
        elif parts[2] == "attn_q":
            out[f"blk.{parts[1]}.attn_qkv.{parts[3]}"] = (cfg.q_dim + 2 * cfg.kv_dim, *shape[1:])
        elif parts[2] == "ffn_up":
            out[name] = (2 * cfg.ffn_dim, *shape[1:])
    return out


def split_rows(cfg: ModelConfig, name: str, rows) -> list[tuple[str, object]]:
    """A checkpoint tensor (GGUF name, value whose dim 0 are the output rows) -> [(our GGUF name,
    rows)]: the fused ones split, any other passed through. rows: a torch tensor, or the uint8 block
    rows of a quantized one (anything sliceable by rows)."""
    parts = name.split(".")
    if cfg.arch not in FUSED_ARCHS or parts[0] != "blk" or parts[2] not in ("attn_qkv", "ffn_up"):
        return [(name, rows)]
    i, suffix = parts[1], ".".join(parts[3:])
    if parts[2] == "ffn_up":
        f = cfg.ffn_dim
        return [(f"blk.{i}.ffn_gate.{suffix}", rows[:f]), (f"blk.{i}.ffn_up.{suffix}", rows[f:])]
    q, kv = cfg.q_dim, cfg.kv_dim
    return [(f"blk.{i}.attn_q.{suffix}", rows[:q]), (f"blk.{i}.attn_k.{suffix}", rows[q:q + kv]),
            (f"blk.{i}.attn_v.{suffix}", rows[q + kv:])]


def fused_parts(cfg: ModelConfig, name: str) -> list[str]:
    """A checkpoint tensor's GGUF name -> the names of our tensors its rows hold, in row order (itself
    when not fused): what a per-tensor statistic of the file's tensor joins (mixed.plan_mixed)."""
    return [n for n, _ in split_rows(cfg, name, _Names())]


class _Names:
    """Stands in for rows in split_rows when only the names are wanted."""

    def __getitem__(self, _):
        return None


def file_imatrix(cfg: ModelConfig, imatrix: dict) -> dict:
    """An imatrix keyed by our tensors' names -> keyed by the checkpoint's: a fused tensor takes its
    first part's (q, k, v read the same input, so do gate and up)."""
    if cfg.arch not in FUSED_ARCHS:
        return imatrix
    out = {}
    for name, value in imatrix.items():
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in ("attn_q", "ffn_gate"):
            out[f"blk.{parts[1]}.{'attn_qkv' if parts[2] == 'attn_q' else 'ffn_up'}.{'.'.join(parts[3:])}"] = value
        elif not (parts[0] == "blk" and parts[2] in ("attn_k", "attn_v", "ffn_up")):
            out[name] = value
    return out
