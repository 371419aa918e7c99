"""worker/density.py: the link-aware density stays within [density_min, density_max], is a
whole k per chunk, and follows a link whose rate changes within three pushes; a fixed
density never moves. The pushes are timed through a model of a link (latency plus bytes
over rate) fed by real frame sizes of the compressor at each chosen density."""

from __future__ import annotations

import torch

from geoloco.compression import Compressor, Layout
from geoloco.config import CompressionConfig
from geoloco.worker.density import DensityChooser, fit_density

LAYOUT = Layout.from_named_tensors([("w", torch.zeros(1024, 1024)), ("b", torch.zeros(1024))])
LOW, HIGH = 8 / 4096, 256 / 4096


def frame_bytes(density: float) -> int:
    gen = torch.Generator().manual_seed(0)
    deltas = [torch.randn(s.shape, generator=gen) for s in LAYOUT.specs]
    return len(Compressor(LAYOUT, density=density).compress(deltas, round=0, sender=0))


def push_seconds(nbytes: int, rate: float, latency: float = 0.02) -> float:
    return latency + nbytes / rate


def test_fit_density_clamps_and_rounds_to_whole_k() -> None:
    assert fit_density(0.01, 10_000, 0.01, 100.0, LOW, HIGH, 64) == HIGH
    assert fit_density(0.01, 10_000, 100.0, 0.01, LOW, HIGH, 64) == LOW
    chosen = fit_density(32 / 4096, 10_000, 1.0, 2.0, LOW, HIGH, 64)
    assert chosen == 64 / 4096 and (chosen * 4096).is_integer()


def test_auto_density_stays_in_bounds_and_follows_a_rate_change_within_three_pushes() -> None:
    chooser = DensityChooser.from_config(CompressionConfig(density="auto", density_min=LOW,
                                                           density_max=HIGH, target_push_s=0.5))
    rate, chosen = 60_000.0, []  # bytes/s; the link drops to a quarter at push 6
    for push in range(14):
        if push == 6:
            rate = 15_000.0
        density = chooser.choose()
        nbytes = frame_bytes(density)
        chooser.observe(density, nbytes, push_seconds(nbytes, rate))
        chosen.append((density, nbytes, push_seconds(nbytes, rate)))
    assert all(LOW <= d <= HIGH for d, _, _ in chosen)
    settled_fast = chosen[5]
    assert abs(settled_fast[2] - 0.5) < 0.1, chosen  # fits the target on the fast link
    # within three pushes of the change the pushes fit the target again, at a lower density
    for d, _, seconds in chosen[9:]:
        assert abs(seconds - 0.5) < 0.1 and d < settled_fast[0] / 2, chosen
    assert chooser.rate == chosen[-1][1] / chosen[-1][2]


def test_fixed_density_never_moves() -> None:
    chooser = DensityChooser.from_config(CompressionConfig(density=0.02, target_push_s=0.1))
    chooser.observe(0.02, 10_000, 5.0)
    assert chooser.choose(1.0) == 0.02


def test_under_overlap_the_target_is_the_inner_phase() -> None:
    chooser = DensityChooser.from_config(CompressionConfig(density="auto", density_min=LOW,
                                                           density_max=HIGH))
    assert chooser.choose(2.0) == 64 / 4096  # nothing timed yet: the start density
    chooser.observe(64 / 4096, 10_000, 1.0)
    assert chooser.choose(2.0) == 128 / 4096  # the push may take the 2 s the phase takes
