"""tests/gpu: correctness on a CUDA GPU (run there with `pytest -m cuda tests/gpu`, a few minutes on one
H100). Every test here gets the `cuda` marker and is skipped when torch sees no CUDA device, so a plain
`pytest -q` on a CPU machine collects them and skips them.

Synthetic models (random weights of a models.toml shape) are written once per session as GGUF files
and opened through load_model like any file, so the tests run what `localllm` runs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
VOCAB = HERE.parent / "data" / "vocab" / "ggml-vocab-llama-spm.gguf"


def pytest_collection_modifyitems(config, items):
    """The marker and the skip for this folder's tests only (the hook sees the whole session's items)."""
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(skip)


class SyntheticFiles:
    """.gguf(preset, wtype, layers=None) -> a GGUF file of that shape preset's random weights (the
    vocabulary of tests/data/vocab's llama-spm file, 32000 tokens; `layers` cuts the layer count to
    keep large shapes quick), written on the GPU once per session. random_blocks: quantized weights are
    random valid blocks (synthetic.RandomBlocks: seconds, where quantizing an 8B shape's rows took 1-2
    minutes a file), for tests comparing two of our paths on one file (TP=2 against TP=1)."""

    def __init__(self, root: Path):
        self.root = root
        self._made: dict[tuple, Path] = {}
        self._tokenizer = None

    def tokenizer(self) -> dict:
        from localllm.commands.quantize_cmd import read_gguf_metadata

        if self._tokenizer is None:
            assert VOCAB.is_file(), f"vocab test data missing: {VOCAB}"
            self._tokenizer = read_gguf_metadata(VOCAB, keep=lambda key: key.startswith("tokenizer."))
        return self._tokenizer

    def gguf(self, preset: str, wtype: str, layers: int | None = None, random_blocks: bool = False) -> Path:
        from localllm.registry import shape_preset
        from localllm.synthetic import write_synthetic_gguf

        key = (preset, wtype.upper(), layers, random_blocks)
        if key not in self._made:
            tok = self.tokenizer()
            cfg = replace(shape_preset(preset), vocab_size=len(tok["tokenizer.ggml.tokens"].value))
            if layers is not None:
                cfg = replace(cfg, n_layers=layers)
            tail = "-random" if random_blocks else ""
            path = self.root / f"{preset}-{layers or cfg.n_layers}L-{wtype.upper()}{tail}.gguf"
            self._made[key] = write_synthetic_gguf(cfg, wtype.upper(), path, tok, device="cuda", seed=3,
                                                   random_blocks=random_blocks)
        return self._made[key]


@pytest.fixture(scope="session")
def synthetic_files(tmp_path_factory) -> SyntheticFiles:
    return SyntheticFiles(tmp_path_factory.mktemp("gpu_models"))

