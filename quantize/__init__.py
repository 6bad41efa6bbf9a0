"""GGUF block formats: encoders (quantize_tensor), torch decoders (dequantize_torch), gguf's decoding (dequantize).

Each type's facts, encoder and decoder are its Format in one table, FORMATS (quantize/formats/).
The names below are imported on first use (PEP 562), so that `localllm.quantize.plan`, `.presets`,
`.writer` import without torch: `localllm quantize`'s torch-free preset path (commands/quantize_native.py).
"""

from importlib import import_module

_HOMES = {
    "quantize_tensor": ".blocks",
    "dequantize_torch": ".decode",
    "BLOCK_SIZES": ".formats",
    "FORMATS": ".formats",
    "SUPPORTED_TYPES": ".formats",
    "UnsupportedTypeError": ".formats",
    "bits_per_weight": ".formats",
    "dequantize": ".formats",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value
