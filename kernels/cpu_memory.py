"""Weight memory for the C++ kernels: anonymous mappings backed by 2 MiB pages where Linux allows.

Decode reads every weight once a token, as one stream of hundreds of MB; with 4 KiB pages that is a
TLB miss every 4 KiB. Linux's transparent huge pages in their usual "madvise" mode give a plain
malloc 4 KiB pages, so the weights are copied into a private anonymous mapping marked MADV_HUGEPAGE
before its first touch (llama.cpp's mmap of the file gets large folios from the page cache). On the
project's EPYC the dense row products streamed 10-20% faster so (bench/dense_products.py,
docs/PERFORMANCE.md). Whole 2 MiB pages only: the mapping's tail past the last whole page stays in
4 KiB pages (a huge page there would hold mostly nothing), unless rounding up to a whole page costs
at most a quarter of the tensor (matrices just under 2 MiB). Elsewhere (no MADV_HUGEPAGE: macOS,
Windows) or for small tensors: a plain copy.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t (same dtype and shape), in 2 MiB pages where the system gives them."""
    nbytes = t.numel() * t.element_size()
    rounded = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    huge = rounded if rounded - nbytes <= nbytes // 4 else nbytes // HUGE_PAGE * HUGE_PAGE
    if not hasattr(mmap, "MADV_HUGEPAGE") or huge == 0:
        return t.clone(memory_format=torch.contiguous_format)
    # a length of whole huge pages: Linux places such anonymous mappings on a 2 MiB boundary
    buf = mmap.mmap(-1, rounded, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, 0, huge)
    except OSError:  # THP off in this kernel: 4 KiB pages, as a clone would have
        pass
    # a storage of the tensor's bytes only, holding buf (frombuffer keeps the exporting object alive)
    out = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
