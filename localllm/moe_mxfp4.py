"""gpt-oss's released safetensors (openai/gpt-oss-20b / 120b): experts held in MXFP4, kept as MXFP4.

The folder's config.json has quantization_config {"quant_method": "mxfp4", ...}, and each layer stores
  mlp.experts.gate_up_proj_blocks (E, 2F, C/32, 16) uint8, gate_up_proj_scales (E, 2F, C/32) uint8
  mlp.experts.down_proj_blocks    (E, C, F/32, 16) uint8, down_proj_scales    (E, C, F/32) uint8
rows = output features, blocks along the input (the dense checkpoint's x @ W transposed back), gate and
up rows interleaved (gate 0::2, up 1::2, as transformers' GptOssExperts reads gate_up[..., ::2] /
[..., 1::2] after convert_moe_packed_tensors transposes). Each (blocks, scales) pair becomes our
(E * rows, C/32 * 17) GGUF MXFP4 rows (quantize/mxfp4.from_hf_blocks: the bytes llama.cpp's converter
writes), gate/up de-interleaved by selecting rows: ExpertLinear's layout on every backend. No value
is decoded to float here; the checkpoint is read expert by expert, each slice once (gate and up from
one pass: read_mxfp4_tensors), so a 120b layer's ~1 GB gate_up is never held twice.

moe_weights.py names the parts (Part.how: `mxfp4[_even|_odd]` for blocks, `mxfp4_scales[...]` for
scales); this module pairs and checks them (assemble_mxfp4) and reads them (read_mxfp4). It works on
the parts only (no import of moe_weights: that module calls this one).
"""

from __future__ import annotations

from pathlib import Path

import torch

from localllm.quantize.mxfp4 import from_hf_blocks

from .errors import LocalLLMError

BLOCK = 32  # values per MXFP4 block; 16 bytes of codes in the checkpoint, 17 (with the scale) in GGUF
DTYPE = "MXFP4"  # what check_hf_folder reports for an assembled pair (its parts are safetensors U8)


def is_mxfp4_how(how: str) -> bool:
    return how.startswith("mxfp4")


def is_mxfp4(parts) -> bool:
    """A source's parts (moe_weights.MoESource.parts) hold MXFP4 blocks and scales."""
    return bool(parts) and is_mxfp4_how(parts[0].how)


def _scales_key(key: str) -> str:
    return key.removesuffix("_blocks") + "_scales"


def assemble_mxfp4(parts: list, folder_name: str) -> tuple[tuple, tuple[int, ...]]:
    """The parts of one of our expert tensors (a blocks part and a scales part, same row selection)
    -> ((blocks, scales), our shape (E, rows, C)), checked: both present and once, uint8, blocks
    (E, R, G, 16) with scales (E, R, G), R even when gate/up are interleaved."""
    blocks = [p for p in parts if not p.how.startswith("mxfp4_scales")]
    scales = [p for p in parts if p.how.startswith("mxfp4_scales")]
    if len(blocks) > 1 or len(scales) > 1:
        twice = (blocks if len(blocks) > 1 else scales)[1]
        raise LocalLLMError(f"tensor {twice.key!r} appears twice in {folder_name}")
    if not scales:
        raise LocalLLMError(f"tensor {blocks[0].key!r} in {folder_name} has no {_scales_key(blocks[0].key)!r}:"
                            " MXFP4 blocks need their scales")
    if not blocks:
        raise LocalLLMError(f"tensor {scales[0].key!r} in {folder_name} has no"
                            f" {scales[0].key.removesuffix('_scales') + '_blocks'!r}: MXFP4 scales without their blocks")
    b, s = blocks[0], scales[0]
    for p in (b, s):
        if p.dtype != "U8":
            raise LocalLLMError(f"tensor {p.key!r} in {folder_name} has dtype {p.dtype}, expected U8 (MXFP4)")
    if len(b.shape) != 4 or b.shape[-1] != BLOCK // 2 or tuple(s.shape) != tuple(b.shape[:-1]):
        raise LocalLLMError(f"tensors {b.key!r} {tuple(b.shape)} and {s.key!r} {tuple(s.shape)} in {folder_name}"
                            " are no MXFP4 pair: expected blocks (experts, rows, groups, 16) and scales"
                            " (experts, rows, groups)")
    e, rows, groups, _ = b.shape
    if b.how != "mxfp4":  # interleaved gate/up rows
        if rows % 2:
            raise LocalLLMError(f"tensor {b.key!r} in {folder_name} has shape {tuple(b.shape)}, whose {rows}"
                                " rows do not split into interleaved gate and up rows")
        rows //= 2
    return (b, s), (e, rows, groups * BLOCK)


def _select(rows: torch.Tensor, how: str) -> torch.Tensor:
    """An expert's (R, ...) rows -> the rows this part takes: all, the even (gate) or the odd (up)."""
    if how.endswith("_even"):
        return rows[0::2]
    if how.endswith("_odd"):
        return rows[1::2]
    return rows


def read_mxfp4(parts) -> torch.Tensor:
    """(blocks, scales) parts (assemble_mxfp4's order) -> uint8 (E * rows, G * 17) GGUF MXFP4 rows."""
    return read_mxfp4_tensors({"": parts})[""]


def read_mxfp4_tensors(sources: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """name -> (blocks, scales) parts => name -> uint8 (E * rows, G * 17) GGUF MXFP4 rows. Sources of one
    checkpoint pair (gpt-oss's gate and up: the even and odd rows of gate_up_proj_blocks) are read in
    one pass: each expert's slice is read and converted once, and its rows go to each tensor's output."""
    groups: dict[tuple, dict[str, tuple]] = {}
    for name, parts in sources.items():
        b, s = parts
        groups.setdefault((str(b.path), b.key, str(s.path), s.key), {})[name] = parts
    out = {}
    for group in groups.values():
        out |= _read_group(group)
    return out


def _read_group(group: dict[str, tuple]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    b, s = next(iter(group.values()))
    e, rows, groups, _ = b.shape
    outs = {name: (parts[0].how, torch.empty(e * (rows if parts[0].how == "mxfp4" else rows // 2),
                                              groups * (BLOCK // 2 + 1), dtype=torch.uint8))
            for name, parts in group.items()}
    try:
        with safe_open(str(b.path), framework="pt") as fb, safe_open(str(s.path), framework="pt") as fs:
            bs, ss = fb.get_slice(b.key), fs.get_slice(s.key)
            for i in range(e):  # one expert's (rows, G, 16) codes and (rows, G) scales at a time
                expert = from_hf_blocks(bs[i:i + 1][0], ss[i:i + 1][0])  # (rows, G * 17)
                for how, t in outs.values():
                    n = t.shape[0] // e
                    t[i * n:(i + 1) * n] = _select(expert, how)
    except (SafetensorError, OSError) as err:
        raise LocalLLMError(f"cannot read tensor {b.key!r} and {s.key!r} from {Path(b.path).name}: {err}") from None
    return {name: t for name, (_, t) in outs.items()}


def check_quant_config(raw_config: object, has_mxfp4: bool, folder_name: str) -> None:
    """config.json's quantization_config against the tensors: "mxfp4" exactly when the experts are
    blocks/scales (transformers reads blocks only under it, and dense experts never under it)."""
    quant = raw_config.get("quantization_config") if isinstance(raw_config, dict) else None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if has_mxfp4 and method != "mxfp4":
        raise LocalLLMError(f"{folder_name}: its experts are MXFP4 (_blocks / _scales) but config.json's"
                            f" quantization_config says quant_method {method!r}, expected 'mxfp4'")
    if method == "mxfp4" and not has_mxfp4:
        raise LocalLLMError(f"{folder_name}: config.json says quant_method 'mxfp4' but the experts are not"
                            " stored as MXFP4 _blocks / _scales")
