"""Parameter memory on transparent huge pages, and the allocator's arenas.

Applying a sparse update touches a quarter of a model's cache lines at random, so with
4 KiB pages nearly every touch also misses the TLB (a two-level page walk under a
hypervisor). Backing the parameters with 2 MiB pages (``madvise(MADV_HUGEPAGE)`` on a
private anonymous mapping) removes most of those walks; on Linux kernels where
transparent huge pages are off, or elsewhere, this is an ordinary allocation.

A process that takes frames over gRPC (the coordinator) allocates megabyte buffers on
many threads; glibc gives each thread an arena of its own (up to 8 per core), and what
one arena frees the others do not reuse. ``cap_malloc_arenas`` caps them: at n = 64 on
GPT-2's layout the coordinator's peak resident memory fell by a fifth, its close time
unchanged (docs/benchmarks.md, ``scale.py``). ``map_large_allocations`` then gives every
buffer of half a megabyte and more (a frame, a 1 MiB message) a mapping of its own,
returned to the system when it is freed, where glibc would otherwise raise its threshold
after the first such free and carve them out of the arenas, which keep what is freed:
another 210 MB off that peak, the close unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
MALLOC_ARENAS = 2  # the arenas a frame-receiving process keeps (glibc's default: 8 per core)
M_ARENA_MAX = -8  # glibc's mallopt parameter number for the arena cap
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number for the size served by a mapping of its own
MMAP_THRESHOLD = 512 << 10  # below a gRPC message (1 MiB of payload) and a frame


def cap_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc malloc's arenas at ``arenas`` for the threads that allocate from now on;
    call it before the process starts its threads. True where the cap took effect; False
    where ``MALLOC_ARENA_MAX`` is set in the environment (the operator's choice wins) or
    the C library has no ``mallopt`` (not glibc)."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    return _mallopt(M_ARENA_MAX, arenas)


def map_large_allocations(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve every allocation of ``threshold`` bytes and more by a mapping of its own, given
    back to the system at free (glibc's default moves the threshold up to the largest block
    freed so far, so that frame-sized buffers come from the arenas and stay resident after
    they are freed). True where it took effect; False where ``MALLOC_MMAP_THRESHOLD_`` is
    set in the environment (the operator's choice wins) or there is no glibc ``mallopt``."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    return _mallopt(M_MMAP_THRESHOLD, threshold)


def _mallopt(param: int, value: int) -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(param, value) == 1


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
