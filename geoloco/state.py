"""Parameter digests: a sha256 over the exact bytes, shapes and dtypes of a list of tensors,
so the coordinator and every replica can prove they hold bit-identical parameters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor


def param_digest(tensors: Sequence[Tensor]) -> str:
    """Hex sha256 over, for each tensor in order, a header (index, dtype, shape) and its raw
    bytes (moved to CPU, made contiguous). Any change of a bit, shape, dtype or order changes
    the digest; the device a tensor sits on does not."""
    h = hashlib.sha256(f"geoloco-params/{len(tensors)}\n".encode())
    for i, t in enumerate(tensors):
        t = t.detach()
        h.update(f"{i}:{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)}\n".encode())
        h.update(_raw_bytes(t))
    return h.hexdigest()


def _raw_bytes(t: Tensor) -> memoryview:
    """The tensor's bytes in row-major order, for any dtype (bf16 included)."""
    flat = t.cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())
