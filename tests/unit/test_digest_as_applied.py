"""The coordinator's digest hashed while its apply runs (geoloco.replica.DigestAsApplied):
the numba backend applies a round's frames a slab at a time and says, after each slab,
how many leading tensors hold their new values; the digest thread hashes those. Checked
against ``param_digest`` of the finished parameters, and against a snapshot taken at each
progress call (the tensors it names must not change afterwards)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from geoloco.compression import Compressor, Layout, TensorSpec, decode_frame
from geoloco.compression.registry import BACKENDS
from geoloco.replica import DigestAsApplied, apply_round, param_digest

SHAPES = [(40, 70), (33,), (0,), (64, 64), (5, 7, 9), (120, 40), (17,), (48, 96), (1,), (90, 30)]
LAYOUT = Layout([TensorSpec(f"t{i}", s, torch.float32) for i, s in enumerate(SHAPES)])


def _frames(n: int) -> list:
    out = []
    for i in range(n):
        gen = torch.Generator().manual_seed(100 + i)
        deltas = [torch.randn(s, generator=gen) for s in SHAPES]
        data = Compressor(LAYOUT, density=1 / 16, tile=8).compress(deltas, round=0, sender=i)
        out.append(decode_frame(data, LAYOUT))
    return out


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=gen) for s in SHAPES]


@pytest.mark.skipif("numba" not in BACKENDS, reason="numba is not installed")
def test_tensors_named_final_do_not_change_after(monkeypatch) -> None:
    from geoloco.compression._cpu import decoder

    frames = _frames(5)
    geo = frames[0].body.geometry
    seg_kept = int(np.diff(geo.seg_start[:, 2], append=geo.kept).max())
    monkeypatch.setattr(decoder, "SLAB_BYTES", 2 * seg_kept * len(frames))  # a segment a slab
    assert len(geo.seg_start) >= 5
    params = _params()
    seen: list[tuple[int, str]] = []
    apply_round(params, frames, [1.0] * 5, "mean_kept", -0.5,
                on_final=lambda j: seen.append((j, param_digest(params[:j]))))
    counts = [j for j, _ in seen]
    assert counts == sorted(counts) and counts[-1] == len(params)
    assert len(set(counts)) >= 3  # tensors were final before the end
    for j, digest in seen:
        assert param_digest(params[:j]) == digest, f"a tensor of the first {j} changed after it was final"


@pytest.mark.parametrize("mode", ["mean_kept", "sum"])
def test_the_digest_hashed_during_the_apply_is_the_digest_after_it(mode, monkeypatch) -> None:
    if "numba" in BACKENDS:
        from geoloco.compression._cpu import decoder
        monkeypatch.setattr(decoder, "SLAB_BYTES", 4096)
    frames, params = _frames(4), _params()
    digest = DigestAsApplied(params)
    apply_round(params, frames, [0.25, 1.0, 0.5, 2.0], mode, -1.0, on_final=digest.final)
    assert digest.result() == param_digest(params)
    assert digest.result() == param_digest(params)  # asked twice: the same


def test_a_cancelled_digest_stops_its_thread() -> None:
    digest = DigestAsApplied(_params())
    digest.final(3)
    digest.cancel()
    assert not any(t.name == "digest" and t.is_alive() for t in threading.enumerate())
