"""Replica state shared by the coordinator and every worker: which of a model's tensors the
replicas keep identical, how one round's frames are applied to them (identically
everywhere), and the sha256 digest that proves the replicas hold bit-identical tensors
afterwards (docs/protocol.md).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable, Sequence

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
                mode: str, alpha: float, on_final: Callable[[int], None] | None = None) -> None:
    """``params += alpha · U`` for one round's frames, with the same arithmetic on every
    replica. With mode ``sum`` each frame is applied on its own, in order
    (``p = p + alpha · w_i · v_i``), so a worker can apply a frame as soon as it has
    arrived and need not hold the round's frames together; ``frames`` may be a generator
    that waits for them. ``mean_kept`` divides each coordinate by how many frames kept it,
    so its frames are gathered and applied together. ``on_final(j)``: the first j params
    hold their new values (``apply_frames``; called at least once, at the end)."""
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
    else:
        gathered = list(frames)
        if gathered:
            apply_frames(params, gathered, weights, mode=mode, alpha=alpha, on_final=on_final)
        elif weights:
            raise ValueError(f"0 frames for {len(weights)} weights")
    if on_final is not None:
        on_final(len(params))


def param_digest(tensors: Sequence[Tensor]) -> str:
    """Hex sha256 over, for each tensor in order, a header (index, dtype, shape) and its raw
    bytes (moved to CPU, made contiguous). Any change of a bit, shape, dtype or order changes
    the digest; the device a tensor sits on does not."""
    hasher = ParamHasher(len(tensors))
    for i, t in enumerate(tensors):
        hasher.add(i, t)
    return hasher.hexdigest()


class ParamHasher:
    """``param_digest`` of ``count`` tensors handed in one at a time, in order (an island
    puts each tensor together from its ranks' pieces: geoloco.worker.island_state)."""

    def __init__(self, count: int) -> None:
        self._hash = hashlib.sha256(f"geoloco-params/{count}\n".encode())

    def add(self, i: int, t: Tensor) -> None:
        t = t.detach()
        self._hash.update(f"{i}:{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)}\n".encode())
        self._hash.update(_raw_bytes(t))

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class DigestAsApplied:
    """``param_digest(tensors)`` hashed on a thread of its own while an apply runs: ``final(j)``
    says the first j tensors hold their new values (``apply_round``'s ``on_final``), and the
    thread hashes up to there (sha256 releases the GIL, so it takes the core the apply's
    kernels leave). ``result()`` waits for the rest; ``cancel()`` stops it (an apply that
    failed)."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.tensors = list(tensors)
        self._hash = ParamHasher(len(self.tensors))
        self._final, self._cancelled = 0, False
        self._changed = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="digest", daemon=True)
        self._thread.start()

    def final(self, count: int) -> None:
        with self._changed:
            self._final = max(self._final, min(count, len(self.tensors)))
            self._changed.notify()

    def cancel(self) -> None:
        with self._changed:
            self._cancelled = True
            self._changed.notify()
        self._thread.join()

    def result(self) -> str:
        self.final(len(self.tensors))
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()

    def _run(self) -> None:
        done = 0
        try:
            while done < len(self.tensors):
                with self._changed:
                    self._changed.wait_for(lambda done=done: self._cancelled or self._final > done)
                    if self._cancelled:
                        return
                    upto = self._final
                for i in range(done, upto):
                    self._hash.add(i, self.tensors[i])
                done = upto
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            self._error = exc


def _raw_bytes(t: Tensor) -> memoryview:
    """The tensor's bytes in row-major order, for any dtype (bf16 included)."""
    flat = t.cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())
