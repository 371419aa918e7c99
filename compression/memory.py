"""Parameter memory on transparent huge pages.

Applying a sparse update touches a quarter of a model's cache lines at random, so with
4 KiB pages nearly every touch also misses the TLB (a two-level page walk under a
hypervisor). Backing the parameters with 2 MiB pages (``madvise(MADV_HUGEPAGE)`` on a
private anonymous mapping) removes most of those walks; on Linux kernels where
transparent huge pages are off, or elsewhere, this is an ordinary allocation.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20


def huge_page_buffer(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zeroed 1-D CPU tensor of ``numel`` elements, on huge pages where the OS allows."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(numel, dtype=dtype)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP disabled in this kernel: plain pages
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype, count=numel)  # the tensor keeps the mapping alive


def on_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (same shapes and values, fp32-or-other dtype kept) as views
    of one huge-page buffer per dtype, laid out end to end."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        group = [j for j, t in enumerate(tensors) if t.dtype == dtype]
        buf = huge_page_buffer(sum(tensors[j].numel() for j in group), dtype)
        off = 0
        for j in group:
            t = tensors[j]
            view = buf[off:off + t.numel()].view(t.shape)
            view.copy_(t.detach())
            out[j] = view
            off += t.numel()
    return out
