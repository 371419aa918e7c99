"""param_digest: equal for identical tensors, different for any change of value, shape,
dtype or order, and independent of memory layout; apply_round: frame by frame for ``sum``,
all together for ``mean_kept``."""

from __future__ import annotations

import hashlib

import pytest
import torch

from geoloco.compression import Compressor, Layout, apply_frames, decode_frame
from geoloco.replica import apply_round, param_digest


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 6, generator=gen), torch.randn(5, generator=gen), torch.tensor(2.5)]


def test_identical_tensors_give_identical_digest():
    digest = param_digest(_params())
    assert digest == param_digest([t.clone() for t in _params()])
    assert len(digest) == 64 and int(digest, 16) >= 0


def test_one_bit_flip_changes_the_digest():
    params = _params()
    before = param_digest(params)
    params[1].view(torch.int32)[3] ^= 1  # the lowest mantissa bit of one element
    assert param_digest(params) != before


def test_negative_zero_differs_from_zero():
    assert param_digest([torch.tensor([0.0])]) != param_digest([torch.tensor([-0.0])])


def test_shape_dtype_and_order_are_part_of_the_digest():
    a, b, c = _params()
    base = param_digest([a, b, c])
    assert param_digest([a.reshape(6, 4), b, c]) != base  # same bytes, other shape
    assert param_digest([b, a, c]) != base
    assert param_digest([a, b]) != base
    x = torch.zeros(8, dtype=torch.float32)
    assert param_digest([x]) != param_digest([x.view(torch.int32)])
    # splitting one tensor into two must not collide with the whole
    flat = torch.arange(8.0)
    assert param_digest([flat]) != param_digest([flat[:4], flat[4:]])


def test_layout_does_not_matter_only_values():
    a = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    transposed_twice = a.t().contiguous().t()  # same values, column-major storage
    assert not transposed_twice.is_contiguous()
    assert param_digest([a]) == param_digest([transposed_twice])


def test_bf16_and_parameters_are_accepted():
    p = torch.nn.Parameter(torch.randn(3, 3))
    assert param_digest([p]) == param_digest([p.detach().clone()])
    bf = torch.randn(3, 3).to(torch.bfloat16)
    assert param_digest([bf]) != param_digest([bf.float()])


def test_digest_is_sha256_of_documented_encoding():
    t = torch.tensor([1.0, 2.0])
    h = hashlib.sha256(b"geoloco-params/1\n0:float32:(2,)\n")
    h.update(t.numpy().tobytes())
    assert param_digest([t]) == h.hexdigest()


# ----- apply_round: the one way every replica applies a round's frames


def _sparse_frames(n: int) -> tuple[Layout, list]:
    shapes = {"w": (64, 64), "b": (64,)}
    lay = Layout.from_named_tensors((k, torch.zeros(s)) for k, s in shapes.items())
    frames = []
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        deltas = [torch.randn(s.shape, generator=gen) for s in lay.specs]
        frames.append(decode_frame(Compressor(lay).compress(deltas, round=0, sender=i), lay))
    return lay, frames


def _zeros(lay: Layout) -> list[torch.Tensor]:
    return [torch.zeros(s.shape) for s in lay.specs]


def test_sum_applies_the_frames_one_at_a_time_in_order():
    lay, frames = _sparse_frames(3)
    weights = [0.25, 0.5, 1.0]
    params = _zeros(lay)
    apply_round(params, iter(frames), weights, "sum", -1.0)  # a generator is enough
    expected = _zeros(lay)
    for frame, w in zip(frames, weights, strict=True):
        apply_frames(expected, [frame], [w], mode="sum", alpha=-1.0)
    assert param_digest(params) == param_digest(expected)
    assert any(p.abs().sum() > 0 for p in params)


def test_mean_kept_applies_the_frames_together():
    lay, frames = _sparse_frames(3)
    params, expected = _zeros(lay), _zeros(lay)
    apply_round(params, iter(frames), [1.0] * 3, "mean_kept", -1.0)
    apply_frames(expected, frames, [1.0] * 3, mode="mean_kept", alpha=-1.0)
    assert param_digest(params) == param_digest(expected)


@pytest.mark.parametrize("mode", ["sum", "mean_kept"])
def test_frames_and_weights_must_pair_up(mode):
    lay, frames = _sparse_frames(2)
    with pytest.raises(ValueError, match="weights"):
        apply_round(_zeros(lay), frames, [1.0], mode, -1.0)
    with pytest.raises(ValueError, match="weights"):
        apply_round(_zeros(lay), frames[:1], [1.0, 1.0], mode, -1.0)
    apply_round(_zeros(lay), [], [], mode, -1.0)  # nobody arrived: nothing to do
