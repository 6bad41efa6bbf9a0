"""The phi3 / smollm3 test checkpoints (tiny_models.PHI_CASES) and the oracle helpers the two test
modules share: test_phi3_smollm3.py (logits) and test_phi3_smollm3_files.py (configs, files, quantize)."""

from __future__ import annotations

import gguf
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import tiny_models as tm
from tiny_gguf import write_gguf
from tiny_hf import write_hf_folder
from tiny_spec import Q
from tiny_tokenizer import vocab_size
from tiny_weights import make_weights
from tiny_models import assert_close  # noqa: F401  (its tests import it from here)
from localllm.cache import make_cache
from localllm.load import load_model

TOL = 1e-3
BATCH, T = 2, 16
CASES = list(tm.PHI_CASES)
GGUF_CASES = [c for c in CASES if c != "smollm3_nope2"]  # llama.cpp's GGUF has no NoPE interval key
FORMATS = ["gguf-F32", "gguf-Q8_0", "safetensors"]


class Files:
    """Each case's HF folder, GGUF files and Q8_0 round-trip folder, written on first use."""

    def __init__(self, root):
        self.root, self.made = root, {}

    def _once(self, key, make):
        if key not in self.made:
            self.made[key] = make()
        return self.made[key]

    def hf(self, case):
        return self._once((case, "hf"), lambda: write_hf_folder(tm.PHI_CASES[case], self.root / case / "hf"))

    def gguf(self, case, qtype=Q.F32):
        path = self.root / case / f"tiny-{case}-{qtype.name}.gguf"
        return self._once((case, qtype), lambda: write_gguf(tm.PHI_CASES[case], path, qtype))

    def q8_folder(self, case):
        """The HF folder of the Q8_0 file's numbers: each 2-D tensor quantized and decoded by gguf."""
        def make():
            spec = tm.PHI_CASES[case]
            w = {k: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(v.numpy(), Q.Q8_0), Q.Q8_0))
                 if v.ndim == 2 else v for k, v in make_weights(spec).items()}
            return write_hf_folder(spec, self.root / case / "hf-q8", weights=w)
        return self._once((case, "q8"), make)

    def oracle_folder(self, case, fmt):
        return self.q8_folder(case) if fmt == "gguf-Q8_0" else self.hf(case)

    def path(self, case, fmt):
        return self.hf(case) if fmt == "safetensors" else self.gguf(case, Q[fmt.removeprefix("gguf-")])


@torch.inference_mode()
def our_logits(path, tokens: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Logits of one pass over tokens with a KV cache of `capacity` rows (default: the prompt's length)."""
    lm = load_model(str(path), "cpu", torch.float32)
    cache = make_cache(lm.config, capacity or tokens.shape[1], batch=tokens.shape[0])
    return lm.model(tokens, cache, 0)


@torch.inference_mode()
def hf_logits(folder, tokens: torch.Tensor, config=None) -> torch.Tensor:
    kwargs = {"config": config} if config is not None else {}
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kwargs).eval()
    return model(tokens).logits.float()



def assert_differs(a: torch.Tensor, b: torch.Tensor, by: float = 0.05) -> None:
    assert (a - b).abs().max().item() > by


def hf_config(files: Files, case: str, **changes):
    """The case's transformers config with attributes changed (a feature switched off)."""
    cfg = AutoConfig.from_pretrained(str(files.hf(case)))
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def random_tokens(batch: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size(), (batch, n), generator=g)
