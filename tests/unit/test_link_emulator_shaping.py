"""The link emulator's shaping parts without sockets (geoloco.links.emulator): token bucket
timing, stall credit, and the bounds and determinism of the jitter samples."""

from __future__ import annotations

import pytest

from geoloco.links.emulator import DelayLine, Direction, TokenBucket
from geoloco.profiles import LinkProfile


def test_token_bucket_passes_a_burst_then_paces_at_the_rate():
    bucket = TokenBucket(rate_bytes_s=1000.0, burst=500.0)
    assert bucket.reserve(500, now=0.0) == 0.0  # a full bucket sends at once
    assert bucket.reserve(1000, now=0.0) == pytest.approx(1.0)  # then 1000 B/s
    assert bucket.reserve(1000, now=0.0) == pytest.approx(2.0)  # FIFO behind the first
    assert bucket.reserve(100, now=10.0) == 10.0  # refilled while idle ...
    assert bucket.tokens == pytest.approx(400.0)  # ... but never above the burst


def test_token_bucket_long_run_rate_is_exact_despite_late_wakeups():
    bucket = TokenBucket(rate_bytes_s=2_500_000.0, burst=12_500.0)
    now = 0.0
    for _ in range(200):
        depart = bucket.reserve(12_500, now)
        now = max(now, depart) + 0.001  # every wake-up is 1 ms late
    assert 200 * 12_500 / now == pytest.approx(2_500_000.0, rel=0.01)


def test_a_late_wakeup_with_data_waiting_is_made_up_but_idle_time_is_not():
    stalled = TokenBucket(rate_bytes_s=1000.0, burst=100.0)
    stalled.reserve(100, now=0.0)
    assert stalled.reserve(1000, now=0.0) == pytest.approx(1.0)
    # the relay woke 0.5 s late at t=1.5 with data waiting: that link time is credited
    assert stalled.reserve(400, now=1.5, credit_s=0.5) == 1.5  # 500 B of credit
    assert stalled.reserve(100, now=1.5) == 1.5  # the rest of the credit, not more
    assert stalled.reserve(100, now=1.5) == pytest.approx(1.6)
    idle = TokenBucket(rate_bytes_s=1000.0, burst=100.0)
    idle.reserve(100, now=0.0)
    assert idle.reserve(500, now=5.0) == pytest.approx(5.4)  # idle only refills the burst


@pytest.mark.parametrize("dist", ["uniform", "normal"])
def test_jitter_samples_stay_within_delay_plus_minus_jitter(dist):
    line = DelayLine(delay_s=0.05, jitter_s=0.01, dist=dist, seed=7)
    samples = [line.sample() for _ in range(5000)]
    assert min(samples) >= 0.04 - 1e-12 and max(samples) <= 0.06 + 1e-12
    assert max(samples) - min(samples) > 0.015
    assert sum(samples) / len(samples) == pytest.approx(0.05, abs=0.001)
    again = DelayLine(0.05, 0.01, dist, seed=7)
    assert samples[:100] == [again.sample() for _ in range(100)]


def test_no_jitter_means_a_constant_delay():
    line = DelayLine(0.02, 0.0, "normal", seed=0)
    assert {line.sample() for _ in range(10)} == {0.02}


def test_unknown_jitter_distribution_names_the_choices():
    with pytest.raises(ValueError, match="'pareto' is not one of uniform, normal"):
        DelayLine(0.02, 0.01, "pareto", seed=0)


def test_burst_and_chunk_follow_the_rate():
    slow = Direction(LinkProfile.parse("1mbit"), "uniform", 0)
    fast = Direction(LinkProfile.parse("20mbit"), "uniform", 0)
    free = Direction(LinkProfile.parse("unlimited/10ms"), "uniform", 0)
    assert slow.bucket.burst == 4096 and slow.chunk == 4096  # floor of 4 KiB
    assert fast.bucket.burst == pytest.approx(12_500) and fast.chunk == 12_500  # 5 ms at 20 Mbit/s
    assert free.bucket is None and free.chunk == 64 * 1024
