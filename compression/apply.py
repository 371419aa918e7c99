"""Combine decoded frames into one update and apply it: a weighted sum, or SparseLoCo's
mean over the frames that kept each coordinate (Sarfi et al. 2025, arXiv 2508.15706);
``decode_apply`` checks and applies one frame in one pass. Sparse frames are added by a
codec backend (``CodecBackend.add_frames``: the numba kernels into fp32 CPU params, else
the torch reference).

Arithmetic is fixed so every replica gets the same bits: contributions ``fp32(w_i * v)``
are added in frame order starting from zero, ``mean_kept`` divides by the count in fp32,
and ``apply_frames`` sets ``p = cast(fp32(p) + fp32(alpha) * U)`` once per coordinate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import registry
from .frame import Frame, decode_frame, read_frame
from .layout import Layout

MODES = ("sum", "mean_kept")


def _check(layout: Layout, frames: Sequence[Frame], weights, mode: str) -> list[float]:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if weights is None:
        weights = [1.0] * len(frames)
    weights = [float(w) for w in weights]
    if len(weights) != len(frames):
        raise ValueError(f"{len(weights)} weights for {len(frames)} frames")
    for f in frames:
        if f.layout != layout:
            raise ValueError(f"{f!r} was decoded for another layout")
    return weights


def _f32(x: float, device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, device=device)


def _dense_update(layout, frames, weights, j: int, mode: str, device) -> torch.Tensor:
    n = layout.specs[j].numel
    u = torch.zeros(n, dtype=torch.float32, device=device)
    cnt = torch.zeros(n, dtype=torch.float32, device=device) if mode == "mean_kept" else None
    for f, w in zip(frames, weights, strict=False):
        if f.kind == "dense":
            u.add_(f.dense[j].to(device) * _f32(w, device))
            if cnt is not None:
                cnt.add_(1.0)
        else:
            i = f.indices[j].to(device)
            u.index_add_(0, i, f.values[j].to(device) * _f32(w, device))
            if cnt is not None:
                cnt.index_add_(0, i, torch.ones(len(i), dtype=torch.float32, device=device))
    if cnt is not None:
        u = torch.where(cnt > 0, u / cnt.clamp(min=1.0), u)
    return u


def aggregate(layout: Layout, frames: Sequence[Frame], weights=None, *, mode: str = "sum",
              device=None) -> list[torch.Tensor]:
    """The update U as dense fp32 tensors shaped like the layout. Sparse frames on the CPU
    are added by the backend's fused multi-frame apply into zeros (0 + 1 x U is U), which
    makes no index tensors; the rest, one tensor at a time."""
    frames = list(frames)
    weights = _check(layout, frames, weights, mode)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if frames and dev.type == "cpu" and all(f.kind == "sparse" for f in frames):
        out = [torch.zeros(s.shape, dtype=torch.float32) for s in layout.specs]
        apply_frames(out, frames, weights, mode=mode, alpha=1.0)
        return out
    return [_dense_update(layout, frames, weights, j, mode, dev).view(s.shape)
            for j, s in enumerate(layout.specs)]


def apply_frames(params: Sequence[torch.Tensor], frames: Sequence[Frame], weights=None, *,
                 mode: str = "sum", alpha: float = 1.0, on_final: Callable[[int], None] | None = None) -> None:
    """params[j] += alpha * U[j] in place; for sparse frames the cost is proportional to the
    kept elements. Params may be fp32, bf16 or fp16 tensors on any device. ``on_final(j)``:
    called as the first j params come to hold their new values, where the backend applies
    the frames in parts (the numba backend's slabs); the caller says when all are."""
    frames = list(frames)
    if not frames:
        return
    layout = frames[0].layout
    weights = _check(layout, frames, weights, mode)
    params = list(params)
    if len(params) != len(layout.specs):
        raise ValueError(f"{len(params)} params for a layout of {len(layout.specs)} tensors")
    for spec, p in zip(layout.specs, params, strict=True):
        if tuple(p.shape) != spec.shape:
            raise ValueError(f"param {spec.name!r} has shape {tuple(p.shape)}, layout says {spec.shape}")
    if any(f.kind == "dense" for f in frames):
        _apply_dense(layout, params, frames, weights, mode, alpha)
        return
    bodies = [f.body for f in frames]
    if not registry.DECODER.add_frames(layout, params, bodies, weights, mode, alpha, on_final):
        registry.backend("reference").add_frames(layout, params, bodies, weights, mode, alpha)


def _apply_dense(layout: Layout, params: list[torch.Tensor], frames: list[Frame], weights: list[float], mode: str,
                 alpha: float) -> None:
    """apply_frames where some frame is dense: the dense update of each tensor."""
    for j, (spec, p) in enumerate(zip(layout.specs, params, strict=True)):
        if spec.numel == 0:
            continue
        with torch.no_grad():
            step = _dense_update(layout, frames, weights, j, mode, p.device) * _f32(alpha, p.device)
            p.copy_((p.float() + step.view(spec.shape)).to(p.dtype))


def decode_apply(params: Sequence[torch.Tensor], data: bytes, layout: Layout, *, weight: float = 1.0,
                 alpha: float = 1.0, backend: str | None = None) -> Frame:
    """``apply_frames(params, [decode_frame(data, layout)], [weight], alpha=alpha)`` with
    the same result bits and errors, in one pass where it can: for a sparse frame and
    fp32 contiguous CPU params, each segment of 64 chunks is added in as soon as it checks
    out; a problem found later (the checksum included) subtracts every update again,
    restores the few whose subtraction would not give the old bits back from a log, and
    raises FrameError: the params are bit for bit as before. Returns the frame. backend:
    the codec backend that checks it (default: numba where installed; the reference
    decodes, then applies)."""
    params = list(params)
    if len(params) != len(layout.specs):
        raise ValueError(f"{len(params)} params for a layout of {len(layout.specs)} tensors")
    w = float(weight)
    decoder = registry.DECODER if backend is None else registry.backend(backend)
    into = decoder.start_apply(data, layout, params, w, alpha)
    if into is None:
        frame = decode_frame(data, layout, backend=decoder.name)
        apply_frames(params, [frame], [w], alpha=alpha)
        return frame
    with torch.no_grad():  # params stay alive (held by the caller) while the kernel writes
        frame = read_frame(data, layout, decoder, into)
    if frame.kind == "dense":
        apply_frames(params, [frame], [w], alpha=alpha)
    return frame
