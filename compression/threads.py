"""How many threads the codec's kernels run on: its own setting, by default torch's
intra-op count, so that a process can give torch one thread and the codec more
(docs/decisions.md, "Thread policy").
"""

from __future__ import annotations

import torch

_codec_threads: int | None = None  # None: follow torch.get_num_threads()


def codec_threads() -> int:
    """The threads the codec's kernels run on (the caller's included)."""
    return _codec_threads if _codec_threads is not None else torch.get_num_threads()


def set_codec_threads(n: int | None) -> None:
    """Run the codec on n threads whatever torch's intra-op count; None: follow torch's."""
    global _codec_threads
    if n is not None and n < 1:
        raise ValueError(f"codec threads must be at least 1, got {n}")
    _codec_threads = n
