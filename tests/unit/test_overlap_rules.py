"""worker/overlap.py: the running copy of delayed and eager overlap, the stand-in's scale,
and a late result folded in exactly: a global track that takes round t's result only after
round t + 1's running copy was made from it ends bit-identical to the sequential apply of
the same results, and each running copy is that track plus the stand-in, bit for bit."""

from __future__ import annotations

import pytest
import torch

from geoloco.compression import Compressor, Layout, decode_frame
from geoloco.config import ConfigError, load_config
from geoloco.replica import apply_round, param_digest
from geoloco.worker.overlap import running_copy, standin_scale

LAYOUT = Layout.from_named_tensors([("w", torch.zeros(32, 32)), ("b", torch.zeros(32))])


def tensors(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s.shape, generator=gen) for s in LAYOUT.specs]


def test_delayed_trains_from_the_global_track_itself() -> None:
    track = tensors(0)
    copy = running_copy("delayed", track, [tensors(1)], -0.25)
    assert all(a is b for a, b in zip(copy, track, strict=True))


def test_eager_adds_the_scaled_own_pseudo_gradients_to_a_copy() -> None:
    track, d1, d2 = tensors(0), tensors(1), tensors(2)
    before = [t.clone() for t in track]
    copy = running_copy("eager", track, [d1, d2], -0.25)
    for t, b, c, x, y in zip(track, before, copy, d1, d2, strict=True):
        assert torch.equal(t, b)  # the global track is not touched
        assert torch.equal(c, b.clone().add_(x, alpha=-0.25).add_(y, alpha=-0.25))
    assert all(a is b for a, b in zip(running_copy("eager", track, [], -0.25), track, strict=True))
    with pytest.raises(ValueError, match="no running copy"):
        running_copy("none", track, [d1], -0.25)


def test_standin_scale_is_the_outer_steps_response_to_what_the_own_pseudo_gradient_stands_for() -> None:
    sparse = load_config(overrides={"workers": 4, "outer.overlap": "eager", "outer.lr": 0.75})
    assert sparse.outer.standin == "mean"
    assert standin_scale(sparse) == -0.75  # the worker's own pseudo-gradient for the round's mean
    assert standin_scale(sparse, parts=3) == pytest.approx(-0.25)  # the mean over its 3 partitions
    share = load_config(overrides={"workers": 4, "outer.overlap": "eager", "outer.standin": "share"})
    assert standin_scale(share) == standin_scale(share, parts=3) == -1.0 / 4  # Kale et al.'s 1/n each
    dense = load_config(overrides={"workers": 2, "compression.method": "diloco"})
    assert standin_scale(dense) == pytest.approx(-0.7 * 1.9)
    with pytest.raises(ConfigError, match="outer.standin"):
        load_config(overrides={"outer.standin": "half"})


def test_a_late_result_is_folded_in_exactly() -> None:
    """Four rounds of two workers' sparse frames: the overlapped order (train round t + 1
    from a running copy, then fold round t) against the sequential order."""
    n, rounds, scale = 2, 4, -0.5
    compressors = [Compressor(LAYOUT, density=1 / 16, tile=16) for _ in range(n)]
    own = [[tensors(100 * t + i) for i in range(n)] for t in range(rounds)]
    results = [[decode_frame(compressors[i].compress(own[t][i], round=t, sender=i), LAYOUT)
                for i in range(n)] for t in range(rounds)]
    weights = [1.0 / n] * n

    sequential = tensors(7)
    tracks = []  # the sequential global track at the start of each round
    for t in range(rounds):
        tracks.append([x.clone() for x in sequential])
        apply_round(sequential, results[t], weights, "mean_kept", -1.0)

    overlapped, in_flight = tensors(7), None
    for t in range(rounds):
        if in_flight is not None:  # round t - 1's result arrives at the end of round t's phase
            apply_round(overlapped, results[in_flight], weights, "mean_kept", -1.0)
        copy = running_copy("eager", overlapped, [own[t][0]], scale)  # round t + 1 trains from it
        expected = [x.clone().add_(d, alpha=scale) for x, d in zip(tracks[t], own[t][0], strict=True)]
        assert param_digest(copy) == param_digest(expected)
        in_flight = t
    apply_round(overlapped, results[in_flight], weights, "mean_kept", -1.0)
    assert param_digest(overlapped) == param_digest(sequential)
