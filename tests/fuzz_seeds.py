"""The fuzzer's valid starting points, written once per run into its work folder: tiny GGUF models in
several tensor types (F32, F16, Q8_0, Q4_0 and one with every type the runtime reads, K-quants
included), tiny Hugging Face folders (sharded with an index, single file, f16, a released gpt-oss's
MXFP4 experts), and the list of
vocabularies for the tokenizer target (tests/data/vocab plus the default model)."""

from __future__ import annotations

from pathlib import Path

SMALL_VOCABS = ["ggml-vocab-llama-spm.gguf", "ggml-vocab-phi-3.gguf", "ggml-vocab-gpt-2.gguf",
                "ggml-vocab-starcoder.gguf"]


def write_seeds(folder: Path) -> None:
    """GGUF seeds as folder/gguf/*.gguf, HF folders as folder/hf/<name>/ (deterministic content)."""
    import gguf
    import tiny_models as tm
    from tiny_gguf import write_gguf
    from tiny_hf import write_hf_folder
    from tiny_raw import mixed_type_raw
    import tiny_mxfp4 as tx
    from _bad_files import write_tiny_model

    Q = gguf.GGMLQuantizationType
    g, h = folder / "gguf", folder / "hf"
    g.mkdir(parents=True, exist_ok=True)
    write_tiny_model(g / "tiny_f32.gguf")
    write_gguf(tm.CASES["llama"], g / "llama_q8_0.gguf", Q.Q8_0)
    write_gguf(tm.CASES["qwen2"], g / "qwen2_q4_0.gguf", Q.Q4_0)
    write_gguf(tm.CASES["qwen3"], g / "qwen3_f16.gguf", Q.F16)
    write_gguf(tm.CASES["llama3"], g / "llama3_q8_0.gguf", Q.Q8_0)
    write_gguf(tm.MIXED, g / "mixed_types.gguf", raw=mixed_type_raw(tm.MIXED))
    for name in ("llama", "qwen2", "mistral"):
        write_hf_folder(tm.CASES[name], h / name)
    tx.write_released_folder(h / "gpt_oss_mxfp4")  # experts as MXFP4 _blocks / _scales (localllm/moe_mxfp4.py)


def gguf_seeds(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((folder / "gguf").glob("*.gguf"))}


def hf_seeds(folder: Path) -> dict[str, dict[str, bytes]]:
    return {d.name: {p.name: p.read_bytes() for p in sorted(d.iterdir())} for d in sorted((folder / "hf").iterdir())}


def vocab_paths(small: bool) -> list[str]:
    """The vocabularies the tokenizer target loads (small: the four quick ones, for CI)."""
    from _bad_files import VOCAB_DIR, default_model

    if small:
        return [str(VOCAB_DIR / n) for n in SMALL_VOCABS]
    return [str(p) for p in sorted(VOCAB_DIR.glob("*.gguf"))] + [str(default_model())]
