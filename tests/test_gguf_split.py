"""Split GGUF files (llama.cpp's gguf-split layout) load as one model: the same tensors and logits as the
unsplit file, and a wrong or incomplete set of parts is one error line.

The parts are written by the `gguf` package's writer with split_max_tensors (what llama.cpp's converter
runs for --split-max-tensors): PREFIX-0000i-of-0000N.gguf, split.no / split.count / split.tensors.count
in every part, all metadata in the first. llama.cpp itself loads such a set as one model: checked once
by hand when this test was written (llama-cpp-python 0.3.36, the split set of this file's tiny Q8_0 model:
logits of 6 tokens bit-for-bit equal to the unsplit file's; llama.cpp is not part of the test environment).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tiny_gguf import write_gguf
from tiny_spec import Q, TinySpec
from localllm.runtime import Runtime  # the portable backend: no C++ build
from localllm.cache import make_cache
from localllm.errors import LocalLLMError
from localllm.gguf_file import open_gguf
from localllm.load import file_size, load_model

SPEC = TinySpec("llama", seed=3)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("split")
    whole = write_gguf(SPEC, folder / "whole.gguf", Q.Q8_0)
    first = write_gguf(SPEC, folder / "tiny.gguf", Q.Q8_0, split_max_tensors=8)
    return whole, first


def test_parts_are_named_and_keyed_as_gguf_split(files):
    _, first = files
    assert first.name == "tiny-00001-of-00003.gguf"
    import gguf

    for i in range(3):
        r = gguf.GGUFReader(first.with_name(f"tiny-{i + 1:05d}-of-00003.gguf"))
        assert r.fields["split.no"].contents() == i and r.fields["split.count"].contents() == 3
        assert r.fields["split.tensors.count"].contents() == 21
        assert ("general.architecture" in r.fields) == (i == 0)  # all metadata in the first part only


def test_split_reads_as_the_whole_file(files):
    whole, first = files
    a, b = open_gguf(whole), open_gguf(first)
    assert len(b.parts) == 3 and b.parts[0] == first
    assert list(a.tensors) == list(b.tensors)
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert (t.tensor_type, list(t.shape)) == (u.tensor_type, list(u.shape))
        assert np.array_equal(np.asarray(t.data), np.asarray(u.data)), name
    assert not any(k.startswith("split.") for k in b.metadata)  # one model: no part keys left
    assert {k: v for k, v in a.metadata.items()} == b.metadata
    assert file_size(first) == sum(p.stat().st_size for p in b.parts)


@torch.inference_mode()
def _logits(path) -> torch.Tensor:
    lm = load_model(str(path), "cpu", torch.float32, backend=Runtime)
    tokens = torch.tensor([[1, 5, 70, 200, 33, 9]])
    return lm.model(tokens, make_cache(lm.config, tokens.shape[1]), 0)


def test_split_logits_equal_the_unsplit_file(files):
    whole, first = files
    assert torch.equal(_logits(first), _logits(whole))


def _copy_set(files, tmp_path):
    _, first = files
    for p in open_gguf(first).parts:
        shutil.copy(p, tmp_path / p.name)
    return tmp_path / first.name


def test_a_later_part_is_refused(files):
    _, first = files
    with pytest.raises(LocalLLMError, match="part 2 of 3 of a split GGUF: give the first part"):
        open_gguf(first.with_name("tiny-00002-of-00003.gguf"))


def test_a_missing_part_is_one_error(files, tmp_path):
    first = _copy_set(files, tmp_path)
    (tmp_path / "tiny-00003-of-00003.gguf").unlink()
    with pytest.raises(LocalLLMError, match="split GGUF part 3 of 3 is missing"):
        open_gguf(first)


def test_parts_of_another_set_are_refused(files, tmp_path):
    first = _copy_set(files, tmp_path)
    # part 3 replaced by a copy of part 2: wrong split.no
    shutil.copy(tmp_path / "tiny-00002-of-00003.gguf", tmp_path / "tiny-00003-of-00003.gguf")
    with pytest.raises(LocalLLMError, match="is not part 3 of 3"):
        open_gguf(first)


def test_a_renamed_first_part_is_one_error(files, tmp_path):
    _, first = files
    shutil.copy(first, tmp_path / "renamed.gguf")
    with pytest.raises(LocalLLMError, match="other parts cannot be found"):
        open_gguf(tmp_path / "renamed.gguf")
