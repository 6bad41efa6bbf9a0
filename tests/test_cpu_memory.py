"""kernels/cpu_memory.py huge_page_copy: the weights' copy in 2 MiB pages holds the same bytes, shape and
dtype as the tensor given (oracle: the tensor itself), in a storage of exactly its bytes, that outlives
every other reference to its mapping; sizes below, across and above the rounding thresholds."""

from __future__ import annotations

import gc

import pytest
import torch

from localllm.kernels.cpu_memory import HUGE_PAGE, huge_page_copy


@pytest.mark.parametrize("nbytes", [4096, HUGE_PAGE // 2, HUGE_PAGE * 7 // 8, HUGE_PAGE, 3 * HUGE_PAGE + 4096])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32])
def test_huge_page_copy_is_an_own_equal_copy(nbytes, dtype):
    g = torch.Generator().manual_seed(nbytes)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype).view(-1, 32)
    got = huge_page_copy(t)
    assert got.dtype == t.dtype and got.shape == t.shape and got.is_contiguous()
    assert got.untyped_storage().nbytes() == nbytes and got.data_ptr() != t.data_ptr()
    del t
    gc.collect()
    assert torch.equal(got.view(torch.uint8).reshape(-1), raw)  # still mapped, the same bytes
    got[0, 0] = 0  # writable
