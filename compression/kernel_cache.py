"""Whether numba's on-disk cache already holds the numba backend's compiled kernels, so a
caller can say "compiling, first run only" before a first encode takes its minute
(numba caching: kernels are compiled with ``cache=True``; docs/codec.md)."""

from __future__ import annotations

from pathlib import Path


def kernels_cached() -> bool:
    """True when some kernel has a cache index and every index there is valid for the
    kernels' current source and numba version; also True where numba is not installed
    (the torch reference compiles nothing). A warm-up (one encode, decode and apply)
    makes it True."""
    try:
        from numba.core.registry import CPUDispatcher

        from ._cpu import decode_kernels, encode_kernels, merge_kernels
    except ImportError as exc:
        if exc.name in ("numba", "llvmlite"):
            return True
        raise
    found = False
    for module in (encode_kernels, decode_kernels, merge_kernels):
        for kernel in vars(module).values():
            if not isinstance(kernel, CPUDispatcher) or kernel._cache is None:
                continue
            index = getattr(kernel._cache, "_cache_file", None)
            if index is None or not Path(index._index_path).exists():
                continue
            try:
                valid = bool(index._load_index())  # {} when stale (other source or numba)
            except Exception:  # noqa: BLE001 - numba's private API: "not cached" is the safe answer
                return False
            if not valid:
                return False
            found = True
    return found
