"""Combine decoded frames into one update: a weighted sum, or SparseLoCo's mean over the
frames that kept each coordinate (Sarfi et al. 2025, arXiv 2508.15706).

Arithmetic is fixed so every replica gets the same bits: contributions ``fp32(w_i * v)``
are added in frame order starting from zero, ``mean_kept`` divides by the count in fp32,
and ``apply_frames`` sets ``p = cast(fp32(p) + fp32(alpha) * U)`` once per coordinate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import decode_kernel, kernels
from .frame import Frame, decode_frame
from .layout import Layout
from .threadpool import pieces, run_tasks

MODES = ("sum", "mean_kept")
SCATTER_PIECE = 1 << 16  # kept elements per task of the multi-frame scatter


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


def _sparse_update(frames, weights, j: int, mode: str, device):
    """(indices, U values) of tensor j over the union of kept coordinates, sorted."""
    idx = [f.indices[j].to(device) for f in frames]
    vals = [f.values[j].to(device) * _f32(w, device) for f, w in zip(frames, weights, strict=False)]
    if len(frames) == 1:
        return idx[0], vals[0]
    uniq, inv = torch.unique(torch.cat(idx), return_inverse=True)
    u = torch.zeros(len(uniq), dtype=torch.float32, device=device)
    cnt = torch.zeros(len(uniq), dtype=torch.float32, device=device) if mode == "mean_kept" else None
    off = 0
    for i, v in zip(idx, vals, strict=False):
        part = inv[off:off + len(i)]
        off += len(i)
        u.index_add_(0, part, v)  # indices unique within a frame: deterministic
        if cnt is not None:
            cnt.index_add_(0, part, torch.ones_like(v))
    if cnt is not None:
        u = u / cnt
    return uniq, u


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
    """The update U as dense fp32 tensors shaped like the layout."""
    frames = list(frames)
    weights = _check(layout, frames, weights, mode)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return [_dense_update(layout, frames, weights, j, mode, dev).view(s.shape)
            for j, s in enumerate(layout.specs)]


def apply_frames(params: Sequence[torch.Tensor], frames: Sequence[Frame], weights=None, *,
                 mode: str = "sum", alpha: float = 1.0) -> None:
    """params[j] += alpha * U[j] in place; for sparse frames the cost is proportional to the
    kept elements. Params may be fp32, bf16 or fp16 tensors on any device."""
    frames = list(frames)
    if not frames:
        return
    layout = frames[0].layout
    weights = _check(layout, frames, weights, mode)
    params = list(params)
    if len(params) != len(layout.specs):
        raise ValueError(f"{len(params)} params for a layout of {len(layout.specs)} tensors")
    any_dense = any(f.kind == "dense" for f in frames)
    if len(frames) == 1 and not any_dense and _apply_single_cpu(layout, params, frames[0], weights[0], alpha):
        return
    scatter = []  # (param array, indices, steps) for the threaded CPU kernel
    for j, (spec, p) in enumerate(zip(layout.specs, params, strict=False)):
        if tuple(p.shape) != spec.shape:
            raise ValueError(f"param {spec.name!r} has shape {tuple(p.shape)}, layout says {spec.shape}")
        if spec.numel == 0:
            continue
        a = _f32(alpha, p.device)
        with torch.no_grad():
            if any_dense:
                step = _dense_update(layout, frames, weights, j, mode, p.device) * a
                p.copy_((p.float() + step.view(spec.shape)).to(p.dtype))
                continue
            idx, u = _sparse_update(frames, weights, j, mode, p.device)
            step = u * a
            if kernels.HAVE_NUMBA and p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous():
                scatter.append((p.detach().view(-1).numpy(), idx.numpy(), step.numpy()))
            elif p.is_contiguous():
                flat = p.data.view(-1)
                if p.dtype == torch.float32:
                    flat.index_add_(0, idx, step)
                else:
                    flat[idx] = (flat[idx].float() + step).to(p.dtype)
            else:  # non-contiguous param: update a flat copy, write it back
                tmp = p.reshape(-1).clone()
                tmp[idx] = (tmp[idx].float() + step).to(p.dtype)
                p.copy_(tmp.view(spec.shape))
    if scatter:
        run_tasks([_scatter_task(arr, idx, step, a, b) for arr, idx, step in scatter
                   for a, b in pieces(len(idx), SCATTER_PIECE)], torch.get_num_threads())


def _cpu_addresses(layout: Layout, params) -> np.ndarray | None:
    """Data addresses of fp32 contiguous CPU params for the numba kernels, or None when a
    param does not qualify (or numba is missing)."""
    if not kernels.HAVE_NUMBA:
        return None
    addrs = []
    f32 = torch.float32
    for spec, p in zip(layout.specs, params, strict=False):  # the cheapest tensor attributes there are
        if p.shape != spec.shape:
            raise ValueError(f"param {spec.name!r} has shape {tuple(p.shape)}, layout says {spec.shape}")
        if not (p.is_cpu and p.dtype is f32 and p.is_contiguous()):
            return None
        addrs.append(p.data_ptr())
    return np.array(addrs, dtype=np.int64)


def _apply_single_cpu(layout: Layout, params, frame: Frame, weight: float, alpha: float) -> bool:
    """One sparse frame straight from its sections into fp32 CPU params, on the codec
    threads, with no index or value arrays in between: ``p = p + fp32(alpha) *
    fp32(fp32(w) * v)``, the general path's bits. False (nothing done) when a param does
    not qualify."""
    addrs = _cpu_addresses(layout, params) if frame.body is not None else None
    if addrs is None:
        return False
    with torch.no_grad():  # params stay alive (held by the caller) while the kernel writes
        problem = frame.body.run(decode_kernel.APPLY, addrs=addrs, w=weight, a=alpha)
    if problem is not None:  # validated by decode_frame: cannot happen
        raise AssertionError(f"applying a validated frame failed: {problem}")
    return True


def decode_apply(params: Sequence[torch.Tensor], data: bytes, layout: Layout, *, weight: float = 1.0,
                 alpha: float = 1.0) -> Frame:
    """``apply_frames(params, [decode_frame(data, layout)], [weight], alpha=alpha)`` with
    the same result bits and errors, in one pass where it can: for a sparse frame and
    fp32 contiguous CPU params, each segment of 64 chunks is added in as soon as it checks
    out; a problem found later (the checksum included) subtracts every update again,
    restores the few whose subtraction would not give the old bits back from a log, and
    raises FrameError: the params are bit for bit as before. Returns the frame."""
    params = list(params)
    if len(params) != len(layout.specs):
        raise ValueError(f"{len(params)} params for a layout of {len(layout.specs)} tensors")
    w = float(weight)
    addrs = _cpu_addresses(layout, params)
    if addrs is None:
        frame = decode_frame(data, layout)
        apply_frames(params, [frame], [w], alpha=alpha)
        return frame
    with torch.no_grad():  # params stay alive (held by the caller) while the kernel writes
        frame = decode_frame(data, layout, _apply_to=(addrs, w, alpha))
    if frame.kind == "dense":
        apply_frames(params, [frame], [w], alpha=alpha)
    return frame


def _scatter_task(arr, idx, step, a: int, b: int):
    def run() -> None:
        kernels.scatter_add(arr, idx, step, a, b)
    return run
