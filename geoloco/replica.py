"""Replica state shared by the coordinator and every worker: which of a model's tensors the
replicas keep identical, how one round's frames are applied to them (identically
everywhere), and the sha256 digest that proves the replicas hold bit-identical tensors
afterwards (docs/protocol.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from geoloco.compression import Compressor, Frame, Layout, TensorSpec, apply_frames
from geoloco.config import AUTO, CompressionConfig

INCREMENTAL_MODES = ("sum",)  # modes whose frames are applied one at a time, in order
START_DENSITY = 64 / 4096  # compression.density "auto" before a worker has timed a push
QUANTIZER_TABLES = {"two-level": "chunk", "four-bin": "bins"}  # compression.quantizer -> Compressor table


def sparse_compressor(layout: Layout, comp: CompressionConfig, *, density: float | None = None,
                      beta: float | None = None, undoable: bool = False) -> Compressor:
    """The run's sparse codec (tile, index coding, quantizer, zstd) as a Compressor: a
    worker's (``density`` overrides compression.density, which may be "auto"; ``beta``
    compression.ef_beta) or the coordinator's for aggregated results."""
    if density is None:
        density = comp.density if comp.density != AUTO else START_DENSITY
    return Compressor(layout, density=density, beta=comp.ef_beta if beta is None else beta,
                      tile=comp.tile, index_coding=comp.index_coding, zstd=comp.zstd,
                      undoable=undoable, table=QUANTIZER_TABLES[comp.quantizer])


def replica_tensors(model: nn.Module) -> list[tuple[str, Tensor]]:
    """What the replicas keep identical and the wire carries, in a stable order: every
    parameter that trains (a tied one once, under its first name), then every floating-point
    buffer the state dict keeps (BatchNorm's running statistics: averaged like parameters).
    Frozen parameters, integer buffers and non-persistent buffers (rotary tables) stay out:
    the model factory makes them alike everywhere and training does not change them."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    persistent = set(model.state_dict(keep_vars=True))
    buffers = [(name, b) for name, b in model.named_buffers()
               if name in persistent and b.is_floating_point()]
    return params + buffers


def replica_layout(model: nn.Module) -> Layout:
    """The wire layout of ``replica_tensors(model)``: names and shapes, and fp32 whatever the
    model's own dtype, since every replica's master copy is fp32."""
    return Layout(TensorSpec(name, tuple(t.shape), torch.float32) for name, t in replica_tensors(model))


def apply_round(params: Sequence[Tensor], frames: Iterable[Frame], weights: Sequence[float],
                mode: str, alpha: float) -> None:
    """``params += alpha · U`` for one round's frames, with the same arithmetic on every
    replica. With mode ``sum`` each frame is applied on its own, in order
    (``p = p + alpha · w_i · v_i``), so a worker can apply a frame as soon as it has
    arrived and need not hold the round's frames together; ``frames`` may be a generator
    that waits for them. ``mean_kept`` divides each coordinate by how many frames kept it,
    so its frames are gathered and applied together."""
    weights = [float(w) for w in weights]
    if mode in INCREMENTAL_MODES:
        count = 0
        for frame in frames:
            if count >= len(weights):
                raise ValueError(f"more frames than the {len(weights)} weights")
            apply_frames(params, [frame], [weights[count]], mode=mode, alpha=alpha)
            count += 1
        if count != len(weights):
            raise ValueError(f"{count} frames for {len(weights)} weights")
        return
    gathered = list(frames)
    if gathered:
        apply_frames(params, gathered, weights, mode=mode, alpha=alpha)
    elif weights:
        raise ValueError(f"0 frames for {len(weights)} weights")


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
