"""The codec backends of this installation, each checked against ``backend.CodecBackend``
at import: the torch reference always, the numba CPU backend where numba is installed.
Every backend listed here runs the parity tests."""

from __future__ import annotations

import warnings

import torch

from .backend import CodecBackend
from .reference import ReferenceBackend


def _installed() -> list[CodecBackend]:
    backends: list[CodecBackend] = [ReferenceBackend()]
    try:
        from ._cpu import NumbaBackend
    except ImportError as exc:  # pragma: no cover - exercised only where numba is missing
        if exc.name not in ("numba", "llvmlite"):
            raise
        warnings.warn("numba is not installed: the codec runs its (slower) torch reference", RuntimeWarning,
                      stacklevel=3)
    else:
        backends.append(NumbaBackend())
    return backends


BACKENDS: dict[str, CodecBackend] = {b.name: b for b in _installed()}
for _b in BACKENDS.values():
    if not isinstance(_b, CodecBackend):
        raise TypeError(f"codec backend {_b.name!r} does not implement the CodecBackend protocol")
DECODER: CodecBackend = BACKENDS.get("numba", BACKENDS["reference"])  # what frames are decoded with by default


def backend(name: str) -> CodecBackend:
    """The registered backend of that name (ValueError naming the ones there are)."""
    if name not in BACKENDS:
        raise ValueError(f"codec backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name]


def encoding_backend(name: str | None, device: torch.device) -> CodecBackend:
    """The named backend, or (None) the fastest one that encodes buffers on ``device``."""
    if name is not None:
        chosen = backend(name)
        if not chosen.encodes(device):
            raise ValueError(f"codec backend {name!r} does not encode tensors on {device}")
        return chosen
    return next(BACKENDS[n] for n in ("numba", "reference") if n in BACKENDS and BACKENDS[n].encodes(device))
